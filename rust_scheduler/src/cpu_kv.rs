//! The element types a paged KV cache may hold on the CPU: `f32` (the model's own precision, the
//! default) or IEEE `f16` (half the bytes: twice the tokens per GiB, and half the memory traffic
//! of decode attention, which waits on memory), or FP8 E4M3 (`cpu_kv_fp8`: a quarter of the
//! bytes), or int8 with a scale per token and KV head (`cpu_kv_q8`: a quarter of the bytes plus
//! four per head row).
//!
//! A cache row of one token and KV head holds `head_dim + E::ROW_EXTRA` elements: the head's
//! values, then (scaled types only) the bytes of the f32 its values are multiplied by
//! ([`KvElement::head_scale`]); the unscaled types have no extra elements and a scale of 1.
//!
//! Invariants:
//! - The kernels compute in f32 whatever the cache holds: an element enters the math only as
//!   [`KvElement::to_f32`] (or `load8`, the same conversion eight at a time), so a kernel over an
//!   f16 cache gives what the same kernel gives over an f32 cache holding the f16 values.
//! - A value is stored with [`KvElement::from_f32`]: round to nearest, ties to even (IEEE); a
//!   finite f32 beyond f16's range becomes an infinity, which the engine's finite-logits check
//!   turns into a failed request rather than a wrong answer.
//! - A scaled type's value is `to_f32(element) * head_scale(row)`; the decode kernel multiplies
//!   a key's scores and a value's softmax weight by the scale (the same value up to float
//!   rounding); the prefill kernels read the values themselves ([`KvElement::head_row_to_f32`]:
//!   the AMX path row by row, the vector path from a copy of the call's blocks).

pub use half::f16;

/// An element of a paged KV cache (`f32`, `f16` or `cpu_kv_fp8::F8E4M3`).
pub trait KvElement: Copy + Default + Send + Sync + 'static {
    /// The name torch uses for the dtype (`float32`, `float16`, `float8_e4m3fn`).
    const NAME: &'static str;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;

    /// Elements `p[0..8]` as f32.
    ///
    /// # Safety
    /// On a CPU with AVX2 and F16C (`Isa::Avx2` or wider), for 8 readable elements at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Elements `p[0..16]` as f32.
    ///
    /// # Safety
    /// On a CPU with AVX-512F, for 16 readable elements at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;

    /// Writes `src` into `dst` (equal lengths) as f32: [`KvElement::to_f32`] of each element
    /// (F16C eight at a time where the CPU has it).
    fn row_to_f32(src: &[Self], dst: &mut [f32]);

    /// Writes `src` into `dst` (equal lengths), each value rounded by [`KvElement::from_f32`].
    #[inline]
    fn store_row(dst: &mut [Self], src: &[f32]) {
        debug_assert_eq!(dst.len(), src.len());
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = Self::from_f32(s));
    }

    /// Elements after each head's `head_dim` values in a cache row, holding its scale (module
    /// header); 0 for the unscaled types.
    const ROW_EXTRA: usize = 0;

    /// The scale of the head row `row` (`head_dim + ROW_EXTRA` elements): what its elements'
    /// [`KvElement::to_f32`] values are multiplied by. 1 for the unscaled types.
    #[inline(always)]
    fn head_scale(row: &[Self], head_dim: usize) -> f32 {
        let _ = (row, head_dim);
        1.0
    }

    /// [`KvElement::head_scale`] of the head row starting at `row`, read through a pointer
    /// (the decode kernel's inner loops).
    ///
    /// # Safety
    /// `row` points at a head row of `head_dim + ROW_EXTRA` readable elements.
    #[inline(always)]
    unsafe fn head_scale_at(row: *const Self, head_dim: usize) -> f32 {
        let _ = (row, head_dim);
        1.0
    }

    /// Writes one token's `src` (`[Hkv, head_dim]` f32) into its cache rows `dst` (`[Hkv,
    /// head_dim + ROW_EXTRA]`): each head's values rounded (and, scaled types, its scale).
    #[inline]
    fn store_heads(dst: &mut [Self], src: &[f32], head_dim: usize) {
        debug_assert_eq!(Self::ROW_EXTRA, 0, "a scaled type writes its own scales");
        Self::store_row(dst, src);
        let _ = head_dim;
    }

    /// One head row's values (`src`: `head_dim + ROW_EXTRA` elements) as f32 into `dst`
    /// (`head_dim`): [`KvElement::to_f32`] of each times [`KvElement::head_scale`].
    #[inline]
    fn head_row_to_f32(src: &[Self], dst: &mut [f32]) {
        let d = dst.len();
        Self::row_to_f32(&src[..d], dst);
        if Self::ROW_EXTRA > 0 {
            let scale = Self::head_scale(src, d);
            dst.iter_mut().for_each(|x| *x *= scale);
        }
    }
}

