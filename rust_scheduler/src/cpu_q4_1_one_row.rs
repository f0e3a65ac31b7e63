//! One row of `x` against Q4_1 weight rows through int16 dot products (AVX512-VNNI's
//! `vpdpwssd`): the linears of a decode step of one sequence, on CPUs that have them (Intel
//! since Cascade Lake / Ice Lake, AMD since Zen 4). [`crate::cpu_quant_linear`]'s AVX-512 kernel
//! forms each float32 weight there with two table lookups per block, which all run on one port
//! (~64 ps a weight on a Sapphire Rapids thread); this one forms no weight at all.
//!
//! The arithmetic, per block `b` of 32 inputs:
//! - `x_b` is scaled by a power of two `2^e` so that its largest magnitude lies in [2^13, 2^14),
//!   and split into two int16 pieces, `x_b 2^e = hi + lo 2^-15` up to 2^-16 (29 bits relative to
//!   the block's largest input; a float32 carries 24 relative to each);
//! - the nibbles `q` (0..16) are int16 as they are, so `vpdpwssd` forms `sum q hi` and
//!   `sum q lo` exactly in int32 (at most 2^20 for a pair of blocks, far from overflowing);
//! - a block's dot is `scale 2^-e (sum q hi + 2^-15 sum q lo) + min sum(x_b)`, which is
//!   `sum_i (scale q_i + min) x_i` up to the split: the loader's weights in real numbers, as
//!   `cpu_quant_linear`'s AVX2 one-row form (`scale (q . x) + min sum(x)`) computes it. Tested
//!   within 2^-20 of the products' magnitude, the loader's weights bit for bit on one-hot rows,
//!   and greedy decoding matches transformers token for token (`tests/model`).
//!
//! Layout ([`OneRowX`]): the blocks of `x` in pairs; pair `p` (blocks `2p`, `2p + 1`) is four
//! vectors of 32 int16, `hi` then `lo` of its "low" elements (elements 0..16 of block `2p`, then
//! 0..16 of block `2p + 1`), then `hi` and `lo` of its "high" ones (elements 16..32 of each): the
//! order of a pair's 32 bytes of nibbles widened to 16-bit lanes (byte `j` of a block holds
//! element `j` in its low nibble and `j + 16` in its high), so lanes 0..8 of a dot product hold
//! block `2p`'s sums and lanes 8..16 block `2p + 1`'s. With it, each pair's `2^-e` per lane. An odd
//! last block is paired with zeros, and the bytes it lacks are never read (a masked load).
//!
//! Invariants: [`OneRowX::new`] takes whole blocks (`x.len() % 32 == 0`, checked by the caller's
//! `QuantShape::validate`) and declines an `x` holding an infinity or a NaN (the float32 kernels
//! then propagate it); [`dots`] asserts once per call that every weight row it reads lies inside
//! `scale`, `min` and `qs` and has `x`'s block count, then reads exactly those.

use crate::cpu_quant_linear::BLOCK;

/// int16 lanes per 512-bit vector.
const LANES: usize = 32;
/// The vectors of one pair of blocks: `hi` and `lo` of the low elements, then of the high.
const VECTORS_PER_PAIR: usize = 4;
/// A block's largest `|x| 2^e` lies in [2^EXP_TOP - 1, 2^EXP_TOP): `hi` and `lo` fit int16.
const EXP_TOP: i32 = 14;

/// Whether this CPU runs the kernel (AVX-512 F, BW, VL and VNNI) and `FERROBATCH_CPU_ISA`
/// allows AVX-512. Checked once.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu_isa::Isa;
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            Isa::detect(Isa::Avx512) == Isa::Avx512
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One row of `x` arranged for [`dots`] (module header): its int16 pieces in pair order, each
/// pair's `2^-e` per lane, and each block's sum for the `min` term.
pub(crate) struct OneRowX {
    /// `pairs * 4 * 32` int16.
    pieces: Vec<i16>,
    /// `pairs * 16` floats: lanes 0..8 `2^-e` of block `2p`, lanes 8..16 of block `2p + 1`.
    unscale: Vec<f32>,
    /// `sum(x)` over each block.
    sums: Vec<f32>,
}

impl OneRowX {
    /// `x`: one row of whole blocks of 32; `None` if it holds an infinity or a NaN.
    pub(crate) fn new(x: &[f32]) -> Option<OneRowX> {
        #[cfg(target_arch = "x86_64")]
        if available() {
            // SAFETY: the CPU has what `arrange` needs
            return unsafe { vnni::arrange(x) };
        }
        OneRowX::portable(x)
    }

