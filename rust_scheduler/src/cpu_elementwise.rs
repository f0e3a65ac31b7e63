//! The model's elementwise ops on the CPU (float32), one call each instead of several torch ops:
//! RMSNorm and the rotate-half RoPE. (SiLU-and-mul stays in torch: a polynomial-exp loop here
//! measured 1.2-1.5x slower than torch's vectorized `silu` + `mul`.)
//!
//! Invariants checked before any read or write (a `KernelInputError` otherwise): every buffer
//! holds whole rows of the widths its function names, and inputs and outputs agree on the row
//! count. Single-threaded: a decode step's rows are a few KB, a prefill chunk's a few MB
//! streamed once.

use crate::cpu_error::KernelInputError;

fn bad<T>(msg: String) -> Result<T, KernelInputError> {
    Err(KernelInputError(msg))
}

/// Normalizes every row of `x` into `out`. Sums of squares are accumulated in f32 over 8 lanes
/// (the compiler vectorizes them), like torch's float32 `mean`.
pub fn rms_norm_f32(
    x: &[f32],
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), KernelInputError> {
    let hidden = weight.len();
    if hidden == 0 || !x.len().is_multiple_of(hidden) || out.len() != x.len() {
        return Err(KernelInputError(format!(
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

/// Rotates every head of `x` `[T, heads, head_dim]` in place by its token's angles:
/// `x[i] * cos[i] - x[i + half] * sin[i]` for the first half, `x[i] * cos[i] + x[i - half] *
/// sin[i]` for the second (`cos` / `sin` `[T, head_dim]`, each half repeated, as built by
/// `RotaryEmbedding`).
pub fn rotary_f32(
    x: &mut [f32],
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
) -> Result<(), KernelInputError> {
    let rows = cos.len().checked_div(head_dim).unwrap_or(0);
    if head_dim == 0
        || !head_dim.is_multiple_of(2)
        || !cos.len().is_multiple_of(head_dim)
        || sin.len() != cos.len()
        || (rows == 0 && !x.is_empty())
        || (rows > 0 && !x.len().is_multiple_of(rows * head_dim))
    {
        return bad(format!(
            "rotary: x has {} elements, cos {} and sin {}; need [T, heads, {head_dim}] and \
             [T, {head_dim}] with an even head_dim",
            x.len(),
            cos.len(),
            sin.len()
        ));
    }
    if x.is_empty() {
        return Ok(());
    }
    let half = head_dim / 2;
    let per_token = x.len() / rows;
    for ((token, c), s) in x
        .chunks_exact_mut(per_token)
        .zip(cos.chunks_exact(head_dim))
        .zip(sin.chunks_exact(head_dim))
    {
        for head in token.chunks_exact_mut(head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * c[i] - b * s[i];
                hi[i] = b * c[half + i] + a * s[half + i];
            }
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
    fn rotary_matches_the_rotate_half_formula() {
        let (tokens, heads, d) = (3, 2, 8);
        let x0: Vec<f32> = (0..tokens * heads * d)
            .map(|i| i as f32 * 0.1 - 2.0)
            .collect();
        let angle = |t: usize, i: usize| (t as f32 + 1.0) * (i % (d / 2)) as f32 * 0.3;
        let cos: Vec<f32> = (0..tokens * d).map(|j| angle(j / d, j % d).cos()).collect();
        let sin: Vec<f32> = (0..tokens * d).map(|j| angle(j / d, j % d).sin()).collect();
        let mut x = x0.clone();
        rotary_f32(&mut x, d, &cos, &sin).unwrap();
        for t in 0..tokens {
            for h in 0..heads {
                let base = (t * heads + h) * d;
                for i in 0..d {
                    let rotated = if i < d / 2 {
                        -x0[base + i + d / 2]
                    } else {
                        x0[base + i - d / 2]
                    };
                    let want = x0[base + i] * cos[t * d + i] + rotated * sin[t * d + i];
                    assert!((x[base + i] - want).abs() < 1e-5, "t{t} h{h} i{i}");
                }
            }
        }
        assert!(rotary_f32(&mut x, 7, &cos[..21], &sin[..21]).is_err()); // odd head_dim
        assert!(rotary_f32(&mut x[1..], d, &cos, &sin).is_err());
        assert!(rotary_f32(&mut x, d, &cos, &sin[1..]).is_err());
        rotary_f32(&mut [], d, &[], &[]).unwrap();
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
