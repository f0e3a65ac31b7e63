//! The exponential in branch-free float32 arithmetic that vectorizes, for `x <= 0` only (a
//! softmax's weights, a sigmoid's `e^-|x|`): shared by the attention kernel and the SiLU of
//! `cpu_elementwise`, scalar ([`exp`]), eight lanes at a time with AVX2 ([`avx2::exp8`]) and
//! sixteen with AVX-512 ([`avx512::exp16`]), all the same polynomial to within one rounding of `f32::exp`.

/// `e^x` for `x <= 0` (softmax weights; -inf gives 0) in branch-free arithmetic that
/// vectorizes: `2^n * e^r` with `|r| <= ln2 / 2` and a degree-7 Taylor polynomial (relative
/// error < 1e-8 before rounding, i.e. within f32 rounding of `f32::exp`).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.max(-87.0); // e^-87 ~ 1.6e-38: still a normal float; below that the weight is ~0
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = EXP_COEFFS[0];
    for &c in &EXP_COEFFS[1..] {
        p = p * r + c;
    }
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// ln 2 split in two so that `n * LN2_HI` is exact for the `n` of [`exp`].
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// e^r's Taylor coefficients, highest degree first (Horner order).
const EXP_COEFFS: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use std::arch::x86_64::*;

    /// `e^x` lane by lane for `x <= 0`, as [`super::exp`].
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(super::LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(super::LN2_LO), r);
        let mut poly = _mm256_set1_ps(super::EXP_COEFFS[0]);
        for &c in &super::EXP_COEFFS[1..] {
            poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(c));
        }
        let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(poly, _mm256_castsi256_ps(two_n))
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::exp`] on sixteen lanes.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn exp16(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(super::LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(super::LN2_LO), r);
        let mut poly = _mm512_set1_ps(super::EXP_COEFFS[0]);
        for &c in &super::EXP_COEFFS[1..] {
            poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
        }
        // poly * 2^n, exactly (n >= -126: the result stays a normal float)
        _mm512_scalef_ps(poly, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_isa::Isa;

    #[test]
    fn exp_matches_std_over_the_softmax_range() {
        let mut worst = 0f32;
        for i in 0..=200_000 {
            let x = -100.0 * i as f32 / 200_000.0;
            let (got, want) = (exp(x), x.exp());
            if want > 1e-37 {
                worst = worst.max((got - want).abs() / want);
            } else {
                assert!(got < 1e-36, "exp({x}) = {got}");
            }
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), exp(-87.0));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_matches_std_over_the_softmax_range() {
        use std::arch::x86_64::*;
        if Isa::detect(Isa::Avx2) < Isa::Avx2 {
            return;
        }
        let mut worst = 0f32;
        for i in (0..=200_000).step_by(8) {
            let xs: [f32; 8] = std::array::from_fn(|l| -100.0 * (i + l) as f32 / 200_000.0);
            let mut got = [0f32; 8];
            // SAFETY: this CPU has AVX2 and FMA (checked above).
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), avx2::exp8(_mm256_loadu_ps(xs.as_ptr()))) };
            for (&x, &g) in xs.iter().zip(&got) {
                let want = x.exp();
                if want > 1e-37 {
                    worst = worst.max((g - want).abs() / want);
                } else {
                    assert!(g < 1e-36, "exp8({x}) = {g}");
                }
            }
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "needs AVX-512: `make test` runs it where the CPU has it"]
    fn avx512_sixteen_lane_exp_matches_std_over_the_softmax_range() {
        use std::arch::x86_64::*;
        assert!(Isa::detect(Isa::Avx512) >= Isa::Avx512, "no AVX-512 here");
        let mut worst = 0f32;
        for i in (0..=200_000).step_by(16) {
            let xs: [f32; 16] = std::array::from_fn(|l| -100.0 * (i + l) as f32 / 200_000.0);
            let mut got = [0f32; 16];
            // SAFETY: this CPU has AVX-512F (checked above).
            unsafe {
                _mm512_storeu_ps(
                    got.as_mut_ptr(),
                    avx512::exp16(_mm512_loadu_ps(xs.as_ptr())),
                )
            };
            for (&x, &g) in xs.iter().zip(&got) {
                let want = x.exp();
                if want > 1e-37 {
                    worst = worst.max((g - want).abs() / want);
                } else {
                    assert!(g < 1e-36, "exp16({x}) = {g}");
                }
            }
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
    }
}
