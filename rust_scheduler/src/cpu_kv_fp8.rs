//! FP8 E4M3 KV cache elements (OCP FP8's E4M3, torch's `float8_e4m3fn`, vLLM's
//! `--kv-cache-dtype fp8`): a byte per value, a quarter of f32's memory traffic in decode
//! attention and four times the tokens per GiB, at three mantissa bits.
//!
//! Encoding: sign, four exponent bits (bias 7), three mantissa bits; exponent 0 holds the
//! subnormals (multiples of 2^-9); the largest finite value is 448 (`0x7e`); `0x7f` / `0xff` are
//! NaN; there are no infinities.
//!
//! Invariants:
//! - [`F8E4M3::from_f32`] rounds to nearest, ties to even, and saturates: every value beyond
//!   ±448, infinities included, becomes ±448 (what vLLM's saturating conversion does; torch's
//!   own conversion gives NaN there, so the Python side clamps to ±448 before converting, and
//!   then both give the same byte for every f32). NaN stays NaN, so the engine's
//!   finite-logits check still sees a model that produced one.
//! - [`F8E4M3::to_f32`], `load8` and `load16` give the same f32 for every byte (NaN for the two
//!   NaN codes), so a kernel over an FP8 cache computes what it computes over an f32 cache
//!   holding the FP8 values (`cpu_kv`'s invariant).
//!
//! The SIMD conversion goes through f16, whose conversion instructions every x86 path here has:
//! the byte, sign-extended to 16 bits and shifted left by 7, with bit 14 cleared, is an f16 of
//! the same sign, exponent and mantissa bits, whose value is the FP8 value times 2^-8 (the
//! exponent biases are 15 and 7), subnormals included; one multiply by 256 gives the value.

use crate::cpu_kv::KvElement;

/// One FP8 E4M3 value (its byte; `#[repr(transparent)]`, so a `&[u8]` of cache bytes may be
/// viewed as `&[F8E4M3]`, [`as_fp8`]).
#[repr(transparent)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct F8E4M3(pub u8);

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Every byte's value (NaN for `0x7f` and `0xff`).
static E4M3_VALUES: [f32; 256] = {
    let mut table = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = decode(b as u8);
        b += 1;
    }
    table
};

/// The value of byte `b`, from its fields (the reference the table and the tests use).
const fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = ((b >> 3) & 0xf) as i32;
    let mantissa = (b & 7) as f32;
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    if exponent == 0 {
        return sign * mantissa * (1.0 / 512.0); // subnormal: mantissa * 2^-9
    }
    // 2^(exponent - 7), exactly, from its f32 bits
    let power = f32::from_bits(((exponent - 7 + 127) as u32) << 23);
    sign * power * (1.0 + mantissa / 8.0)
}

impl F8E4M3 {
    /// The nearest E4M3 value to `x` (ties to even), saturated to ±448; NaN stays NaN.
    pub fn from_f32(x: f32) -> F8E4M3 {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let magnitude = f32::from_bits(bits & 0x7fff_ffff);
        if magnitude.is_nan() {
            return F8E4M3(sign | 0x7f);
        }
        if magnitude >= E4M3_MAX {
            return F8E4M3(sign | 0x7e);
        }
        if magnitude < 1.0 / 64.0 {
            // the subnormal range: multiples of 2^-9 (exact scaling, then ties to even); 8 is
            // the smallest normal's code, 2^-6
            return F8E4M3(sign | (magnitude * 512.0).round_ties_even() as u8);
        }
        // normal: f32's 23 mantissa bits rounded to 3, ties to even (a carry moves into the
        // exponent); below 448 the result is at most 448 itself (e 15, m 6)
        let abs_bits = bits & 0x7fff_ffff;
        let rounded = (abs_bits + 0x7_ffff + ((abs_bits >> 20) & 1)) & !0xf_ffff;
        let exponent = (rounded >> 23) - (127 - 7);
        let mantissa = (rounded >> 20) & 7;
        F8E4M3(sign | ((exponent << 3) | mantissa) as u8)
    }

    /// The value (NaN for the NaN codes).
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        E4M3_VALUES[self.0 as usize]
    }
}

/// Cache bytes as FP8 values (the same memory).
pub fn as_fp8(bytes: &[u8]) -> &[F8E4M3] {
    // SAFETY: F8E4M3 is a #[repr(transparent)] u8: same size, alignment and validity.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len()) }
}

/// Mutable cache bytes as FP8 values (the same memory).
pub fn as_fp8_mut(bytes: &mut [u8]) -> &mut [F8E4M3] {
    // SAFETY: as in `as_fp8`; the borrow is moved into the result.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len()) }
}

