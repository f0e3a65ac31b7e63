//! Int8 KV cache elements with a scale per token and KV head (llama.cpp's `q8_0` cache, one
//! scale per head row): a byte per value plus four per head row (`head_dim` 64: 1.06 bytes per
//! value, 3.8x fewer than f32), at about seven bits of each row's largest value.
//!
//! Layout: a cache row of one token and KV head is `head_dim` [`Q8`] bytes, then the four
//! bytes of its f32 scale (native order, as the Python side's `float32` view writes them), so
//! `ROW_EXTRA` is 4 and the cache array is `[num_blocks, block_size, Hkv, head_dim + 4]` bytes.
//!
//! Invariants:
//! - Writing ([`quantize_head`], the Python side's `kv_cache.quantize_rows` the same): `scale =
//!   max|x| / 127`; where the scale is positive and finite every value is `round(x / scale)`
//!   (to nearest, ties to even), in -127..=127; otherwise (a zero row, or an infinity or NaN in
//!   it) every byte is 0 and the scale is kept as computed, so a row that held a NaN or an
//!   infinity reads as NaN (0 x inf or 0 x NaN) and the engine's finite-logits check fails the
//!   request rather than letting it attend to zeros.
//! - Reading: value = `to_f32(byte) * scale` (`KvElement::head_scale`); `to_f32`, `load8` and
//!   `load16` give the byte as an f32 integer, the same for every byte.

use crate::cpu_isa::Isa;
use crate::cpu_kv::KvElement;

/// One int8 cache byte (`#[repr(transparent)]`, so an `&[i8]` of cache bytes may be viewed as
/// `&[Q8]`, [`as_q8`]); its value is the byte times its head row's scale.
#[repr(transparent)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Q8(pub i8);

/// The bytes of a head row's f32 scale, after its values.
pub const SCALE_BYTES: usize = 4;

/// The largest magnitude a value is quantized to (-128 is never written: the range is
/// symmetric).
pub const Q8_MAX: f32 = 127.0;

/// Cache bytes as int8 elements (the same memory).
pub fn as_q8(bytes: &[i8]) -> &[Q8] {
    // SAFETY: Q8 is #[repr(transparent)] over i8: same size, alignment and validity.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len()) }
}

/// Mutable cache bytes as int8 elements (the same memory).
pub fn as_q8_mut(bytes: &mut [i8]) -> &mut [Q8] {
    // SAFETY: as in `as_q8`; the borrow is moved into the result.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len()) }
}

/// Writes one head's values `src` (`head_dim` of them) into its cache row `dst` (`head_dim +
/// SCALE_BYTES` bytes): the bytes and the scale of the module header's rule.
pub fn quantize_head(dst: &mut [Q8], src: &[f32]) {
    quantize_head_on(dst, src, Isa::detect(Isa::Avx512));
}

/// [`quantize_head`] on the widest path `isa` allows (the tests pick each).
fn quantize_head_on(dst: &mut [Q8], src: &[f32], isa: Isa) {
    let d = src.len();
    assert_eq!(dst.len(), d + SCALE_BYTES);
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: `isa` came from `Isa::detect`, so the CPU has AVX-512F; the lengths were
        // checked above.
        Isa::Avx512 | Isa::Amx if d.is_multiple_of(16) => {
            return unsafe { quantize_head_avx512(dst, src) }
        }
        // SAFETY: as above, AVX2 (every AVX-512 CPU has it).
        Isa::Avx512 | Isa::Amx | Isa::Avx2 if d.is_multiple_of(8) => {
            return unsafe { quantize_head_avx2(dst, src) }
        }
        _ => {}
    }
    let _ = isa;
    // Written so that the compiler vectorizes each loop: `max` as a compare-and-select (NaN
    // never wins it), NaN as a flag of its own.
    let amax = src
        .iter()
        .fold(0f32, |m, &x| if x.abs() > m { x.abs() } else { m });
    let nan = src.iter().fold(false, |n, &x| n | x.is_nan());
    let scale = if nan { f32::NAN } else { amax / Q8_MAX };
    let (values, scale_bytes) = dst.split_at_mut(d);
    if scale > 0.0 && scale.is_finite() {
        // x / scale + 1.5 * 2^23 rounds to an integer (to nearest, ties to even) held in the
        // low mantissa bits for |x / scale| < 2^22 (here <= 127 and a hair): the integer is
        // those bits less the constant's, without a float-to-int conversion.
        const MAGIC: f32 = 12_582_912.0;
        let magic_bits = MAGIC.to_bits() as i32;
        for (q, &x) in values.iter_mut().zip(src) {
            let n = ((x / scale + MAGIC).to_bits() as i32 - magic_bits).clamp(-127, 127);
            *q = Q8(n as i8);
        }
    } else {
        values.fill(Q8(0));
    }
    for (b, s) in scale_bytes.iter_mut().zip(scale.to_ne_bytes()) {
        *b = Q8(s as i8);
    }
}

