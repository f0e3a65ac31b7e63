//! RMSNorm on the CPU (float32): `out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight`, row by row.
//!
//! Invariants checked by [`rms_norm_f32`] before any read: `weight` is non-empty, `x` and `out`
//! hold whole rows of `weight.len()` elements and have the same length. Single-threaded: a
//! decode step's rows are a few KB, and a prefill chunk's are memory-bound at a few MB.

use crate::cpu_linear::LinearInputError;

/// Normalizes every row of `x` into `out`. Sums of squares are accumulated in f32 over 8 lanes
/// (the compiler vectorizes them), like torch's float32 `mean`.
pub fn rms_norm_f32(
    x: &[f32],
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), LinearInputError> {
    let hidden = weight.len();
    if hidden == 0 || x.len() % hidden != 0 || out.len() != x.len() {
        return Err(LinearInputError(format!(
            "rms_norm: x has {} elements and out {}, both must be whole rows of weight's {}",
            x.len(),
            out.len(),
            hidden
        )));
    }
    for (row, dst) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
        let mut lanes = [0f32; 8];
        let mut chunks = row.chunks_exact(8);
        for chunk in &mut chunks {
            for (lane, &v) in lanes.iter_mut().zip(chunk) {
                *lane += v * v;
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        let sum_sq = lanes.iter().sum::<f32>() + tail;
        let inv = 1.0 / (sum_sq / hidden as f32 + eps).sqrt();
        for ((d, &v), &w) in dst.iter_mut().zip(row).zip(weight) {
            *d = v * inv * w;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_an_f64_reference() {
        for &(rows, hidden) in &[(1, 8), (3, 13), (5, 576), (2, 1)] {
            let x: Vec<f32> = (0..rows * hidden)
                .map(|i| ((i * 7919) % 103) as f32 / 17.0 - 3.0)
                .collect();
            let w: Vec<f32> = (0..hidden).map(|i| 0.5 + (i % 5) as f32 * 0.25).collect();
            let mut out = vec![f32::NAN; x.len()];
            rms_norm_f32(&x, &w, 1e-5, &mut out).unwrap();
            for (r, row) in x.chunks(hidden).enumerate() {
                let ms: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hidden as f64;
                let inv = 1.0 / (ms + 1e-5).sqrt();
                for j in 0..hidden {
                    let want = row[j] as f64 * inv * w[j] as f64;
                    let got = out[r * hidden + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn rejects_partial_rows() {
        let mut out = vec![0f32; 6];
        assert!(rms_norm_f32(&[1.0; 6], &[1.0; 4], 1e-6, &mut out).is_err());
        assert!(rms_norm_f32(&[1.0; 8], &[1.0; 4], 1e-6, &mut out).is_err());
        assert!(rms_norm_f32(&[], &[], 1e-6, &mut []).is_err());
        rms_norm_f32(&[], &[1.0; 4], 1e-6, &mut []).unwrap();
    }
}
