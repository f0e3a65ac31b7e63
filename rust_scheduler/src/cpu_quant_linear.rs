//! Linear layers on the CPU straight from GGUF's Q4_1 / Q8_0 blocks (and the Q8G16 form of the other
//! k-quants), for the few rows of a decode
//! step: `out[M, N] = x[M, K] @ W^T + bias` with `W` read as 4.5 or 8.5 bits per weight instead of
//! 32, so a small-batch step streams ~6x fewer bytes than the float32 panels of `cpu_linear`.
//!
//! Weights: each of the `N` rows holds `NB = K / 32` blocks of 32 consecutive inputs.
//! - Q4_1: `scale[N, NB]`, `min[N, NB]` (float32, read from the file's f16) and `qs[N, NB, 16]`:
//!   byte `j` holds element `j` (low nibble) and element `j + 16` (high nibble);
//!   `w = scale * q + min`.
//! - Q8_0: `scale[N, NB]` and `qs[N, NB, 32]` (int8); `w = scale * q`.
//! - Q8G16 (not a GGUF format: the exact form of GGUF's Q5_0 / Q5_1 / Q5_K / Q6_K and of a fused
//!   module whose parts come in several formats): `scale[N, 2 NB]`, `min[N, 2 NB]` (one per 16
//!   inputs) and `qs[N, NB, 32]` (int8); `w = scale * q + min`.
//!
//! Each weight is formed exactly as the loader's dequantization forms it (one float32 multiply,
//! then one add, never fused), so this kernel multiplies by the very float32 weights the panel
//! kernel and transformers use; only the summation order differs (float32 rounding, ~1e-6).
//! One exception, for speed: on AVX2 a call of **one row** of x (a single decode sequence)
//! computes a Q4_1 dot as `sum_b scale_b * (q_b . x_b) + sum_b min_b * sum(x_b)`, the same
//! real number (each product exactly, the loader's weight `scale * q + min` unrounded), so
//! it differs from the other paths only by float32 rounding too: no weight is formed at all
//! (`avx2::q4_1_one_row`: SmolLM2's 120 layer linears 1.2x faster at one row on a Zen 3).
//! Where the CPU has AVX-512 VNNI, one row against Q4_1 takes `cpu_q4_1_one_row`
//! instead: the same form in int16 dot products (x split once per call into two int16 pieces
//! per block), 1.35x this file's AVX-512 kernel with the weights in L2 (one thread of a Xeon
//! with AMX, `benches/one_row_linear.py`).
//!
//! Invariants checked by [`QuantShape::validate`] before any read: `K % 32 == 0`,
//! `x.len() == M * K`, `out.len() == M * N`, every weight array sized for `[N, NB]`, `bias`
//! empty or of length `N`, `M <= MAX_ROWS`.
//! Work split: output features in contiguous ranges, one per task of the kernels' pool
//! (`cpu_pool`); a task writes only its own columns of `out`. On AVX-512 a task takes its
//! features two at a time, sharing every load of `x` between them (x's rows in groups of at most
//! `PAIR_MAX_ROWS`, for the registers); each feature's products are formed and summed in the
//! same order as alone, so the output bits do not depend on the pairing (tested). On AVX2 the
//! Q4_1 kernel widens each half of a block's bytes to 32-bit lanes and takes the two nibbles
//! of a lane apart with a mask and a shift, so its vectors hold the block's elements in another
//! order (`AVX2_Q4_1_ORDER`); `run` arranges `x` in that order once per call (and, for one row,
//! the sum of each of its blocks), and a task's whole range of
//! features runs in one target-feature call (`avx2::features`): a weight row of SmolLM2's layers
//! is only 18-48 blocks, and the per-row call, dispatch and constants cost ~8 % of a one-row step.
//! Each task prefetches the blocks of the weight row `PREFETCH_ROWS` ahead of the one it
//! computes: without that, a one-row call streaming from DRAM waited on the block loads
//! (`perf annotate`: half the samples on the first use of a loaded `qs`) and ran at half its
//! in-cache speed.

use crate::cpu_error::{check_bias, check_lengths, KernelInputError};
use crate::cpu_isa::Isa;
use crate::cpu_linear::OutPtr;
use crate::cpu_q4_1_one_row::OneRowX;

/// Inputs per quantization block (both formats).
pub const BLOCK: usize = 32;
/// Most rows per call: the kernel keeps every row's accumulators in registers (8 rows: one
/// accumulator each, beside the block's 4 weight vectors, within AVX2's 16; the AVX2 Q4_1
/// kernel's 4 shift vectors then spill, up to ~8 % slower at 6-8 rows, steps that the quantized
/// panels take by default).
pub const MAX_ROWS: usize = 8;

/// The block format of a weight and its arrays.
#[derive(Clone, Copy)]
pub enum QuantWeight<'a> {
    /// `w = scale * q + min`, q in 0..16 packed two per byte.
    Q4_1 {
        scale: &'a [f32],
        min: &'a [f32],
        qs: &'a [u8],
    },
    /// `w = scale * q`, q an int8.
    Q8_0 { scale: &'a [f32], qs: &'a [i8] },
    /// `w = scale * q + min`, q an int8, a scale and a min per 16 inputs (two per block).
    Q8G16 {
        scale: &'a [f32],
        min: &'a [f32],
        qs: &'a [i8],
    },
}

impl QuantWeight<'_> {
    fn bytes_per_block(&self) -> usize {
        match self {
            QuantWeight::Q4_1 { .. } => BLOCK / 2,
            QuantWeight::Q8_0 { .. } | QuantWeight::Q8G16 { .. } => BLOCK,
        }
    }

    /// Scales (and minimums, where there are) per block.
    fn scales_per_block(&self) -> usize {
        match self {
            QuantWeight::Q8G16 { .. } => 2,
            _ => 1,
        }
    }
}

/// Shapes of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantShape {
    /// rows of `x` and `out` (at most [`MAX_ROWS`])
    pub m: usize,
    /// output features (rows of `W`)
    pub n: usize,
    /// input features (a multiple of 32)
    pub k: usize,
}

impl QuantShape {
    /// Checks the module header's invariants.
    pub fn validate(
        &self,
        x: &[f32],
        w: &QuantWeight<'_>,
        bias: &[f32],
        out: &[f32],
    ) -> Result<(), KernelInputError> {
        let err = |msg: String| Err(KernelInputError(msg));
        check_block_shape(self.n, self.k)?;
        if self.m > MAX_ROWS {
            return err(format!("at most {MAX_ROWS} rows per call, got {}", self.m));
        }
        let blocks = self.n * (self.k / BLOCK);
        let groups = blocks * w.scales_per_block();
        let (scale_len, min_len, qs_len) = match w {
            QuantWeight::Q4_1 { scale, min, qs } => (scale.len(), min.len(), qs.len()),
            QuantWeight::Q8_0 { scale, qs } => (scale.len(), groups, qs.len()),
            QuantWeight::Q8G16 { scale, min, qs } => (scale.len(), min.len(), qs.len()),
        };
        check_lengths(&[
            ("x", x.len(), self.m * self.k),
            ("out", out.len(), self.m * self.n),
            ("scale", scale_len, groups),
            ("min", min_len, groups),
            ("qs", qs_len, blocks * w.bytes_per_block()),
        ])?;
        check_bias(bias.len(), self.n)?;
        Ok(())
    }
}