/// [`quantize_head`] sixteen values at a time: the same maximum (NaN never wins a compare
/// there either), the same division, the same rounding (to nearest, ties to even), so the same
/// bytes for every input.
///
/// # Safety
/// On a CPU with AVX-512F, for `src.len() % 16 == 0` and `dst.len() == src.len() +
/// SCALE_BYTES`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_head_avx512(dst: &mut [Q8], src: &[f32]) {
    use std::arch::x86_64::*;
    let d = src.len();
    let mut amax = _mm512_setzero_ps();
    let mut nan: __mmask16 = 0;
    for c in (0..d).step_by(16) {
        let x = _mm512_loadu_ps(src.as_ptr().add(c));
        amax = _mm512_max_ps(_mm512_abs_ps(x), amax); // a NaN lane keeps `amax`'s
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    }
    let amax = _mm512_reduce_max_ps(amax);
    let scale = if nan != 0 { f32::NAN } else { amax / Q8_MAX };
    let (values, scale_bytes) = dst.split_at_mut(d);
    if scale > 0.0 && scale.is_finite() {
        let divisor = _mm512_set1_ps(scale);
        let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
        for c in (0..d).step_by(16) {
            let v = _mm512_div_ps(_mm512_loadu_ps(src.as_ptr().add(c)), divisor);
            let n = _mm512_cvtps_epi32(_mm512_roundscale_ps::<_MM_FROUND_TO_NEAREST_INT>(v));
            let bytes = _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(n, lo), hi));
            _mm_storeu_si128(values.as_mut_ptr().add(c).cast(), bytes);
        }
    } else {
        values.fill(Q8(0));
    }
    for (b, s) in scale_bytes.iter_mut().zip(scale.to_ne_bytes()) {
        *b = Q8(s as i8);
    }
}

/// [`quantize_head_avx512`] eight values at a time (the same bytes for every input).
///
/// # Safety
/// On a CPU with AVX2, for `src.len() % 8 == 0` and `dst.len() == src.len() + SCALE_BYTES`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_head_avx2(dst: &mut [Q8], src: &[f32]) {
    use std::arch::x86_64::*;
    let d = src.len();
    let sign = _mm256_set1_ps(-0.0);
    let mut amax = _mm256_setzero_ps();
    let mut nan = 0;
    for c in (0..d).step_by(8) {
        let x = _mm256_loadu_ps(src.as_ptr().add(c));
        amax = _mm256_max_ps(_mm256_andnot_ps(sign, x), amax); // a NaN lane keeps `amax`'s
        nan |= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), amax);
    let amax = lanes.iter().fold(0f32, |m, &x| m.max(x)); // no NaN among them
    let scale = if nan != 0 { f32::NAN } else { amax / Q8_MAX };
    let (values, scale_bytes) = dst.split_at_mut(d);
    if scale > 0.0 && scale.is_finite() {
        let divisor = _mm256_set1_ps(scale);
        let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
        for c in (0..d).step_by(8) {
            let v = _mm256_div_ps(_mm256_loadu_ps(src.as_ptr().add(c)), divisor);
            let v = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            let n = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(v), lo), hi);
            // eight i32 -> eight i16 (in order: the two halves packed) -> eight bytes
            let halves =
                _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256::<1>(n));
            let bytes = _mm_packs_epi16(halves, halves);
            _mm_storel_epi64(values.as_mut_ptr().add(c).cast(), bytes);
        }
    } else {
        values.fill(Q8(0));
    }
    for (b, s) in scale_bytes.iter_mut().zip(scale.to_ne_bytes()) {
        *b = Q8(s as i8);
    }
}