    /// [`OneRowX::new`] one value at a time: the reference the vector form is tested against.
    fn portable(x: &[f32]) -> Option<OneRowX> {
        if x.iter().any(|v| !v.is_finite()) {
            return None;
        }
        debug_assert_eq!(x.len() % BLOCK, 0);
        let mut out = OneRowX::zeroed(x.len() / BLOCK);
        for (b, block) in x.chunks_exact(BLOCK).enumerate() {
            let e = block_exponent(block.iter().fold(0f32, |m, v| m.max(v.abs())));
            let (up, down) = (pow2(e), pow2(-e));
            let pair = &mut out.pieces[b / 2 * VECTORS_PER_PAIR * LANES..];
            for (i, &v) in block.iter().enumerate() {
                let (half, lane) = (i / 16, (b % 2) * 16 + i % 16);
                let (hi, lo) = split(v * up);
                pair[2 * half * LANES + lane] = hi;
                pair[(2 * half + 1) * LANES + lane] = lo;
            }
            out.finish_block(b, down, block.iter().sum::<f32>());
        }
        Some(out)
    }

    /// Blocks of 32 in the row.
    pub(crate) fn blocks(&self) -> usize {
        self.sums.len()
    }

    /// Room for `nb` blocks: zero pieces, `2^-e = 1` (an odd last block's missing partner
    /// keeps these), no sums yet.
    fn zeroed(nb: usize) -> OneRowX {
        let pairs = nb.div_ceil(2);
        OneRowX {
            pieces: vec![0; pairs * VECTORS_PER_PAIR * LANES],
            unscale: vec![1.0; pairs * 16],
            sums: Vec::with_capacity(nb),
        }
    }

    /// Block `b`'s `2^-e` into its eight lanes of its pair, and its sum (blocks in order).
    fn finish_block(&mut self, b: usize, unscale: f32, sum: f32) {
        debug_assert_eq!(self.sums.len(), b);
        self.unscale[b / 2 * 16 + (b % 2) * 8..][..8].fill(unscale);
        self.sums.push(sum);
    }
}

/// The `e` that brings a block whose largest magnitude is `max` into [2^13, 2^14) (0 for an
/// all-zero block; within +-120, so that `2^e` and `2^-e` are normal floats).
fn block_exponent(max: f32) -> i32 {
    if max == 0.0 {
        return 0;
    }
    // floor(log2(max)) from the float's exponent field (a subnormal reads as -127: e clamps)
    let log2 = ((max.to_bits() >> 23) & 0xFF) as i32 - 127;
    (EXP_TOP - 1 - log2).clamp(-120, 120)
}

/// `2^e` for |e| <= 126.
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `v` (|v| < 2^14) as `hi + lo 2^-15`, each rounded to the nearest integer (ties to even).
fn split(v: f32) -> (i16, i16) {
    let hi = v.round_ties_even();
    // v - hi is exact (|v - hi| <= 0.5, both on v's grid); times 2^15 stays within int16
    let lo = ((v - hi) * 32768.0).round_ties_even();
    (hi as i16, lo as i16)
}

/// How many weight rows ahead a call prefetches (as `cpu_quant_linear`'s kernel does).
#[cfg(target_arch = "x86_64")]
const PREFETCH_ROWS: usize = 8;