/// The weight-shape check every kernel over GGUF blocks shares (this one, their AMX tiles,
/// their quantized panels): `K` a positive multiple of [`BLOCK`], `N` positive.
pub(crate) fn check_block_shape(n: usize, k: usize) -> Result<(), KernelInputError> {
    if n == 0 || k == 0 || !k.is_multiple_of(BLOCK) {
        return Err(KernelInputError(format!(
            "in features must be a positive multiple of {BLOCK} and out features positive \
             (got K={k}, N={n})"
        )));
    }
    Ok(())
}

/// `out = x @ W^T + bias` with `W` in blocks; `bias` may be empty. Splits the output features
/// over up to `num_threads` threads. Errors instead of reading out of bounds.
pub fn linear_quant_f32(
    shape: &QuantShape,
    x: &[f32],
    w: QuantWeight<'_>,
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    let one_row_int16 = crate::cpu_q4_1_one_row::available();
    run(
        shape,
        x,
        w,
        bias,
        out,
        num_threads,
        Isa::Avx512,
        one_row_int16,
    )
}

/// [`linear_quant_f32`] using at most instruction set `max_isa`, and for one row of x and Q4_1
/// weights the int16 kernel of `cpu_q4_1_one_row` if `one_row_int16` (tests compare every path).
#[allow(clippy::too_many_arguments)]
fn run(
    shape: &QuantShape,
    x: &[f32],
    w: QuantWeight<'_>,
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
    max_isa: Isa,
    one_row_int16: bool,
) -> Result<(), KernelInputError> {
    shape.validate(x, &w, bias, out)?;
    if shape.m == 0 {
        return Ok(());
    }
    let n = shape.n;
    // Below ~64k weights a thread's wake-up costs more than its share.
    let threads = num_threads.clamp(1, n).min(1 + n * shape.k / (1 << 16));
    let isa = Isa::detect(max_isa);
    // the AVX2 Q4_1 kernel reads x in its nibble order (`AVX2_Q4_1_ORDER`), arranged once here,
    // and for one row the sum of each block of x (`avx2::q4_1_one_row`)
    let x_nibble_order: Vec<f32>;
    let mut x_block_sums = Vec::new();
    let x = if isa == Isa::Avx2 && matches!(w, QuantWeight::Q4_1 { .. }) {
        x_nibble_order = in_avx2_q4_1_order(x);
        if shape.m == 1 {
            x_block_sums = x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect();
        }
        &x_nibble_order[..]
    } else {
        x
    };
    // one row against Q4_1 through int16 dot products: x split into int16 pieces once here
    // (declined for an x holding an infinity or a NaN: the float32 kernels propagate it)
    let one_row = (one_row_int16
        && shape.m == 1
        && isa >= Isa::Avx512
        && matches!(w, QuantWeight::Q4_1 { .. }))
    .then(|| OneRowX::new(x))
    .flatten();
    let kernel = Kernel {
        shape: *shape,
        x,
        x_block_sums: &x_block_sums,
        one_row: one_row.as_ref(),
        w,
        bias,
        out: OutPtr(out.as_mut_ptr()),
        isa,
    };
    if threads == 1 {
        // SAFETY: one thread writes every column.
        unsafe { kernel.run_features(0, n) };
        return Ok(());
    }
    let pool = crate::cpu_pool::global(threads);
    let threads = threads.min(pool.max_tasks());
    // ranges of 8 features: neighbouring tasks never share a cache line of one output row
    let per_thread = n.div_ceil(threads).next_multiple_of(8);
    pool.run(threads, &|t| {
        let (first, last) = ((t * per_thread).min(n), ((t + 1) * per_thread).min(n));
        // SAFETY: task t writes only columns first..last, which no other task writes; `out`
        // outlives the pool job (`run` returns after every task).
        unsafe { kernel.run_features(first, last) };
    });
    Ok(())
}

/// The order in which the AVX2 Q4_1 kernel's vectors hold a block's 32 elements: lane `l` of
/// vector `i` is element `AVX2_Q4_1_ORDER[8 * i + l]`. Each half of the block's 16 bytes is
/// widened to eight 32-bit lanes (byte `j`: element `j` in its low nibble, `j + 16` in its
/// high), a mask keeps the low nibbles and a shift brings down the high ones; `x` is arranged
/// in this order once per call ([`in_avx2_q4_1_order`]) instead of shuffling the weights.
const AVX2_Q4_1_ORDER: [usize; BLOCK] = [
    0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23, //
    8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31,
];

/// `x` (rows of whole blocks) with each block's 32 values in [`AVX2_Q4_1_ORDER`].
fn in_avx2_q4_1_order(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        for (d, &e) in dst.iter_mut().zip(&AVX2_Q4_1_ORDER) {
            *d = src[e];
        }
    }
    out
}

/// Most rows of `x` per AVX-512 call on two Q4_1 weight rows at once (each row of `x` has 2 x 2
/// accumulators: 16 registers at 4 rows); a step of more rows makes several such calls.
const PAIR_MAX_ROWS: usize = 4;

/// How many weight rows ahead of the one being computed a task prefetches (a row of SmolLM2's
/// layers is 18-48 blocks: ~0.4-1.2 KB of Q4_1). 4, 16 and 32 measured within a few % of 8.
const PREFETCH_ROWS: usize = 8;

struct Kernel<'a> {
    shape: QuantShape,
    x: &'a [f32],
    /// the sum of each block of x's one row (AVX2 Q4_1 with one row; else empty)
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    x_block_sums: &'a [f32],
    /// x's one row arranged for the int16 Q4_1 kernel (`cpu_q4_1_one_row`), when it runs
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    one_row: Option<&'a OneRowX>,
    w: QuantWeight<'a>,
    bias: &'a [f32],
    out: OutPtr,
    /// what this CPU has, at most what the caller allowed (`Isa::detect`)
    isa: Isa,
}