/// `dst[i] = src[i] as f32 * scale`, sixteen at a time (the same single rounding as the scalar
/// product).
///
/// # Safety
/// On a CPU with AVX-512F, for `src.len() == dst.len()`, a multiple of 16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scaled_row_avx512(src: &[Q8], scale: f32, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let factor = _mm512_set1_ps(scale);
    for c in (0..dst.len()).step_by(16) {
        let values = Q8::load16(src.as_ptr().add(c));
        _mm512_storeu_ps(dst.as_mut_ptr().add(c), _mm512_mul_ps(values, factor));
    }
}

impl KvElement for Q8 {
    const NAME: &'static str = "int8";
    const ROW_EXTRA: usize = SCALE_BYTES;
    /// The byte as an f32 integer (the value before its row's scale).
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.0 as f32
    }
    /// `x` rounded to an integer in -127..=127 (a scale of 1; NaN gives 0): the caches are
    /// written a head row at a time ([`quantize_head`]), this is only the trait's contract.
    #[inline(always)]
    fn from_f32(x: f32) -> Q8 {
        Q8(x.round_ties_even().clamp(-Q8_MAX, Q8_MAX) as i8)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Q8) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast::<__m128i>())))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Q8) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast::<__m128i>())))
    }
    fn row_to_f32(src: &[Q8], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.0 as f32);
    }
    #[inline(always)]
    fn head_scale(row: &[Q8], head_dim: usize) -> f32 {
        let b = &row[head_dim..head_dim + SCALE_BYTES];
        f32::from_ne_bytes([b[0].0 as u8, b[1].0 as u8, b[2].0 as u8, b[3].0 as u8])
    }
    #[inline(always)]
    unsafe fn head_scale_at(row: *const Q8, head_dim: usize) -> f32 {
        // SAFETY: the caller's row holds `head_dim + SCALE_BYTES` bytes
        unsafe { row.add(head_dim).cast::<f32>().read_unaligned() }
    }
    fn head_row_to_f32(src: &[Q8], dst: &mut [f32]) {
        let d = dst.len();
        let scale = Q8::head_scale(src, d);
        #[cfg(target_arch = "x86_64")]
        if d.is_multiple_of(16) && std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was just detected; `src` holds `d` values (head_scale read
            // past them) and `d % 16 == 0`.
            return unsafe { scaled_row_avx512(&src[..d], scale, dst) };
        }
        dst.iter_mut()
            .zip(src)
            .for_each(|(x, q)| *x = q.0 as f32 * scale);
    }
    fn store_heads(dst: &mut [Q8], src: &[f32], head_dim: usize) {
        let heads = src.len() / head_dim;
        assert_eq!(heads * head_dim, src.len());
        assert_eq!(dst.len(), heads * (head_dim + SCALE_BYTES));
        for (row, values) in dst
            .chunks_exact_mut(head_dim + SCALE_BYTES)
            .zip(src.chunks_exact(head_dim))
        {
            quantize_head(row, values);
        }
    }
}