/// `out[j - first] = x . w_j` for weight rows `first..last` of Q4_1 blocks (`scale`, `min`: one
/// per block, `qs`: 16 bytes per block; the whole weight's arrays).
///
/// # Safety
/// [`available`] must have returned true.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn dots(
    x: &OneRowX,
    scale: &[f32],
    min: &[f32],
    qs: &[u8],
    (first, last): (usize, usize),
    out: &mut [f32],
) {
    let nb = x.blocks();
    // the raw reads below stay inside these
    assert!(nb > 0 && first <= last && out.len() >= last - first);
    assert!(scale.len() >= last * nb && min.len() >= last * nb && qs.len() >= last * nb * 16);
    assert!(x.pieces.len() == nb.div_ceil(2) * VECTORS_PER_PAIR * LANES);
    assert!(x.unscale.len() == nb.div_ceil(2) * 16);
    // SAFETY: the caller checked the CPU; the asserts above bound every read.
    unsafe { vnni::dots(x, scale, min, qs, first, last, out) }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{block_exponent, pow2, OneRowX, BLOCK, LANES, PREFETCH_ROWS, VECTORS_PER_PAIR};
    use std::arch::x86_64::*;

    /// [`OneRowX::new`], sixteen values at a time (the same pieces: `vcvtps2dq` rounds to the
    /// nearest, ties to even, as `split` does; each block's sum in another order).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn arrange(x: &[f32]) -> Option<OneRowX> {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        assert_eq!(x.len() % BLOCK, 0);
        let nb = x.len() / BLOCK;
        let mut out = OneRowX::zeroed(nb);
        for b in 0..nb {
            let v = [0, 16].map(|h| _mm512_loadu_ps(x.as_ptr().add(b * BLOCK + h)));
            // v - v is 0 for a finite v and NaN for an infinity or a NaN
            let finite = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(
                _mm512_sub_ps(v[0], v[0]),
                _mm512_sub_ps(v[1], v[1]),
            );
            if finite != 0xFFFF {
                return None;
            }
            let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            let e = block_exponent(max);
            let up = _mm512_set1_ps(pow2(e));
            let pair = out
                .pieces
                .as_mut_ptr()
                .add(b / 2 * VECTORS_PER_PAIR * LANES);
            for (half, &vh) in v.iter().enumerate() {
                let scaled = _mm512_mul_ps(vh, up);
                let hi = _mm512_cvt_roundps_epi32::<NEAREST>(scaled);
                let rest = _mm512_mul_ps(
                    _mm512_sub_ps(scaled, _mm512_cvtepi32_ps(hi)),
                    _mm512_set1_ps(32768.0),
                );
                let lo = _mm512_cvt_roundps_epi32::<NEAREST>(rest);
                for (piece, ints) in [hi, lo].into_iter().enumerate() {
                    let at = pair.add((2 * half + piece) * LANES + (b % 2) * 16);
                    _mm256_storeu_si256(at.cast(), _mm512_cvtepi32_epi16(ints));
                }
            }
            out.finish_block(b, pow2(-e), _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1])));
        }
        Some(out)
    }

    /// `acc + (pairwise int16 products of a and b, summed per 32-bit lane)` as the one
    /// instruction `vpdpwssd` (left to itself the compiler splits it into a multiply and an add,
    /// a step more per call of the kernel's busiest line).
    #[target_feature(enable = "avx512f,avx512vnni")]
    #[inline]
    unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        let mut acc = acc;
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack),
        );
        acc
    }

    /// See [`super::dots`]; four weight rows at a time share each load of `x`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn dots(
        x: &OneRowX,
        scale: &[f32],
        min: &[f32],
        qs: &[u8],
        first: usize,
        last: usize,
        out: &mut [f32],
    ) {
        let nb = x.blocks();
        let mut j = first;
        while j + 4 <= last {
            prefetch_rows(scale, min, qs, nb, (j + PREFETCH_ROWS, last), 4);
            let d = rows::<4>(x, scale, min, qs, j);
            out[j - first..j - first + 4].copy_from_slice(&d);
            j += 4;
        }
        while j < last {
            out[j - first] = rows::<1>(x, scale, min, qs, j)[0];
            j += 1;
        }
    }

    /// Hints the CPU to fetch the blocks of `count` weight rows from `row` (none past `last`):
    /// `cpu_quant_linear`'s `Kernel::prefetch_row` does the same a row at a time, with three
    /// bounds-checked slices per row; called here for each row it made this kernel 0.89x as
    /// fast with the weights in L2 (`benches/one_row_linear.py`, session 49), so the group of
    /// rows is fetched as one span of each array.
    #[inline(always)]
    unsafe fn prefetch_rows(
        scale: &[f32],
        min: &[f32],
        qs: &[u8],
        nb: usize,
        (row, last): (usize, usize),
        count: usize,
    ) {
        let end = (row + count).min(last);
        if row >= end {
            return;
        }
        let lines = |base: *const u8, bytes: usize| {
            for off in (0..bytes).step_by(64) {
                // a prefetch never faults; the address is inside the slice
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off).cast());
            }
        };
        let rows = end - row;
        lines(qs.as_ptr().wrapping_add(row * nb * 16), rows * nb * 16);
        lines(scale.as_ptr().wrapping_add(row * nb).cast(), rows * nb * 4);
        lines(min.as_ptr().wrapping_add(row * nb).cast(), rows * nb * 4);
    }

    /// The dots of weight rows `j..j + F`, each summed in the same order as alone.
    #[inline(always)]
    unsafe fn rows<const F: usize>(
        x: &OneRowX,
        scale: &[f32],
        min: &[f32],
        qs: &[u8],
        j: usize,
    ) -> [f32; F] {
        let nb = x.blocks();
        let nibble = _mm512_set1_epi16(0x0F);
        let lo_weight = _mm512_set1_ps(1.0 / 32768.0);
        // two accumulators per weight row: block 2p's scale times every lane, block 2p + 1's
        // times every lane; lanes 0..8 of the first and 8..16 of the second are the dot
        let mut acc = [[_mm512_setzero_ps(); 2]; F];
        for p in 0..nb.div_ceil(2) {
            let b = 2 * p;
            let full = b + 1 < nb;
            let xp = x.pieces.as_ptr().add(p * VECTORS_PER_PAIR * LANES);
            let xv: [__m512i; VECTORS_PER_PAIR] =
                std::array::from_fn(|v| _mm512_loadu_si512(xp.add(v * LANES).cast()));
            let unscale = _mm512_loadu_ps(x.unscale.as_ptr().add(16 * p));
            for (f, acc_f) in acc.iter_mut().enumerate() {
                let at = (j + f) * nb + b;
                let src = qs.as_ptr().add(at * 16);
                // the pair's 32 bytes (16 of an odd last block), one per 16-bit lane
                let bytes = if full {
                    _mm256_loadu_si256(src.cast())
                } else {
                    _mm256_maskz_loadu_epi8(0xFFFF, src.cast())
                };
                let w = _mm512_cvtepu8_epi16(bytes);
                // the low nibbles (elements 0..16 of each block), then the high ones (16..32)
                let (lo_q, hi_q) = (_mm512_and_si512(w, nibble), _mm512_srli_epi16::<4>(w));
                let sum_hi = dpwssd(_mm512_madd_epi16(lo_q, xv[0]), hi_q, xv[2]);
                let sum_lo = dpwssd(_mm512_madd_epi16(lo_q, xv[1]), hi_q, xv[3]);
                // both sums exact in float32 (< 2^24); lanes 0..8 block b, 8..16 block b + 1
                let sum = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(sum_lo),
                    lo_weight,
                    _mm512_cvtepi32_ps(sum_hi),
                );
                let sum = _mm512_mul_ps(sum, unscale);
                let second = if full {
                    *scale.get_unchecked(at + 1)
                } else {
                    0.0
                };
                acc_f[0] = _mm512_fmadd_ps(sum, _mm512_set1_ps(*scale.get_unchecked(at)), acc_f[0]);
                acc_f[1] = _mm512_fmadd_ps(sum, _mm512_set1_ps(second), acc_f[1]);
            }
        }
        let acc: [__m512; F] =
            std::array::from_fn(|f| _mm512_mask_blend_ps(0xFF00, acc[f][0], acc[f][1]));
        // + sum_b min_b * sum(x_b), sixteen blocks at a time
        let mut out = [0f32; F];
        for (f, mut acc_f) in acc.into_iter().enumerate() {
            let row = (j + f) * nb;
            let mut b = 0;
            while b < nb {
                let m = if nb - b >= 16 {
                    0xFFFF
                } else {
                    (1u16 << (nb - b)) - 1
                };
                let sums = _mm512_maskz_loadu_ps(m, x.sums.as_ptr().add(b));
                let mn = _mm512_maskz_loadu_ps(m, min.as_ptr().add(row + b));
                acc_f = _mm512_fmadd_ps(mn, sums, acc_f);
                b += 16;
            }
            out[f] = _mm512_reduce_add_ps(acc_f);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::cpu_quant_linear::tests::{dequantized, random_blocks, Blocks};
    use crate::test_rng::Lcg;

    #[test]
    fn two_pieces_hold_a_block_to_29_bits_of_its_largest_input() {
        let mut rng = Lcg(3);
        for i in 0..2_000 {
            let size = 10f32.powi(i % 16 - 8);
            let x: Vec<f32> = (0..BLOCK).map(|_| (rng.next_f32() - 0.5) * size).collect();
            let one = OneRowX::new(&x).unwrap();
            let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let down = f64::from(one.unscale[0]);
            for (e, &v) in x.iter().enumerate() {
                let (half, lane) = (e / 16, e % 16);
                let hi = f64::from(one.pieces[2 * half * LANES + lane]);
                let lo = f64::from(one.pieces[(2 * half + 1) * LANES + lane]);
                let back = (hi + lo / 32768.0) * down;
                assert!(
                    (back - f64::from(v)).abs() <= f64::from(max) * 2f64.powi(-29),
                    "{v}"
                );
                assert!(hi.abs() < 16384.5 && lo.abs() <= 16384.0);
            }
            assert!(max / one.unscale[0] >= 8192.0 && max / one.unscale[0] < 16384.0);
        }
    }

    #[test]
    fn the_layout_puts_each_element_where_its_nibble_lands() {
        // 96 inputs: two blocks in pair 0, a third paired with zeros; the block maxima
        // 32 / 64 / 96 set each block's exponent (2^8, 2^7, 2^7)
        let x: Vec<f32> = (0..96).map(|i| (i + 1) as f32).collect();
        let one = OneRowX::new(&x).unwrap();
        assert_eq!(one.blocks(), 3);
        let piece = |pair: usize, vector: usize, lane: usize| {
            one.pieces[(pair * VECTORS_PER_PAIR + vector) * LANES + lane]
        };
        for lane in 0..16 {
            let at = |i: usize, up: f32| (x[i] * up) as i16;
            assert_eq!(piece(0, 0, lane), at(lane, 256.0));
            assert_eq!(piece(0, 2, lane), at(16 + lane, 256.0));
            assert_eq!(piece(0, 0, 16 + lane), at(32 + lane, 128.0));
            assert_eq!(piece(0, 2, 16 + lane), at(48 + lane, 128.0));
            assert_eq!(piece(1, 0, lane), at(64 + lane, 128.0));
            assert_eq!(piece(1, 2, lane), at(80 + lane, 128.0));
            for v in [1, 3] {
                assert_eq!(piece(0, v, lane), 0, "integers need one piece");
            }
            assert_eq!((piece(1, 0, 16 + lane), piece(1, 2, 16 + lane)), (0, 0));
        }
        let unscale: Vec<f32> = [256.0, 128.0, 128.0, 1.0].iter().map(|u| 1.0 / u).collect();
        for (lane, &u) in one.unscale.iter().enumerate() {
            // the odd block's missing partner: exponent 0
            assert_eq!(u, unscale[lane / 8], "lane {lane}");
        }
        assert_eq!(one.sums, vec![528.0, 1552.0, 2576.0]);
    }

    #[test]
    #[ignore = "needs AVX-512 VNNI: `make test` runs it where the CPU has it"]
    fn vnni_arrangement_is_the_portable_one() {
        assert!(available(), "no AVX-512 VNNI here");
        let mut rng = Lcg(5);
        for nb in [1, 2, 3, 18, 49] {
            // blocks of very different sizes, zeros, and values on rounding ties
            let mut x: Vec<f32> = (0..nb * BLOCK)
                .map(|i| (rng.next_f32() - 0.5) * 10f32.powi((i / BLOCK) as i32 % 9 - 4))
                .collect();
            x[..BLOCK].iter_mut().step_by(3).for_each(|v| *v = 0.0);
            if nb > 1 {
                x[BLOCK..2 * BLOCK]
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = i as f32 + 0.5);
            }
            let (fast, slow) = (OneRowX::new(&x).unwrap(), OneRowX::portable(&x).unwrap());
            assert_eq!(fast.pieces, slow.pieces, "nb={nb}");
            assert_eq!(fast.unscale, slow.unscale, "nb={nb}");
            for (b, (f, s)) in fast.sums.iter().zip(&slow.sums).enumerate() {
                let size: f32 = x[b * BLOCK..][..BLOCK].iter().map(|v| v.abs()).sum();
                assert!(
                    (f - s).abs() <= size * 1e-6,
                    "nb={nb} block {b}: {f} vs {s}"
                );
            }
        }
    }

    /// `x . w_j` for every row `j` of random Q4_1 blocks, in f64 from the loader's weights.
    #[cfg(target_arch = "x86_64")]
    fn reference(x: &[f32], b: &Blocks, n: usize) -> (Vec<f64>, Vec<f64>) {
        let k = x.len();
        let dense = dequantized(b, true, n, k);
        let rows = dense.chunks_exact(k);
        let dot = |row: &[f32], f: fn(f64) -> f64| -> f64 {
            row.iter()
                .zip(x)
                .map(|(&w, &v)| f(f64::from(w) * f64::from(v)))
                .sum()
        };
        (
            rows.clone().map(|row| dot(row, |p| p)).collect(),
            rows.map(|row| dot(row, f64::abs)).collect(),
        )
    }

    #[test]
    #[ignore = "needs AVX-512 VNNI: `make test` runs it where the CPU has it"]
    #[cfg(target_arch = "x86_64")]
    fn vnni_dots_match_the_loaders_weights_and_do_not_depend_on_the_grouping() {
        assert!(available(), "no AVX-512 VNNI here");
        let mut rng = Lcg(9);
        // odd and even block counts; row counts that leave 1..3 rows after the groups of 4
        for &(n, k) in &[(1, 32), (6, 96), (13, 576), (40, 1536), (11, 1568)] {
            let b = random_blocks(&mut rng, n, k);
            let x = rng.vec(k);
            let one = OneRowX::new(&x).unwrap();
            let (want, size) = reference(&x, &b, n);
            let mut all = vec![f32::NAN; n];
            // SAFETY: `available()`; every row inside the arrays
            unsafe { dots(&one, &b.scale, &b.min, &b.q4, (0, n), &mut all) };
            for j in 0..n {
                let got = f64::from(all[j]);
                assert!(
                    (got - want[j]).abs() <= size[j] / f64::from(1u32 << 20),
                    "n={n} k={k}: row {j} = {got}, reference {}",
                    want[j]
                );
                let mut alone = [f32::NAN];
                unsafe { dots(&one, &b.scale, &b.min, &b.q4, (j, j + 1), &mut alone) };
                assert_eq!(alone[0].to_bits(), all[j].to_bits(), "n={n} k={k} row {j}");
            }
        }
    }

    #[test]
    #[ignore = "needs AVX-512 VNNI: `make test` runs it where the CPU has it"]
    #[cfg(target_arch = "x86_64")]
    fn vnni_low_pieces_count_at_their_weight() {
        // Positive x with 24 significant bits and positive weights: nothing cancels, so the
        // dot must be float32-accurate relative to itself (2^-22), which it is only if the low
        // pieces (2^-15 of the high ones' unit) are added at exactly their weight: 1 % off
        // there moves a dot by ~2^-20.
        assert!(available(), "no AVX-512 VNNI here");
        let mut rng = Lcg(12);
        let (n, k) = (16, 576);
        let mut b = random_blocks(&mut rng, n, k);
        b.min.iter_mut().for_each(|m| *m = 0.0);
        let x: Vec<f32> = (0..k).map(|_| 1.0 + rng.next_f32()).collect();
        let (want, _) = reference(&x, &b, n);
        let mut out = vec![f32::NAN; n];
        unsafe {
            dots(
                &OneRowX::new(&x).unwrap(),
                &b.scale,
                &b.min,
                &b.q4,
                (0, n),
                &mut out,
            )
        };
        for j in 0..n {
            let rel = (f64::from(out[j]) - want[j]).abs() / want[j];
            assert!(
                rel <= 2f64.powi(-22),
                "row {j}: {} vs {} ({rel:e})",
                out[j],
                want[j]
            );
        }
    }

    #[test]
    #[ignore = "needs AVX-512 VNNI: `make test` runs it where the CPU has it"]
    #[cfg(target_arch = "x86_64")]
    fn vnni_one_hot_rows_read_the_loaders_weights_bit_for_bit() {
        // x = e_i: each dot is round(scale q) + min, rounded once more: the loader's weight
        assert!(available(), "no AVX-512 VNNI here");
        let (n, k) = (12, 96);
        let b = random_blocks(&mut Lcg(4), n, k);
        let dense = dequantized(&b, true, n, k);
        for i in 0..k {
            let mut x = vec![0f32; k];
            x[i] = 1.0;
            let mut out = vec![f32::NAN; n];
            let one = OneRowX::new(&x).unwrap();
            unsafe { dots(&one, &b.scale, &b.min, &b.q4, (0, n), &mut out) };
            for j in 0..n {
                assert_eq!(out[j], dense[j * k + i], "weight [{j}, {i}]");
            }
        }
    }

    #[test]
    fn an_infinity_or_a_nan_is_declined_and_zero_blocks_are_plain_zeros() {
        let mut x = vec![0f32; 64];
        let zeros = OneRowX::new(&x).unwrap();
        assert!(zeros.pieces.iter().all(|&p| p == 0) && zeros.unscale.iter().all(|&u| u == 1.0));
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            x[40] = bad;
            assert!(OneRowX::new(&x).is_none());
        }
        // the smallest and largest finite floats keep their exponents in range
        for v in [f32::MIN_POSITIVE / 8.0, f32::MAX] {
            let one = OneRowX::new(&[v; 32]).unwrap();
            assert!(one.unscale[0].is_normal() && one.unscale[0] > 0.0);
        }
    }
}