impl KvElement for F8E4M3 {
    const NAME: &'static str = "float8_e4m3fn";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        F8E4M3::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> F8E4M3 {
        F8E4M3::from_f32(x)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const F8E4M3) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let bytes = _mm_loadl_epi64(p.cast::<__m128i>());
        let halves = _mm_and_si128(
            _mm_slli_epi16::<7>(_mm_cvtepi8_epi16(bytes)),
            _mm_set1_epi16(!0x4000),
        );
        let scaled = _mm256_cvtph_ps(halves); // the value * 2^-8; NaN codes read 1.875
        let magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0), scaled);
        let nan = _mm256_cmp_ps::<_CMP_GT_OQ>(magnitude, _mm256_set1_ps(1.8));
        _mm256_or_ps(_mm256_mul_ps(scaled, _mm256_set1_ps(256.0)), nan)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const F8E4M3) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let bytes = _mm_loadu_si128(p.cast::<__m128i>());
        let halves = _mm256_and_si256(
            _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(bytes)),
            _mm256_set1_epi16(!0x4000),
        );
        let scaled = _mm512_cvtph_ps(halves); // the value * 2^-8; NaN codes read 1.875
        let finite = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(_mm512_abs_ps(scaled), _mm512_set1_ps(1.8));
        _mm512_mask_mul_ps(
            _mm512_set1_ps(f32::NAN),
            finite,
            scaled,
            _mm512_set1_ps(256.0),
        )
    }
    fn row_to_f32(src: &[F8E4M3], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
    fn store_row(dst: &mut [F8E4M3], src: &[f32]) {
        assert_eq!(dst.len(), src.len());
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was just detected; the lengths are equal.
            return unsafe { store_row_avx512(dst, src) };
        }
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = F8E4M3::from_f32(s));
    }
}