impl KvElement for f32 {
    const NAME: &'static str = "float32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[inline]
    fn row_to_f32(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline]
    fn store_row(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvElement for f16 {
    const NAME: &'static str = "float16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f16 {
        f16::from_f32(x)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>()))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>()))
    }
    fn row_to_f32(src: &[f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx") && std::is_x86_feature_detected!("f16c") {
            // SAFETY: the features were just detected; the lengths are equal.
            return unsafe { f16c_row_to_f32(src, dst) };
        }
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}

/// [`KvElement::row_to_f32`] for f16, eight elements per instruction.
///
/// # Safety
/// On a CPU with AVX and F16C, for `src.len() == dst.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16c_row_to_f32(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        let halves = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(halves));
    }
    dst[n..]
        .iter_mut()
        .zip(&src[n..])
        .for_each(|(d, s)| *d = s.to_f32());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounds_to_nearest_even_and_saturates_to_infinity() {
        // 1 + 2^-11 lies halfway between 1 and the next f16 (1 + 2^-10): ties go to even (1)
        assert_eq!(f16::from_f32(1.0 + 2f32.powi(-11)).to_f32(), 1.0);
        assert_eq!(
            f16::from_f32(1.0 + 3.0 * 2f32.powi(-11)).to_f32(),
            1.0 + 2.0 * 2f32.powi(-10)
        );
        assert_eq!(<f16 as KvElement>::from_f32(65504.0).to_f32(), 65504.0);
        assert!(<f16 as KvElement>::from_f32(1e6).to_f32().is_infinite());
        let mut row = [f16::ZERO; 3];
        f16::store_row(&mut row, &[0.5, -2.0, 1e-3]);
        assert_eq!(row.map(|x| x.to_f32())[..2], [0.5, -2.0]);
        assert!((row[2].to_f32() - 1e-3).abs() < 1e-3 * 2f32.powi(-10));
    }

    #[test]
    fn row_to_f32_converts_every_element() {
        // 8-element chunks plus a tail, subnormals, infinities and signed zeros
        let mut xs: Vec<f16> = (0..21)
            .map(|i| f16::from_f32(i as f32 * -0.71 + 3.3))
            .collect();
        xs.extend([
            f16::MIN_POSITIVE_SUBNORMAL,
            f16::INFINITY,
            f16::NEG_ZERO,
            f16::MAX,
        ]);
        let mut got = vec![f32::NAN; xs.len()];
        f16::row_to_f32(&xs, &mut got);
        let want: Vec<f32> = xs.iter().map(|x| x.to_f32()).collect();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn load8_matches_to_f32() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c")) {
            return;
        }
        let xs: Vec<f16> = (0..8)
            .map(|i| f16::from_f32(i as f32 * 0.37 - 1.1))
            .collect();
        let mut got = [0f32; 8];
        // SAFETY: AVX2 and F16C checked above; 8 elements.
        unsafe {
            std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), f16::load8(xs.as_ptr()));
        }
        assert_eq!(
            got.to_vec(),
            xs.iter().map(|x| x.to_f32()).collect::<Vec<_>>()
        );
        let ys: Vec<f32> = (0..8).map(|i| i as f32 * 1.5).collect();
        // SAFETY: as above.
        unsafe { std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), f32::load8(ys.as_ptr())) };
        assert_eq!(got.to_vec(), ys);
    }
}