impl Kernel<'_> {
    /// Hints the CPU to fetch weight row `j`'s blocks (nothing past `last`).
    #[inline(always)]
    fn prefetch_row(&self, j: usize, last: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            if j >= last {
                return;
            }
            let nb = self.shape.k / BLOCK;
            let lines = |base: *const u8, bytes: usize| {
                for off in (0..bytes).step_by(64) {
                    // SAFETY: a prefetch never faults; the address is inside the slice.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off).cast()) };
                }
            };
            match self.w {
                QuantWeight::Q4_1 { scale, min, qs } => {
                    lines(qs[j * nb * 16..].as_ptr(), nb * 16);
                    lines(scale[j * nb..].as_ptr().cast(), nb * 4);
                    lines(min[j * nb..].as_ptr().cast(), nb * 4);
                }
                QuantWeight::Q8_0 { scale, qs } => {
                    lines(qs[j * nb * 32..].as_ptr().cast(), nb * 32);
                    lines(scale[j * nb..].as_ptr().cast(), nb * 4);
                }
                QuantWeight::Q8G16 { scale, min, qs } => {
                    lines(qs[j * nb * 32..].as_ptr().cast(), nb * 32);
                    lines(scale[j * 2 * nb..].as_ptr().cast(), nb * 8);
                    lines(min[j * 2 * nb..].as_ptr().cast(), nb * 8);
                }
            }
        }
    }

    /// Output features `first..last`, every row.
    ///
    /// # Safety
    /// No other thread may access those columns of `out` meanwhile.
    unsafe fn run_features(&self, first: usize, last: usize) {
        // one row against Q4_1 where the CPU has AVX-512 VNNI: the int16 kernel, whole range
        #[cfg(target_arch = "x86_64")]
        if let (Some(x), QuantWeight::Q4_1 { scale, min, qs }) = (self.one_row, self.w) {
            let mut dots = vec![0f32; last - first];
            // SAFETY: `one_row` is set only where `cpu_q4_1_one_row::available()`; the caller owns
            // columns first..last.
            unsafe {
                crate::cpu_q4_1_one_row::dots(x, scale, min, qs, (first, last), &mut dots);
                for (j, &dot) in (first..last).zip(&dots) {
                    self.store(j, &[dot]);
                }
            }
            return;
        }
        // AVX2 runs the whole range in one call: its per-weight-row work (a call, the dispatch
        // on m, the constants) made a one-row step ~8 % slower on SmolLM2's 18-block rows
        #[cfg(target_arch = "x86_64")]
        if self.isa == Isa::Avx2 {
            // SAFETY: `isa` was detected on this CPU; the caller owns columns first..last.
            unsafe { avx2::features(self, first, last) };
            return;
        }
        let QuantShape { m, k, .. } = self.shape;
        let nb = k / BLOCK;
        let mut dots = [[0f32; MAX_ROWS]; 2];
        let mut j = first;
        while j < last {
            // on AVX-512 a call takes two weight rows, sharing every load of x
            let pair = self.isa == Isa::Avx512 && j + 1 < last;
            let rows = if pair { 2 } else { 1 };
            for ahead in 0..rows {
                self.prefetch_row(j + ahead + PREFETCH_ROWS, last);
            }
            let blocks = j * nb..(j + rows) * nb;
            let x = self.x;
            match (self.isa, self.w) {
                // SAFETY (every SIMD arm): `isa` was detected on this CPU.
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, w) => {
                    // x's rows in even groups of at most PAIR_MAX_ROWS (registers: 5 rows as
                    // 3 + 2, not 4 + 1), each group reading the weight rows again (from L1)
                    let groups = m.div_ceil(PAIR_MAX_ROWS);
                    let mut r0 = 0;
                    for g in 0..groups {
                        let height = (m - r0) / (groups - g);
                        let x = &x[r0 * k..];
                        let mut group = [[0f32; MAX_ROWS]; 2];
                        match w {
                            QuantWeight::Q4_1 { scale, min, qs } => unsafe {
                                let qs = &qs[blocks.start * BLOCK / 2..blocks.end * BLOCK / 2];
                                let (scale, min) = (&scale[blocks.clone()], &min[blocks.clone()]);
                                avx512::q4_1(height, pair, x, k, scale, min, qs, &mut group)
                            },
                            QuantWeight::Q8_0 { scale, qs } => unsafe {
                                let qs = &qs[blocks.start * BLOCK..blocks.end * BLOCK];
                                avx512::q8_0(
                                    height,
                                    pair,
                                    x,
                                    k,
                                    &scale[blocks.clone()],
                                    qs,
                                    &mut group,
                                )
                            },
                            QuantWeight::Q8G16 { scale, min, qs } => unsafe {
                                let qs = &qs[blocks.start * BLOCK..blocks.end * BLOCK];
                                let groups = 2 * blocks.start..2 * blocks.end;
                                avx512::q8_g16(
                                    height,
                                    pair,
                                    x,
                                    k,
                                    (&scale[groups.clone()], &min[groups]),
                                    qs,
                                    &mut group,
                                )
                            },
                        }
                        for (d, g) in dots.iter_mut().zip(&group) {
                            d[r0..r0 + height].copy_from_slice(&g[..height]);
                        }
                        r0 += height;
                    }
                    debug_assert_eq!(r0, m);
                }
                (_, QuantWeight::Q4_1 { scale, min, qs }) => {
                    let (scale, min) = (&scale[blocks.clone()], &min[blocks.clone()]);
                    let qs = &qs[blocks.start * BLOCK / 2..blocks.end * BLOCK / 2];
                    portable::q4_1(m, x, k, scale, min, qs, &mut dots[0])
                }
                (_, QuantWeight::Q8_0 { scale, qs }) => {
                    let (scale, qs) = (
                        &scale[blocks.clone()],
                        &qs[blocks.start * BLOCK..blocks.end * BLOCK],
                    );
                    portable::q8_0(m, x, k, scale, qs, &mut dots[0])
                }
                (_, QuantWeight::Q8G16 { scale, min, qs }) => {
                    let groups = 2 * blocks.start..2 * blocks.end;
                    let qs = &qs[blocks.start * BLOCK..blocks.end * BLOCK];
                    portable::q8_g16(
                        m,
                        x,
                        k,
                        &scale[groups.clone()],
                        &min[groups],
                        qs,
                        &mut dots[0],
                    )
                }
            }
            for (f, dots_f) in dots.iter().take(rows).enumerate() {
                // SAFETY: j + f < last: a column this thread owns.
                unsafe { self.store(j + f, &dots_f[..m]) };
            }
            j += rows;
        }
    }

    /// `out[r][j] = dots[r] + bias[j]` for every row `r` of x.
    ///
    /// # Safety
    /// `j < n` must be a column no other thread accesses meanwhile.
    #[inline(always)]
    unsafe fn store(&self, j: usize, dots: &[f32]) {
        let n = self.shape.n;
        let bias = self.bias.get(j).copied().unwrap_or(0.0);
        for (r, &dot) in dots.iter().enumerate() {
            // SAFETY: r < m and j < n: inside `out` (validated length m * n).
            unsafe { *self.out.0.add(r * n + j) = dot + bias };
        }
    }
}

mod portable {
    use super::BLOCK;

    /// `dots[r] = x[r] . w` for one weight row of Q4_1 blocks.
    pub(super) fn q4_1(
        m: usize,
        x: &[f32],
        k: usize,
        scale: &[f32],
        min: &[f32],
        qs: &[u8],
        dots: &mut [f32],
    ) {
        dots[..m].fill(0.0);
        for (b, ((&d, &mn), q)) in scale.iter().zip(min).zip(qs.chunks_exact(16)).enumerate() {
            for (j, &byte) in q.iter().enumerate() {
                let lo = d * f32::from(byte & 0x0F) + mn;
                let hi = d * f32::from(byte >> 4) + mn;
                for (r, dot) in dots.iter_mut().take(m).enumerate() {
                    let xr = &x[r * k + b * BLOCK..];
                    *dot += xr[j] * lo + xr[j + 16] * hi;
                }
            }
        }
    }

    /// `dots[r] = x[r] . w` for one weight row of Q8G16 groups.
    pub(super) fn q8_g16(
        m: usize,
        x: &[f32],
        k: usize,
        scale: &[f32],
        min: &[f32],
        qs: &[i8],
        dots: &mut [f32],
    ) {
        dots[..m].fill(0.0);
        for (g, ((&d, &mn), q)) in scale.iter().zip(min).zip(qs.chunks_exact(16)).enumerate() {
            for (j, &v) in q.iter().enumerate() {
                let w = d * f32::from(v) + mn;
                for (r, dot) in dots.iter_mut().take(m).enumerate() {
                    *dot += x[r * k + g * 16 + j] * w;
                }
            }
        }
    }