/// A whole f32 cache (`[.., head_dim]` rows) quantized head row by head row (tests).
#[cfg(test)]
pub(crate) fn quantize_cache(cache: &[f32], head_dim: usize) -> Vec<Q8> {
    let mut out = vec![Q8(0); cache.len() / head_dim * (head_dim + SCALE_BYTES)];
    Q8::store_heads(&mut out, cache, head_dim);
    out
}

/// The values of a whole int8 cache as f32 (`[.., head_dim]` rows; tests).
#[cfg(test)]
pub(crate) fn dequantize_cache(cache: &[Q8], head_dim: usize) -> Vec<f32> {
    let mut out = vec![0f32; cache.len() / (head_dim + SCALE_BYTES) * head_dim];
    for (row, dst) in cache
        .chunks_exact(head_dim + SCALE_BYTES)
        .zip(out.chunks_exact_mut(head_dim))
    {
        Q8::head_row_to_f32(row, dst);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    fn values(row: &[Q8], d: usize) -> Vec<f32> {
        let mut out = vec![0f32; d];
        Q8::head_row_to_f32(row, &mut out);
        out
    }

    #[test]
    fn a_row_keeps_its_largest_value_and_rounds_the_rest_within_half_a_step() {
        let mut rng = Lcg(7);
        for d in [1, 8, 64, 128] {
            let src: Vec<f32> = (0..d).map(|_| 3.0 * rng.next_f32()).collect();
            let mut row = vec![Q8(0); d + SCALE_BYTES];
            quantize_head(&mut row, &src);
            let scale = Q8::head_scale(&row, d);
            let amax = src.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert_eq!(scale, amax / 127.0);
            for (x, (q, y)) in src.iter().zip(row.iter().zip(values(&row, d))) {
                assert_eq!(q.0 as f32, (x / scale).round_ties_even(), "{x} / {scale}");
                assert!(
                    (x - y).abs() <= 0.5 * scale * 1.0001,
                    "{x} read back as {y}"
                );
                assert_eq!(y, q.0 as f32 * scale);
            }
            // the largest magnitude is exactly +-127 steps
            let top = src.iter().position(|x| x.abs() == amax).unwrap();
            assert_eq!(row[top].0.unsigned_abs(), 127);
        }
    }

    #[test]
    fn ties_go_to_even_and_bytes_stay_in_the_symmetric_range() {
        // scale 1: 127 sets it, the halves round to even
        let src = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -127.0, 3.49];
        let mut row = vec![Q8(0); src.len() + SCALE_BYTES];
        quantize_head(&mut row, &src);
        assert_eq!(Q8::head_scale(&row, src.len()), 1.0);
        let bytes: Vec<i8> = row[..src.len()].iter().map(|q| q.0).collect();
        assert_eq!(bytes, [127, 0, 2, 2, 0, -2, -127, 3]);
    }

    #[test]
    fn zero_infinite_and_nan_rows() {
        let mut row = vec![Q8(5); 4 + SCALE_BYTES];
        quantize_head(&mut row, &[0.0, -0.0, 0.0, 0.0]);
        assert_eq!(values(&row, 4), [0.0; 4]);
        quantize_head(&mut row, &[1.0, f32::INFINITY, 0.0, 2.0]);
        assert!(
            values(&row, 4).iter().all(|x| x.is_nan()),
            "inf reads as NaN"
        );
        quantize_head(&mut row, &[1.0, f32::NAN, 0.0, 2.0]);
        assert!(values(&row, 4).iter().all(|x| x.is_nan()));
        assert!(row[..4].iter().all(|q| q.0 == 0));
    }

    #[test]
    fn store_heads_quantizes_each_head_with_its_own_scale() {
        let src = [1.0, -2.0, 100.0, 50.0]; // two heads of 2
        let mut dst = vec![Q8(0); 2 * (2 + SCALE_BYTES)];
        Q8::store_heads(&mut dst, &src, 2);
        assert_eq!(Q8::head_scale(&dst[..6], 2), 2.0 / 127.0);
        assert_eq!(Q8::head_scale(&dst[6..], 2), 100.0 / 127.0);
        assert_eq!(dst[0].0, 64); // 1 / (2 / 127) = 63.5 -> 64 (to even)
        assert_eq!([dst[1].0, dst[6].0, dst[7].0], [-127, 127, 64]);
    }

    /// The scalar quantizer (every CPU, any head_dim), written out again for the comparison.
    fn quantize_head_scalar(src: &[f32]) -> Vec<Q8> {
        let d = src.len();
        let mut out = vec![Q8(0); d + 1 + SCALE_BYTES]; // one more value: not a multiple of 16
        let mut longer = src.to_vec();
        longer.push(0.0);
        quantize_head(&mut out, &longer);
        let scale = Q8::head_scale(&out, d + 1);
        let mut row: Vec<Q8> = out[..d].to_vec();
        row.extend(scale.to_ne_bytes().map(|b| Q8(b as i8)));
        row
    }

    #[test]
    fn the_simd_quantizer_writes_the_scalar_ones_bytes() {
        let mut rng = Lcg(11);
        for d in [8, 16, 24, 64, 128] {
            for case in 0..300 {
                let mut src: Vec<f32> = (0..d).map(|_| rng.next_f32() * 5.0).collect();
                match case % 6 {
                    0 => src.iter_mut().for_each(|x| *x = (*x * 4.0).round() / 4.0), // ties
                    1 => src[case % d] = f32::NAN,
                    2 => src[case % d] = f32::NEG_INFINITY,
                    3 => src.iter_mut().for_each(|x| *x = 0.0),
                    4 => src.iter_mut().for_each(|x| *x *= 1e-30), // tiny scales
                    _ => {}
                }
                let want = quantize_head_scalar(&src);
                for isa in [Isa::Avx2, Isa::Avx512] {
                    if Isa::detect(isa) != isa {
                        continue; // this CPU lacks it
                    }
                    let mut got = vec![Q8(0); d + SCALE_BYTES];
                    quantize_head_on(&mut got, &src, isa);
                    assert_eq!(got, want, "{isa:?}, d {d}, case {case}");
                }
            }
        }
    }

    #[test]
    fn a_head_row_reads_as_each_byte_times_its_scale() {
        let mut rng = Lcg(5);
        for d in [8, 16, 64, 72, 128] {
            let src: Vec<f32> = (0..d).map(|_| 9.0 * rng.next_f32()).collect();
            let mut row = vec![Q8(0); d + SCALE_BYTES];
            quantize_head(&mut row, &src);
            let scale = Q8::head_scale(&row, d);
            let want: Vec<f32> = row[..d].iter().map(|q| q.0 as f32 * scale).collect();
            assert_eq!(values(&row, d), want, "d {d}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_loads_match_to_f32_on_every_byte() {
        use std::arch::x86_64::*;
        let bytes: Vec<Q8> = (0..=255u8).map(|b| Q8(b as i8)).collect();
        let want: Vec<f32> = bytes.iter().map(|q| q.to_f32()).collect();
        let mut got = vec![0f32; 256];
        if std::is_x86_feature_detected!("avx2") {
            for i in (0..256).step_by(8) {
                // SAFETY: AVX2 detected; 8 readable bytes at i.
                unsafe { _mm256_storeu_ps(got[i..].as_mut_ptr(), Q8::load8(bytes[i..].as_ptr())) };
            }
            assert_eq!(got, want);
        }
        if std::is_x86_feature_detected!("avx512f") {
            got.fill(0.0);
            for i in (0..256).step_by(16) {
                // SAFETY: AVX-512F detected; 16 readable bytes at i.
                unsafe { _mm512_storeu_ps(got[i..].as_mut_ptr(), Q8::load16(bytes[i..].as_ptr())) };
            }
            assert_eq!(got, want);
        }
    }
}
