//! The model's elementwise ops on the CPU (float32), one call each instead of several torch ops:
//! RMSNorm, the rotate-half RoPE, and SiLU-and-mul / GELU-tanh-and-mul (the last two used by the
//! fused decode step, `cpu_decoder`; the Python modules keep torch's `silu` / `gelu` + `mul`,
//! which an earlier scalar loop here did not beat at 16-256 rows).
//!
//! Invariants checked before any read or write (a `KernelInputError` otherwise): every buffer
//! holds whole rows of the widths its function names, and inputs and outputs agree on the row
//! count. Single-threaded: a decode step's rows are a few KB, a prefill chunk's a few MB
//! streamed once.

use crate::cpu_error::KernelInputError;
use crate::cpu_exp::exp;
use crate::cpu_isa::Isa;

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

/// The gate's activation of a fused gate/up projection: SiLU (SwiGLU: Llama, Qwen, ...) or
/// GELU in its tanh form (GeGLU: Gemma).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateActivation {
    Silu,
    GeluTanh,
}

/// `out[r, i] = silu(g) * u` with `g = gate_up[r, i]`, `u = gate_up[r, I + i]` for every row of
/// `gate_up` `[M, 2I]` and `out` `[M, I]` (`I = intermediate`): the SwiGLU activation on a fused
/// gate/up projection. `silu(g) = g * sigmoid(g)`, the sigmoid from `e^-|g|` (no overflow).
pub fn silu_and_mul_f32(
    gate_up: &[f32],
    intermediate: usize,
    out: &mut [f32],
) -> Result<(), KernelInputError> {
    gated_and_mul(
        gate_up,
        intermediate,
        out,
        GateActivation::Silu,
        Isa::Avx512,
    )
}

/// As [`silu_and_mul_f32`] with the gate's activation `act`: GELU's tanh form is
/// `0.5 g (1 + tanh(y))`, `y = sqrt(2 / pi) (g + 0.044715 g^3)`, computed as
/// `g * sigmoid(2 y)` (the same function; the sigmoid as SiLU's).
pub fn gate_and_mul_f32(
    gate_up: &[f32],
    intermediate: usize,
    out: &mut [f32],
    act: GateActivation,
) -> Result<(), KernelInputError> {
    gated_and_mul(gate_up, intermediate, out, act, Isa::Avx512)
}

/// [`gate_and_mul_f32`] using at most instruction set `max_isa` (tests compare both paths).
fn gated_and_mul(
    gate_up: &[f32],
    intermediate: usize,
    out: &mut [f32],
    act: GateActivation,
    max_isa: Isa,
) -> Result<(), KernelInputError> {
    if intermediate == 0
        || !out.len().is_multiple_of(intermediate)
        || gate_up.len() != 2 * out.len()
    {
        return bad(format!(
            "{act:?} and mul: gate_up has {} elements and out {}; need [M, 2 * \
             {intermediate}] and [M, {intermediate}]",
            gate_up.len(),
            out.len()
        ));
    }
    let rows = gate_up
        .chunks_exact(2 * intermediate)
        .zip(out.chunks_exact_mut(intermediate));
    #[cfg(target_arch = "x86_64")]
    if Isa::detect(max_isa) >= Isa::Avx2 {
        for (row, dst) in rows {
            let (gate, up) = row.split_at(intermediate);
            // SAFETY: this CPU has AVX2 and FMA (detected above).
            unsafe { gated_and_mul_avx2(gate, up, dst, act) };
        }
        return Ok(());
    }
    let _ = max_isa;
    for (row, dst) in rows {
        let (gate, up) = row.split_at(intermediate);
        for ((d, &g), &u) in dst.iter_mut().zip(gate).zip(up) {
            *d = activate(g, act) * u;
        }
    }
    Ok(())
}

/// `2 sqrt(2 / pi)` and GELU's cubic coefficient: GELU-tanh(x) = x * sigmoid(`GELU_2C` * (x +
/// `GELU_A` x^3)).
const GELU_2C: f32 = (std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::SQRT_2) as f32;
const GELU_A: f32 = 0.044_715;

/// The activation of one gate value: `x * sigmoid(z)`, `z = x` (SiLU) or GELU's `2 y`.
#[inline(always)]
fn activate(x: f32, act: GateActivation) -> f32 {
    let z = match act {
        GateActivation::Silu => x,
        GateActivation::GeluTanh => GELU_2C * (x + GELU_A * x * x * x),
    };
    x * sigmoid(z)
}

/// `1 / (1 + e^-z)`; `e^-|z|` keeps the exponential in `exp`'s domain (`<= 0`).
#[inline(always)]
fn sigmoid(z: f32) -> f32 {
    let t = exp(-z.abs());
    let num = if z.is_sign_negative() { t } else { 1.0 };
    num / (1.0 + t)
}