    /// `dots[r] = x[r] . w` for one weight row of Q8_0 blocks.
    pub(super) fn q8_0(m: usize, x: &[f32], k: usize, scale: &[f32], qs: &[i8], dots: &mut [f32]) {
        dots[..m].fill(0.0);
        for (b, (&d, q)) in scale.iter().zip(qs.chunks_exact(BLOCK)).enumerate() {
            for (j, &v) in q.iter().enumerate() {
                let w = d * f32::from(v);
                for (r, dot) in dots.iter_mut().take(m).enumerate() {
                    *dot += x[r * k + b * BLOCK + j] * w;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Kernel, QuantWeight, BLOCK, MAX_ROWS, PREFETCH_ROWS};
    use std::arch::x86_64::*;

    /// Sum of the 8 lanes.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// `acc[r][i % A] += w[i] * x[r][8i..8i+8]` for the 4 vectors of one block.
    #[inline(always)]
    unsafe fn accumulate<const R: usize, const A: usize>(
        acc: &mut [[__m256; A]; R],
        w: &[__m256; 4],
        x: *const f32,
        k: usize,
    ) {
        for (r, acc) in acc.iter_mut().enumerate() {
            let xr = x.add(r * k);
            for (i, &wi) in w.iter().enumerate() {
                acc[i % A] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(xr.add(8 * i)), acc[i % A]);
            }
        }
    }

    /// Weight rows (output features) `first..last` of `kernel`, every row of its x, in one
    /// call: the dispatch on the row count happens once, and each weight row's loop is inlined
    /// here (`A`: accumulators per row of x, as many as its registers allow).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; no other thread may access columns `first..last` of
    /// `kernel`'s output meanwhile.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn features(kernel: &Kernel<'_>, first: usize, last: usize) {
        match kernel.shape.m {
            1 => each_feature::<1, 4>(kernel, first, last),
            2 => each_feature::<2, 4>(kernel, first, last),
            3 => each_feature::<3, 2>(kernel, first, last),
            4 => each_feature::<4, 2>(kernel, first, last),
            5 => each_feature::<5, 1>(kernel, first, last),
            6 => each_feature::<6, 1>(kernel, first, last),
            7 => each_feature::<7, 1>(kernel, first, last),
            _ => each_feature::<8, 1>(kernel, first, last),
        }
    }

    #[inline(always)]
    unsafe fn each_feature<const R: usize, const A: usize>(
        kernel: &Kernel<'_>,
        first: usize,
        last: usize,
    ) {
        let (k, x) = (kernel.shape.k, kernel.x);
        let nb = k / BLOCK;
        let mut dots = [0f32; MAX_ROWS];
        for j in first..last {
            kernel.prefetch_row(j + PREFETCH_ROWS, last);
            let blocks = j * nb..(j + 1) * nb;
            match kernel.w {
                QuantWeight::Q4_1 { scale, min, qs } if R == 1 => {
                    dots[0] = q4_1_one_row(
                        x,
                        kernel.x_block_sums,
                        &scale[blocks.clone()],
                        &min[blocks.clone()],
                        &qs[blocks.start * BLOCK / 2..blocks.end * BLOCK / 2],
                    )
                }
                QuantWeight::Q4_1 { scale, min, qs } => q4_1_rows::<R, A>(
                    x,
                    k,
                    &scale[blocks.clone()],
                    &min[blocks.clone()],
                    &qs[blocks.start * BLOCK / 2..blocks.end * BLOCK / 2],
                    &mut dots,
                ),
                QuantWeight::Q8_0 { scale, qs } => q8_0_rows::<R, A>(
                    x,
                    k,
                    &scale[blocks.clone()],
                    &qs[blocks.start * BLOCK..blocks.end * BLOCK],
                    &mut dots,
                ),
                QuantWeight::Q8G16 { scale, min, qs } => q8_g16_rows::<R, A>(
                    x,
                    k,
                    &scale[2 * blocks.start..2 * blocks.end],
                    &min[2 * blocks.start..2 * blocks.end],
                    &qs[blocks.start * BLOCK..blocks.end * BLOCK],
                    &mut dots,
                ),
            }
            kernel.store(j, &dots[..R]);
        }
    }

    /// A Q4_1 block's 32 nibbles as floats, in [`super::AVX2_Q4_1_ORDER`]: each half of its
    /// 16 bytes widened to 32-bit lanes, then the low nibbles masked and the high ones shifted
    /// down (a lane holds one byte, so the shift needs no mask).
    #[inline(always)]
    unsafe fn nibbles(qs: *const u8) -> [__m256; 4] {
        let low = _mm256_set1_epi32(0x0F);
        let a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs as *const __m128i));
        let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8) as *const __m128i));
        [
            _mm256_cvtepi32_ps(_mm256_and_si256(a, low)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(a)),
            _mm256_cvtepi32_ps(_mm256_and_si256(b, low)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b)),
        ]
    }

    #[inline(always)]
    unsafe fn q4_1_rows<const R: usize, const A: usize>(
        x: &[f32],
        k: usize,
        scale: &[f32],
        min: &[f32],
        qs: &[u8],
        dots: &mut [f32; MAX_ROWS],
    ) {
        debug_assert!(scale.len() == min.len() && qs.len() == 16 * scale.len());
        debug_assert!(x.len() >= (R - 1) * k + scale.len() * BLOCK);
        let mut acc = [[_mm256_setzero_ps(); A]; R];
        for (b, (&sc, &mn)) in scale.iter().zip(min).enumerate() {
            let q = nibbles(qs.as_ptr().add(b * 16));
            let (d, mn) = (_mm256_set1_ps(sc), _mm256_set1_ps(mn));
            // one multiply, then one add: the loader's float32 weight, bit for bit
            // (a plain loop: a closure would not inherit this function's target features)
            let mut w = [_mm256_setzero_ps(); 4];
            for (wi, &qi) in w.iter_mut().zip(&q) {
                *wi = _mm256_add_ps(_mm256_mul_ps(d, qi), mn);
            }
            accumulate(&mut acc, &w, x.as_ptr().add(b * BLOCK), k);
        }
        for (r, acc) in acc.iter().enumerate() {
            let mut sum = acc[0];
            for &a in &acc[1..] {
                sum = _mm256_add_ps(sum, a);
            }
            dots[r] = hsum(sum);
        }
    }

    /// `x . w` for one row of x and one weight row of Q4_1 blocks, as
    /// `sum_b scale_b * (q_b . x_b) + sum_b min_b * x_block_sums[b]`: no weight is formed, so a
    /// block costs its nibbles' conversion and four multiply-adds (1.2x the loader-exact
    /// form at one row on a Zen 3; with more rows of x the weights formed once are shared and
    /// that form is as fast). Every product is exact in real numbers, so the result is the dot
    /// with the loader's weights up to float32 rounding of the sums (its weights round
    /// `scale * q + min` once, which this form never does).
    #[inline(always)]
    unsafe fn q4_1_one_row(
        x: &[f32],
        x_block_sums: &[f32],
        scale: &[f32],
        min: &[f32],
        qs: &[u8],
    ) -> f32 {
        let nb = scale.len();
        // the raw reads below stay inside these (one check per weight row)
        assert!(min.len() == nb && qs.len() == 16 * nb);
        assert!(x.len() >= nb * BLOCK && x_block_sums.len() >= nb);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let q = nibbles(qs.as_ptr().add(b * 16));
            let xb = x.as_ptr().add(b * BLOCK);
            let half0 = _mm256_fmadd_ps(
                q[1],
                _mm256_loadu_ps(xb.add(8)),
                _mm256_mul_ps(q[0], _mm256_loadu_ps(xb)),
            );
            let half1 = _mm256_fmadd_ps(
                q[3],
                _mm256_loadu_ps(xb.add(24)),
                _mm256_mul_ps(q[2], _mm256_loadu_ps(xb.add(16))),
            );
            let d = _mm256_set1_ps(*scale.get_unchecked(b));
            acc = _mm256_fmadd_ps(d, _mm256_add_ps(half0, half1), acc);
        }
        // sum_b min_b * x_block_sums[b], eight blocks at a time
        let mut b = 0;
        while b + 8 <= nb {
            let m8 = _mm256_loadu_ps(min.as_ptr().add(b));
            acc = _mm256_fmadd_ps(m8, _mm256_loadu_ps(x_block_sums.as_ptr().add(b)), acc);
            b += 8;
        }
        let mut tail = 0f32;
        for b in b..nb {
            tail = min
                .get_unchecked(b)
                .mul_add(*x_block_sums.get_unchecked(b), tail);
        }
        hsum(acc) + tail
    }

    #[inline(always)]
    unsafe fn q8_g16_rows<const R: usize, const A: usize>(
        x: &[f32],
        k: usize,
        scale: &[f32],
        min: &[f32],
        qs: &[i8],
        dots: &mut [f32; MAX_ROWS],
    ) {
        let mut acc = [[_mm256_setzero_ps(); A]; R];
        for b in 0..qs.len() / BLOCK {
            let q = qs.as_ptr().add(b * BLOCK);
            let mut w = [_mm256_setzero_ps(); 4];
            for (i, wi) in w.iter_mut().enumerate() {
                // vectors 0-1 are the block's first 16 inputs (scale and min 2b), 2-3 the rest
                let (d, mn) = (
                    scale.get_unchecked(2 * b + i / 2),
                    min.get_unchecked(2 * b + i / 2),
                );
                let bytes = _mm_loadl_epi64(q.add(8 * i) as *const __m128i);
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                // one multiply, then one add (not fused): the loader's float32 weight
                *wi = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(*d), v), _mm256_set1_ps(*mn));
            }
            accumulate(&mut acc, &w, x.as_ptr().add(b * BLOCK), k);
        }
        for (r, acc) in acc.iter().enumerate() {
            let mut sum = acc[0];
            for &a in &acc[1..] {
                sum = _mm256_add_ps(sum, a);
            }
            dots[r] = hsum(sum);
        }
    }

    #[inline(always)]
    unsafe fn q8_0_rows<const R: usize, const A: usize>(
        x: &[f32],
        k: usize,
        scale: &[f32],
        qs: &[i8],
        dots: &mut [f32; MAX_ROWS],
    ) {
        let mut acc = [[_mm256_setzero_ps(); A]; R];
        for (b, &sc) in scale.iter().enumerate() {
            let q = qs.as_ptr().add(b * BLOCK);
            let d = _mm256_set1_ps(sc);
            let mut w = [_mm256_setzero_ps(); 4];
            for (i, wi) in w.iter_mut().enumerate() {
                let bytes = _mm_loadl_epi64(q.add(8 * i) as *const __m128i);
                *wi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
            }
            accumulate(&mut acc, &w, x.as_ptr().add(b * BLOCK), k);
        }
        for (r, acc) in acc.iter().enumerate() {
            let mut sum = acc[0];
            for &a in &acc[1..] {
                sum = _mm256_add_ps(sum, a);
            }
            dots[r] = hsum(sum);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{BLOCK, MAX_ROWS};
    use std::arch::x86_64::*;

    /// `acc[r][f][i] += w[f][i] * x[r][16i..16i+16]` for one block's two vectors (`x` at the
    /// block, row stride `k`): each x vector is loaded once for every weight row.
    #[inline(always)]
    unsafe fn accumulate<const R: usize, const F: usize>(
        acc: &mut [[[__m512; 2]; F]; R],
        w: &[[__m512; 2]; F],
        x: *const f32,
        k: usize,
    ) {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            for i in 0..2 {
                let xv = _mm512_loadu_ps(x.add(r * k + 16 * i));
                for (acc_f, wf) in acc_r.iter_mut().zip(w) {
                    acc_f[i] = _mm512_fmadd_ps(wf[i], xv, acc_f[i]);
                }
            }
        }
    }

    /// `dots[f][r]` = the sum of row `r`'s accumulators for weight row `f`.
    #[inline(always)]
    unsafe fn finish<const R: usize, const F: usize>(
        acc: &[[[__m512; 2]; F]; R],
        dots: &mut [[f32; MAX_ROWS]; 2],
    ) {
        for (r, acc_r) in acc.iter().enumerate() {
            for (dots_f, acc_f) in dots.iter_mut().zip(acc_r) {
                dots_f[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc_f[0], acc_f[1]));
            }
        }
    }

    /// `dots[f][r] = x[r] . w_f` for `m` (1..=[`super::PAIR_MAX_ROWS`]) rows of `x` and `F` neighbouring
    /// weight rows (`F` = 2 with `pair`, else 1): `scale` and `min` hold `F * nb` entries and
    /// `qs` `F * nb * 16` bytes, one row's blocks after the other's.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn q4_1(
        m: usize,
        pair: bool,
        x: &[f32],
        k: usize,
        scale: &[f32],
        min: &[f32],
        qs: &[u8],
        dots: &mut [[f32; MAX_ROWS]; 2],
    ) {
        match (m, pair) {
            (1, true) => q4_1_rows::<1, 2>(x, k, scale, min, qs, dots),
            (2, true) => q4_1_rows::<2, 2>(x, k, scale, min, qs, dots),
            (3, true) => q4_1_rows::<3, 2>(x, k, scale, min, qs, dots),
            (_, true) => q4_1_rows::<4, 2>(x, k, scale, min, qs, dots),
            (1, false) => q4_1_rows::<1, 1>(x, k, scale, min, qs, dots),
            (2, false) => q4_1_rows::<2, 1>(x, k, scale, min, qs, dots),
            (3, false) => q4_1_rows::<3, 1>(x, k, scale, min, qs, dots),
            (_, false) => q4_1_rows::<4, 1>(x, k, scale, min, qs, dots),
        }
    }

    /// [`q4_1`] for `R` rows of `x` and `F` weight rows. Two weight rows share every load of
    /// `x` (each row's weights are formed and summed in the same order as alone, so its dots
    /// are the same bits).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn q4_1_rows<const R: usize, const F: usize>(
        x: &[f32],
        k: usize,
        scale: &[f32],
        min: &[f32],
        qs: &[u8],
        dots: &mut [[f32; MAX_ROWS]; 2],
    ) {
        let nb = scale.len() / F;
        assert!(F <= 2 && R <= MAX_ROWS && scale.len() == F * nb && min.len() == F * nb);
        assert!(qs.len() == F * nb * 16 && nb * BLOCK <= k && x.len() >= (R - 1) * k + nb * BLOCK);
        // the sixteen values a nibble can hold, as floats
        let levels = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let mut acc = [[[_mm512_setzero_ps(); 2]; F]; R];
        for b in 0..nb {
            let mut w = [[_mm512_setzero_ps(); 2]; F];
            for (f, wf) in w.iter_mut().enumerate() {
                let at = f * nb + b;
                // The block's sixteen possible weights, each formed by one multiply, then one
                // add: the loader's float32 weights, bit for bit. Then each element picks its
                // own.
                let table = _mm512_add_ps(
                    _mm512_mul_ps(_mm512_set1_ps(*scale.get_unchecked(at)), levels),
                    _mm512_set1_ps(*min.get_unchecked(at)),
                );
                let q = _mm_loadu_si128(qs.as_ptr().add(at * 16) as *const __m128i);
                // vpermps reads only the low 4 bits of each index, so no nibble needs masking:
                // byte j (low nibble: element j) and byte j shifted right by 4 (element j + 16)
                let lo = _mm512_cvtepu8_epi32(q);
                let hi = _mm512_cvtepu8_epi32(_mm_srli_epi16::<4>(q));
                *wf = [
                    _mm512_permutexvar_ps(lo, table),
                    _mm512_permutexvar_ps(hi, table),
                ];
            }
            accumulate(&mut acc, &w, x.as_ptr().add(b * BLOCK), k);
        }
        finish(&acc, dots);
    }

    /// `dots[f][r] = x[r] . w_f` for `F` neighbouring Q8_0 weight rows (as [`q4_1`]).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn q8_0(
        m: usize,
        pair: bool,
        x: &[f32],
        k: usize,
        scale: &[f32],
        qs: &[i8],
        dots: &mut [[f32; MAX_ROWS]; 2],
    ) {
        match (m, pair) {
            (1, true) => q8_0_rows::<1, 2>(x, k, scale, qs, dots),
            (2, true) => q8_0_rows::<2, 2>(x, k, scale, qs, dots),
            (3, true) => q8_0_rows::<3, 2>(x, k, scale, qs, dots),
            (_, true) => q8_0_rows::<4, 2>(x, k, scale, qs, dots),
            (1, false) => q8_0_rows::<1, 1>(x, k, scale, qs, dots),
            (2, false) => q8_0_rows::<2, 1>(x, k, scale, qs, dots),
            (3, false) => q8_0_rows::<3, 1>(x, k, scale, qs, dots),
            (_, false) => q8_0_rows::<4, 1>(x, k, scale, qs, dots),
        }
    }

    /// `dots[f][r] = x[r] . w_f` for `F` neighbouring Q8G16 weight rows (as [`q4_1`]); the
    /// scales and minimums hold `F * 2 nb` entries each.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn q8_g16(
        m: usize,
        pair: bool,
        x: &[f32],
        k: usize,
        groups: (&[f32], &[f32]),
        qs: &[i8],
        dots: &mut [[f32; MAX_ROWS]; 2],
    ) {
        match (m, pair) {
            (1, true) => q8_g16_rows::<1, 2>(x, k, groups, qs, dots),
            (2, true) => q8_g16_rows::<2, 2>(x, k, groups, qs, dots),
            (3, true) => q8_g16_rows::<3, 2>(x, k, groups, qs, dots),
            (_, true) => q8_g16_rows::<4, 2>(x, k, groups, qs, dots),
            (1, false) => q8_g16_rows::<1, 1>(x, k, groups, qs, dots),
            (2, false) => q8_g16_rows::<2, 1>(x, k, groups, qs, dots),
            (3, false) => q8_g16_rows::<3, 1>(x, k, groups, qs, dots),
            (_, false) => q8_g16_rows::<4, 1>(x, k, groups, qs, dots),
        }
    }

    /// [`q8_g16`] for `R` rows of `x` and `F` weight rows, sharing x's loads: a block's two
    /// vectors are its two groups of 16, each formed by one multiply, then one add.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn q8_g16_rows<const R: usize, const F: usize>(
        x: &[f32],
        k: usize,
        (scale, min): (&[f32], &[f32]),
        qs: &[i8],
        dots: &mut [[f32; MAX_ROWS]; 2],
    ) {
        let nb = qs.len() / (F * BLOCK);
        assert!(F <= 2 && R <= MAX_ROWS && scale.len() == 2 * F * nb && min.len() == scale.len());
        assert!(qs.len() == F * nb * BLOCK);
        assert!(nb * BLOCK <= k && x.len() >= (R - 1) * k + nb * BLOCK);
        let mut acc = [[[_mm512_setzero_ps(); 2]; F]; R];
        for b in 0..nb {
            let mut w = [[_mm512_setzero_ps(); 2]; F];
            for (f, wf) in w.iter_mut().enumerate() {
                let at = f * nb + b;
                let q = qs.as_ptr().add(at * BLOCK);
                for (i, wi) in wf.iter_mut().enumerate() {
                    let bytes = _mm_loadu_si128(q.add(16 * i) as *const __m128i);
                    let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
                    let d = _mm512_set1_ps(*scale.get_unchecked(2 * at + i));
                    *wi = _mm512_add_ps(
                        _mm512_mul_ps(d, v),
                        _mm512_set1_ps(*min.get_unchecked(2 * at + i)),
                    );
                }
            }
            accumulate(&mut acc, &w, x.as_ptr().add(b * BLOCK), k);
        }
        finish(&acc, dots);
    }

    /// [`q8_0`] for `R` rows of `x` and `F` weight rows, sharing x's loads (as [`q4_1_rows`]).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn q8_0_rows<const R: usize, const F: usize>(
        x: &[f32],
        k: usize,
        scale: &[f32],
        qs: &[i8],
        dots: &mut [[f32; MAX_ROWS]; 2],
    ) {
        let nb = scale.len() / F;
        assert!(F <= 2 && R <= MAX_ROWS && scale.len() == F * nb && qs.len() == F * nb * BLOCK);
        assert!(nb * BLOCK <= k && x.len() >= (R - 1) * k + nb * BLOCK);
        let mut acc = [[[_mm512_setzero_ps(); 2]; F]; R];
        for b in 0..nb {
            let mut w = [[_mm512_setzero_ps(); 2]; F];
            for (f, wf) in w.iter_mut().enumerate() {
                let at = f * nb + b;
                let q = qs.as_ptr().add(at * BLOCK);
                let d = _mm512_set1_ps(*scale.get_unchecked(at));
                for (i, wi) in wf.iter_mut().enumerate() {
                    let bytes = _mm_loadu_si128(q.add(16 * i) as *const __m128i);
                    *wi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
                }
            }
            accumulate(&mut acc, &w, x.as_ptr().add(b * BLOCK), k);
        }
        finish(&acc, dots);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    /// Random blocks of both formats for `[n, k]` (also the AMX kernel's tests').
    pub(crate) struct Blocks {
        pub(crate) scale: Vec<f32>,
        pub(crate) min: Vec<f32>,
        pub(crate) q4: Vec<u8>,
        pub(crate) q8: Vec<i8>,
        /// Q8G16's scales and minimums (two per block; its integers are `q8`)
        pub(crate) scale16: Vec<f32>,
        pub(crate) min16: Vec<f32>,
    }

    /// The three formats, for tests that run each.
    #[derive(Clone, Copy, Debug, PartialEq)]
    pub(crate) enum Fmt {
        Q4,
        Q8,
        G16,
    }
    pub(crate) const FORMATS: [Fmt; 3] = [Fmt::Q4, Fmt::Q8, Fmt::G16];

    impl Blocks {
        pub(crate) fn of(&self, f: Fmt) -> QuantWeight<'_> {
            match f {
                Fmt::Q4 => self.weight(true),
                Fmt::Q8 => self.weight(false),
                Fmt::G16 => QuantWeight::Q8G16 {
                    scale: &self.scale16,
                    min: &self.min16,
                    qs: &self.q8,
                },
            }
        }
    }

    /// [`dequantized`] of any format (Q8G16: `scale * q + min` per 16, multiply then add).
    pub(crate) fn dense(b: &Blocks, f: Fmt, n: usize, k: usize) -> Vec<f32> {
        match f {
            Fmt::Q4 => dequantized(b, true, n, k),
            Fmt::Q8 => dequantized(b, false, n, k),
            Fmt::G16 => {
                b.q8.iter()
                    .enumerate()
                    .map(|(i, &q)| b.scale16[i / 16] * f32::from(q) + b.min16[i / 16])
                    .collect()
            }
        }
    }

    impl Blocks {
        /// The Q4_1 (`q4`) or the Q8_0 weight these arrays make.
        pub(crate) fn weight(&self, q4: bool) -> QuantWeight<'_> {
            if q4 {
                QuantWeight::Q4_1 {
                    scale: &self.scale,
                    min: &self.min,
                    qs: &self.q4,
                }
            } else {
                QuantWeight::Q8_0 {
                    scale: &self.scale,
                    qs: &self.q8,
                }
            }
        }
    }

    pub(crate) fn random_blocks(rng: &mut Lcg, n: usize, k: usize) -> Blocks {
        let nb = n * k / BLOCK;
        Blocks {
            scale: (0..nb).map(|_| rng.next_f32() * 0.1).collect(),
            min: (0..nb).map(|_| rng.next_f32() - 0.5).collect(),
            q4: (0..nb * 16).map(|_| rng.below(256) as u8).collect(),
            q8: (0..nb * BLOCK)
                .map(|_| rng.below(256) as u8 as i8)
                .collect(),
            scale16: (0..2 * nb).map(|_| rng.next_f32() * 0.01).collect(),
            min16: (0..2 * nb).map(|_| rng.next_f32() - 0.5).collect(),
        }
    }

    /// The float32 weights, formed as the loader forms them.
    pub(crate) fn dequantized(b: &Blocks, q4: bool, n: usize, k: usize) -> Vec<f32> {
        let mut w = vec![0f32; n * k];
        for (blk, chunk) in w.chunks_exact_mut(BLOCK).enumerate() {
            for (j, v) in chunk.iter_mut().enumerate() {
                *v = if q4 {
                    let byte = b.q4[blk * 16 + j % 16];
                    let q = if j < 16 { byte & 0x0F } else { byte >> 4 };
                    b.scale[blk] * f32::from(q) + b.min[blk]
                } else {
                    b.scale[blk] * f32::from(b.q8[blk * BLOCK + j])
                };
            }
        }
        w
    }

    #[allow(clippy::too_many_arguments)]
    fn case(
        seed: u64,
        m: usize,
        n: usize,
        k: usize,
        fmt: Fmt,
        bias: bool,
        threads: usize,
        (isa, int16): (Isa, bool),
    ) {
        let mut rng = Lcg(seed);
        let x = rng.vec(m * k);
        let b = random_blocks(&mut rng, n, k);
        let bias = if bias { rng.vec(n) } else { Vec::new() };
        let w = b.of(fmt);
        let mut out = vec![f32::NAN; m * n]; // poisoned: every element must be written
        run(
            &QuantShape { m, n, k },
            &x,
            w,
            &bias,
            &mut out,
            threads,
            isa,
            int16,
        )
        .unwrap();
        let dense = dense(&b, fmt, n, k);
        for r in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|i| f64::from(x[r * k + i]) * f64::from(dense[j * k + i]))
                    .sum::<f64>()
                    + bias.get(j).map_or(0.0, |&v| f64::from(v));
                let got = f64::from(out[r * n + j]);
                let scale: f64 = (0..k)
                    .map(|i| (f64::from(x[r * k + i]) * f64::from(dense[j * k + i])).abs())
                    .sum();
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + scale),
                    "m={m} n={n} k={k} {fmt:?} threads={threads} {isa:?} int16={int16}: out[{r},{j}] = \
                     {got}, reference {want}"
                );
            }
        }
    }

    #[test]
    fn matches_the_dequantized_reference_across_shapes_threads_and_paths() {
        // (one row of Q4_1 takes the int16 kernel where the CPU has it and `int16`)
        let int16 = crate::cpu_q4_1_one_row::available();
        let mut seed = 1;
        for &(n, k) in &[(1, 32), (7, 64), (33, 96), (257, 576), (40, 1536)] {
            for m in 1..=MAX_ROWS {
                for fmt in FORMATS {
                    for &(threads, isa, int16) in &[
                        (1, Isa::Avx512, false),
                        (3, Isa::Avx512, false),
                        (1, Isa::Avx512, int16),
                        (3, Isa::Avx512, int16),
                        (1, Isa::Avx2, false),
                        (3, Isa::Avx2, false),
                        (1, Isa::Portable, false),
                    ] {
                        case(seed, m, n, k, fmt, seed % 2 == 0, threads, (isa, int16));
                        seed += 1;
                    }
                }
            }
        }
    }

    #[test]
    #[ignore = "needs AVX-512: `make test` runs it where the CPU has it"]
    fn avx512_weight_rows_in_pairs_and_row_groups_give_the_same_bits_as_one_at_a_time() {
        // On AVX-512 a call takes two weight rows and x's rows in groups of <= 4; each weight
        // row's dots must still be formed and summed exactly as a call on it alone would.
        assert_eq!(Isa::detect(Isa::Avx512), Isa::Avx512, "no AVX-512 here");
        let mut rng = Lcg(7);
        for &(n, k) in &[(9, 64), (40, 576)] {
            let b = random_blocks(&mut rng, n, k);
            for m in 1..=MAX_ROWS {
                let x = rng.vec(m * k);
                let bias = rng.vec(n);
                for fmt in FORMATS {
                    let kernel = |out: &mut Vec<f32>| Kernel {
                        shape: QuantShape { m, n, k },
                        x: &x,
                        x_block_sums: &[],
                        one_row: None,
                        w: b.of(fmt),
                        bias: &bias,
                        out: OutPtr(out.as_mut_ptr()),
                        isa: Isa::Avx512,
                    };
                    let (mut together, mut alone) = (vec![0f32; m * n], vec![0f32; m * n]);
                    // SAFETY: one thread; every column inside `out`.
                    unsafe { kernel(&mut together).run_features(0, n) };
                    for j in 0..n {
                        // a range of one feature: never paired
                        unsafe { kernel(&mut alone).run_features(j, j + 1) };
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&together), bits(&alone), "m={m} n={n} k={k} {fmt:?}");
                }
            }
        }
    }

    #[test]
    fn every_weight_is_the_loaders_float32_bit_for_bit() {
        // one-hot rows: out[r, j] = w[j, i_r] * 1 plus products with zeros, i.e. exactly the
        // weight the kernel formed; it must be the loader's (multiply, then add; not fused)
        let (n, k) = (24, 96);
        let b = random_blocks(&mut Lcg(5), n, k);
        for fmt in FORMATS {
            let w = b.of(fmt);
            let dense = dense(&b, fmt, n, k);
            for first in (0..k).step_by(MAX_ROWS) {
                let mut x = vec![0f32; MAX_ROWS * k];
                for r in 0..MAX_ROWS {
                    x[r * k + first + r] = 1.0;
                }
                for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
                    let mut out = vec![f32::NAN; MAX_ROWS * n];
                    let shape = QuantShape { m: MAX_ROWS, n, k };
                    run(&shape, &x, w, &[], &mut out, 1, isa, false).unwrap();
                    for r in 0..MAX_ROWS {
                        for j in 0..n {
                            // (as values: a -0.0 weight sums to +0.0)
                            assert_eq!(
                                out[r * n + j],
                                dense[j * k + first + r],
                                "{fmt:?} {isa:?}: weight [{j}, {}]",
                                first + r
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn one_row_of_one_hot_x_reads_the_loaders_weights_too() {
        // One row on AVX2 never forms a weight (`avx2::q4_1_one_row`), but for a one-hot x its
        // sum is scale * q rounded, plus min: the loader's float32 weight again, on every path.
        let (n, k) = (24, 288);
        let b = random_blocks(&mut Lcg(8), n, k);
        for fmt in FORMATS {
            let dense = dense(&b, fmt, n, k);
            for i in 0..k {
                let mut x = vec![0f32; k];
                x[i] = 1.0;
                for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
                    let mut out = vec![f32::NAN; n];
                    let shape = QuantShape { m: 1, n, k };
                    run(&shape, &x, b.of(fmt), &[], &mut out, 1, isa, false).unwrap();
                    for j in 0..n {
                        assert_eq!(
                            out[j],
                            dense[j * k + i],
                            "{fmt:?} {isa:?}: weight [{j}, {i}]"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn one_row_dots_stay_within_float32_rounding_of_the_loaders_weights() {
        // The one-row AVX2 form sums scale * (q . x) + min * sum(x) per block. Here half the
        // blocks have a min far above their scale, so the loader's `scale * q + min` rounds
        // (that form never does) and the two sums part by more than reordering alone would;
        // still within 2^-20 of the products' magnitude. Block counts 18 and 49 run the
        // eight-at-a-time min sum with and without a tail; a dropped min term or a wrong
        // block would miss by the size of the dot itself.
        let mut rng = Lcg(11);
        for &(n, k) in &[(40, 576), (33, 1568)] {
            let mut b = random_blocks(&mut rng, n, k);
            for (i, (sc, mn)) in b.scale.iter_mut().zip(&mut b.min).enumerate() {
                if i % 2 == 1 {
                    (*sc, *mn) = (*sc * 1e-4, 8.0 + *mn);
                }
            }
            let dense = dequantized(&b, true, n, k);
            let int16 = crate::cpu_q4_1_one_row::available();
            for (isa, int16) in [
                (Isa::Avx2, false),
                (Isa::Avx512, false),
                (Isa::Avx512, int16),
                (Isa::Portable, false),
            ] {
                for threads in [1, 3] {
                    let x = rng.vec(k);
                    let mut out = vec![f32::NAN; n];
                    let shape = QuantShape { m: 1, n, k };
                    run(
                        &shape,
                        &x,
                        b.weight(true),
                        &[],
                        &mut out,
                        threads,
                        isa,
                        int16,
                    )
                    .unwrap();
                    for j in 0..n {
                        let row = &dense[j * k..(j + 1) * k];
                        let want: f64 = x
                            .iter()
                            .zip(row)
                            .map(|(&a, &w)| f64::from(a) * f64::from(w))
                            .sum();
                        let size: f64 = x
                            .iter()
                            .zip(row)
                            .map(|(&a, &w)| (f64::from(a) * f64::from(w)).abs())
                            .sum();
                        let got = f64::from(out[j]);
                        assert!(
                            (got - want).abs() <= size / f64::from(1u32 << 20),
                            "k={k} {isa:?} int16={int16} threads={threads}: out[{j}] = {got}, reference {want} \
                             (size {size})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn zero_rows_is_a_no_op_and_bad_shapes_are_refused() {
        let b = random_blocks(&mut Lcg(3), 4, 64);
        let w = QuantWeight::Q4_1 {
            scale: &b.scale,
            min: &b.min,
            qs: &b.q4,
        };
        let mut out = vec![];
        run(
            &QuantShape { m: 0, n: 4, k: 64 },
            &[],
            w,
            &[],
            &mut out,
            2,
            Isa::Avx512,
            true,
        )
        .unwrap();
        let rows = MAX_ROWS + 1;
        let x = vec![0f32; rows * 64];
        let mut out = vec![0f32; rows * 4];
        for (shape, xs, bias, out_len, why) in [
            (
                QuantShape {
                    m: rows,
                    n: 4,
                    k: 64,
                },
                &x[..],
                &[][..],
                rows * 4,
                "at most",
            ),
            (
                QuantShape { m: 1, n: 4, k: 48 },
                &x[..48],
                &[][..],
                4,
                "multiple of 32",
            ),
            (
                QuantShape { m: 1, n: 4, k: 64 },
                &x[..63],
                &[][..],
                4,
                "x has 63",
            ),
            (
                QuantShape { m: 1, n: 4, k: 64 },
                &x[..64],
                &[1.0][..],
                4,
                "bias",
            ),
            (
                QuantShape { m: 1, n: 4, k: 64 },
                &x[..64],
                &[][..],
                3,
                "out has 3",
            ),
            (
                QuantShape { m: 1, n: 5, k: 64 },
                &x[..64],
                &[][..],
                5,
                "scale has 8",
            ),
        ] {
            let e = run(
                &shape,
                xs,
                w,
                bias,
                &mut out[..out_len],
                1,
                Isa::Avx512,
                true,
            )
            .unwrap_err();
            assert!(e.0.contains(why), "{why}: {}", e.0);
        }
        let short = QuantWeight::Q8_0 {
            scale: &b.scale,
            qs: &b.q8[..10],
        };
        let e = run(
            &QuantShape { m: 1, n: 4, k: 64 },
            &x[..64],
            short,
            &[],
            &mut out[..4],
            1,
            Isa::Avx512,
            true,
        )
        .unwrap_err();
        assert!(e.0.contains("qs has 10"), "{}", e.0);
        // Q8G16 needs two scales and two minimums per block
        let e = run(
            &QuantShape { m: 1, n: 4, k: 64 },
            &x[..64],
            QuantWeight::Q8G16 {
                scale: &b.scale,
                min: &b.min16,
                qs: &b.q8,
            },
            &[],
            &mut out[..4],
            1,
            Isa::Avx512,
            true,
        )
        .unwrap_err();
        assert!(e.0.contains("scale has 8") && e.0.contains("16"), "{}", e.0);
    }
}