/// [`F8E4M3::from_f32`] sixteen values at a time (the same byte for every f32: the same
/// rounding of the same bits, lane by lane; the tail one at a time).
///
/// # Safety
/// On a CPU with AVX-512F, for `dst.len() == src.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store_row_avx512(dst: &mut [F8E4M3], src: &[f32]) {
    use std::arch::x86_64::*;
    let n = src.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        let bits = _mm512_loadu_si512(src.as_ptr().add(i).cast());
        let sign = _mm512_and_si512(_mm512_srli_epi32::<24>(bits), _mm512_set1_epi32(0x80));
        let abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fff_ffff));
        let magnitude = _mm512_castsi512_ps(abs_bits);
        // normal: 23 mantissa bits rounded to 3, ties to even; (exponent << 3 | mantissa) is
        // the rounded bits >> 20, less f32's exponent bias over E4M3's (120) << 3
        let odd = _mm512_and_si512(_mm512_srli_epi32::<20>(abs_bits), _mm512_set1_epi32(1));
        let rounded =
            _mm512_add_epi32(_mm512_add_epi32(abs_bits, _mm512_set1_epi32(0x7_ffff)), odd);
        let normal = _mm512_sub_epi32(
            _mm512_srli_epi32::<20>(rounded),
            _mm512_set1_epi32(120 << 3),
        );
        // subnormal: multiples of 2^-9 (exact scaling), rounded to nearest even
        const NEAREST_EVEN: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let subnormal = _mm512_cvt_roundps_epi32::<NEAREST_EVEN>(_mm512_mul_ps(
            magnitude,
            _mm512_set1_ps(512.0),
        ));
        let is_subnormal = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(magnitude, _mm512_set1_ps(1.0 / 64.0));
        let saturated = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(magnitude, _mm512_set1_ps(E4M3_MAX));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(magnitude, magnitude);
        let mut code = _mm512_mask_blend_epi32(is_subnormal, normal, subnormal);
        code = _mm512_mask_blend_epi32(saturated, code, _mm512_set1_epi32(0x7e));
        code = _mm512_mask_blend_epi32(nan, code, _mm512_set1_epi32(0x7f));
        code = _mm512_or_si512(code, sign);
        _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi8(code));
    }
    dst[n..]
        .iter_mut()
        .zip(&src[n..])
        .for_each(|(d, &s)| *d = F8E4M3::from_f32(s));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_bytes() -> impl Iterator<Item = F8E4M3> {
        (0..=255u8).map(F8E4M3)
    }

    #[test]
    fn the_table_holds_the_format_s_values() {
        assert_eq!(F8E4M3(0x7e).to_f32(), 448.0);
        assert_eq!(F8E4M3(0xfe).to_f32(), -448.0);
        assert_eq!(F8E4M3(0x08).to_f32(), 1.0 / 64.0); // the smallest normal
        assert_eq!(F8E4M3(0x01).to_f32(), 1.0 / 512.0); // the smallest subnormal
        assert_eq!(F8E4M3(0x38).to_f32(), 1.0); // exponent 7, mantissa 0
        assert_eq!(F8E4M3(0x3c).to_f32(), 1.5);
        assert_eq!(F8E4M3(0x80).to_f32().to_bits(), (-0.0f32).to_bits());
        assert!(F8E4M3(0x7f).to_f32().is_nan() && F8E4M3(0xff).to_f32().is_nan());
        let finite: Vec<f32> = (0..0x7f).map(|b| F8E4M3(b).to_f32()).collect();
        assert!(
            finite.windows(2).all(|w| w[0] < w[1]),
            "codes ascend with their values"
        );
    }

    #[test]
    fn every_value_converts_back_to_its_own_byte() {
        for b in all_bytes().filter(|b| b.0 & 0x7f != 0x7f) {
            assert_eq!(F8E4M3::from_f32(b.to_f32()), b, "{:#04x}", b.0);
        }
        assert_eq!(F8E4M3::from_f32(f32::NAN).0 & 0x7f, 0x7f);
    }

    #[test]
    fn rounding_is_to_nearest_with_ties_to_even_and_saturates() {
        // every pair of neighbours: a hair either side of the midpoint, and the midpoint itself
        for lo in 0..0x7eu8 {
            let (a, b) = (F8E4M3(lo).to_f32(), F8E4M3(lo + 1).to_f32());
            let mid = (a + b) / 2.0; // exact in f32
            let even = if lo % 2 == 0 { lo } else { lo + 1 };
            for sign in [0u8, 0x80] {
                let s = if sign == 0 { 1.0 } else { -1.0 };
                assert_eq!(F8E4M3::from_f32(s * mid).0, sign | even, "tie at {mid}");
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                assert_eq!(F8E4M3::from_f32(s * below).0, sign | lo, "below {mid}");
                assert_eq!(
                    F8E4M3::from_f32(s * above).0,
                    sign | (lo + 1),
                    "above {mid}"
                );
            }
        }
        for x in [448.0, 460.0, 464.0, 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(F8E4M3::from_f32(x).0, 0x7e, "{x}");
            assert_eq!(F8E4M3::from_f32(-x).0, 0xfe, "{}", -x);
        }
        assert_eq!(F8E4M3::from_f32(1e-30).0, 0);
        assert_eq!(F8E4M3::from_f32(-1e-30).0, 0x80);
        assert_eq!(
            F8E4M3::from_f32(1.0 / 1024.0).0,
            0,
            "half the smallest subnormal: to even"
        );
    }

    #[test]
    fn row_to_f32_and_the_views_keep_every_byte() {
        let bytes: Vec<u8> = (0..=255u8).collect();
        let mut got = vec![0f32; 256];
        F8E4M3::row_to_f32(as_fp8(&bytes), &mut got);
        for (b, g) in bytes.iter().zip(&got) {
            assert_eq!(g.to_bits(), F8E4M3(*b).to_f32().to_bits());
        }
        let mut cache = vec![0u8; 4];
        F8E4M3::store_row(as_fp8_mut(&mut cache), &[1.5, -448.0, 1e9, 0.0]);
        assert_eq!(cache, [0x3c, 0xfe, 0x7e, 0x00]);
    }

    #[test]
    fn store_row_rounds_every_value_as_from_f32() {
        // random bit patterns (every exponent, NaNs and infinities included), every code's value,
        // the midpoints between neighbours and a hair either side, in rows with a tail
        let mut rng = crate::test_rng::Lcg(45);
        let mut xs: Vec<f32> = (0..20_000)
            .map(|_| f32::from_bits(rng.next_u32()))
            .collect();
        xs.extend((0..20_000).map(|_| rng.next_f32() * 300.0));
        xs.extend((0..20_000).map(|_| rng.next_f32() * 0.025));
        for lo in 0..0x7eu8 {
            let (a, b) = (F8E4M3(lo).to_f32(), F8E4M3(lo + 1).to_f32());
            let mid = (a + b) / 2.0;
            for x in [
                a,
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                xs.extend([x, -x]);
            }
        }
        xs.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            448.0,
            464.0,
            1e-45,
        ]);
        let want: Vec<F8E4M3> = xs.iter().map(|&x| F8E4M3::from_f32(x)).collect();
        for len in [xs.len(), 37, 16, 5] {
            let mut got = vec![F8E4M3(0x55); len];
            F8E4M3::store_row(&mut got, &xs[..len]);
            assert_eq!(got, want[..len]);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_loads_match_to_f32_on_every_byte() {
        use std::arch::x86_64::*;
        let bytes: Vec<F8E4M3> = all_bytes().collect();
        let same = |got: &[f32], from: usize| {
            for (i, g) in got.iter().enumerate() {
                let want = bytes[from + i].to_f32();
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "byte {:#04x}: {g} vs {want}",
                    from + i
                );
            }
        };
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
            for from in (0..256).step_by(8) {
                let mut got = [0f32; 8];
                // SAFETY: AVX2 and F16C detected; 8 readable elements at `from`.
                unsafe {
                    _mm256_storeu_ps(got.as_mut_ptr(), F8E4M3::load8(bytes[from..].as_ptr()))
                };
                same(&got, from);
            }
        }
        if std::is_x86_feature_detected!("avx512f") {
            for from in (0..256).step_by(16) {
                let mut got = [0f32; 16];
                // SAFETY: AVX-512F detected; 16 readable elements at `from`.
                unsafe {
                    _mm512_storeu_ps(got.as_mut_ptr(), F8E4M3::load16(bytes[from..].as_ptr()))
                };
                same(&got, from);
            }
        }
    }
}