/// [`activate`] of `gate` times `up` into `out`, eight lanes at a time (same arithmetic).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gated_and_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32], act: GateActivation) {
    use std::arch::x86_64::*;
    let n = out.len().min(gate.len()).min(up.len());
    let full = n / 8 * 8;
    let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
    let (c2, a) = (_mm256_set1_ps(GELU_2C), _mm256_set1_ps(GELU_A));
    let (g, u, o) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
    for c in (0..full).step_by(8) {
        let x = _mm256_loadu_ps(g.add(c));
        let z = match act {
            GateActivation::Silu => x,
            GateActivation::GeluTanh => {
                // the scalar's order: x + (a * x * x) * x, then times 2c
                let cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(a, x), x), x);
                _mm256_mul_ps(c2, _mm256_add_ps(x, cube))
            }
        };
        let t = crate::cpu_exp::avx2::exp8(_mm256_or_ps(z, sign)); // e^-|z|
        let num = _mm256_blendv_ps(one, t, z); // t where z's sign bit is set
        let s = _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, t)));
        _mm256_storeu_ps(o.add(c), _mm256_mul_ps(s, _mm256_loadu_ps(u.add(c))));
    }
    for c in full..n {
        out[c] = activate(gate[c], act) * up[c];
    }
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

    /// `gate_up` `[M, 2 inter]` through `act`-and-mul on every path against `act_f64(g) * u`
    /// within `tol` (relative; infinite and NaN results equal).
    fn check_gate_and_mul(
        gate_up: &[f32],
        inter: usize,
        act: GateActivation,
        act_f64: fn(f64) -> f64,
        tol: f64,
    ) {
        for isa in [Isa::Portable, Isa::Avx2] {
            let mut out = vec![f32::NAN; gate_up.len() / 2];
            gated_and_mul(gate_up, inter, &mut out, act, isa).unwrap();
            for (r, row) in gate_up.chunks(2 * inter).enumerate() {
                for i in 0..inter {
                    let (g, u) = (row[i] as f64, row[inter + i] as f64);
                    let want = act_f64(g) * u;
                    let got = out[r * inter + i] as f64;
                    let ok = if want.is_finite() {
                        (got - want).abs() <= tol * want.abs() + 1e-30
                    } else {
                        got == want || (got.is_nan() && want.is_nan())
                    };
                    assert!(ok, "{isa:?} {act:?}({g}) * {u}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn silu_and_mul_matches_an_f64_reference_on_every_path() {
        let inter = 37; // a tail past the vector width
        let gate_up: Vec<f32> = (0..3 * 2 * inter)
            .map(|i| ((i * 7919) % 211) as f32 * 0.9 - 95.0)
            .chain(
                [f32::INFINITY, -0.0, 0.0, 1e-30, -1e-30, 200.0]
                    .into_iter()
                    .cycle()
                    .take(2 * inter),
            )
            .collect();
        let silu = |g: f64| g / (1.0 + (-g).exp());
        check_gate_and_mul(&gate_up, inter, GateActivation::Silu, silu, 1e-6);
        let mut out = vec![0f32; 4];
        assert!(silu_and_mul_f32(&[1.0; 6], 2, &mut out).is_err());
        assert!(silu_and_mul_f32(&[1.0; 8], 0, &mut out).is_err());
        silu_and_mul_f32(&[], 3, &mut []).unwrap();
    }

    #[test]
    fn gelu_tanh_and_mul_matches_an_f64_reference_on_every_path() {
        let inter = 45; // a tail past the vector width
        let gate_up: Vec<f32> = (0..4 * 2 * inter)
            .map(|i| ((i * 7919) % 401) as f32 * 0.03 - 6.0)
            .chain(
                [-0.0, 0.0, 1e-30, -1e-30, 30.0, -30.0, 1e4, -1e4]
                    .into_iter()
                    .cycle()
                    .take(2 * inter),
            )
            .collect();
        let gelu = |g: f64| {
            let y = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3));
            0.5 * g * (1.0 + y.tanh())
        };
        check_gate_and_mul(&gate_up, inter, GateActivation::GeluTanh, gelu, 2e-6);
        let mut out = vec![0f32; 4];
        let act = GateActivation::GeluTanh;
        assert!(gate_and_mul_f32(&[1.0; 6], 2, &mut out, act).is_err());
        // SiLU through the general entry is silu_and_mul's, bit for bit
        let gate_up: Vec<f32> = (0..2 * 40).map(|i| i as f32 * 0.37 - 13.0).collect();
        let (mut a, mut b) = (vec![0f32; 40], vec![0f32; 40]);
        silu_and_mul_f32(&gate_up, 20, &mut a).unwrap();
        gate_and_mul_f32(&gate_up, 20, &mut b, GateActivation::Silu).unwrap();
        assert_eq!(a, b);
    }
}
