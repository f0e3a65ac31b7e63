//! Linear layers on the CPU (float32): `out[M, N] = x[M, K] @ W^T + bias` for the rows of one
//! serving step (one per decode sequence, up to a prefill chunk), with `W` prepacked once.
//!
//! Packed layout: `W` `[N, K]` becomes `packed` `[P, K, 16]`, `P = ceil(N / 16)`: panel `p`,
//! row `k` holds `W[16p .. 16p + 16, k]`, zeros past `N` ([`pack`] builds it). A panel is one
//! contiguous stream, so a step reads each weight from memory once per block of `MC` rows, in
//! address order (what the hardware prefetcher follows best), and the tile kernel keeps a
//! `6 x 16` block of the output in registers while it walks `K` (AVX2), or a `12 x 32` block
//! over two neighbouring panels (AVX-512, chosen at run time where the CPU has it).
//!
//! Invariants checked by [`LinearShape::validate`] before any read, so no index below leaves its
//! slice: `x.len() == M * K`, `packed.len() == P * K * 16`, `out.len() == M * N`, `bias` empty
//! or of length `N`.
//! Work split: panels, in contiguous ranges, one range per task of the kernels' thread pool
//! (`cpu_pool`); a thread writes only its own
//! columns of `out` (disjoint column ranges, so the threads never write the same element).

use crate::cpu_error::{check_bias, check_lengths, KernelInputError};
use crate::cpu_isa::Isa;

/// Output columns per panel (two AVX2 vectors).
pub const PANEL_WIDTH: usize = 16;
/// Rows per register tile: 6 rows x 2 vectors = 12 accumulators of the 16 AVX2 registers.
pub(crate) const TILE_ROWS: usize = 6;
/// Rows per AVX-512 tile: 12 rows x 2 panels = 24 accumulators of the 32 AVX-512 registers.
pub(crate) const TILE_ROWS_512: usize = 12;

/// Shapes of one linear-layer call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearShape {
    /// rows of `x` and `out`
    pub m: usize,
    /// output features (rows of `W`)
    pub n: usize,
    /// input features
    pub k: usize,
}

impl LinearShape {
    /// Panels in the packed weight.
    pub fn num_panels(&self) -> usize {
        self.n.div_ceil(PANEL_WIDTH)
    }

    /// Checks the module header's length invariants.
    pub fn validate(
        &self,
        x: &[f32],
        packed: &[f32],
        bias: &[f32],
        out: &[f32],
    ) -> Result<(), KernelInputError> {
        if self.n == 0 || self.k == 0 {
            return Err(KernelInputError(format!(
                "in and out features must be positive (got K={}, N={})",
                self.k, self.n
            )));
        }
        let packed_len = self.num_panels() * self.k * PANEL_WIDTH;
        check_lengths(&[
            ("x", x.len(), self.m * self.k),
            ("packed weight", packed.len(), packed_len),
            ("out", out.len(), self.m * self.n),
        ])?;
        check_bias(bias.len(), self.n)?;
        Ok(())
    }
}

/// Packs `W` `[n, k]` (row-major) into the panel layout of the module header.
pub fn pack(w: &[f32], n: usize, k: usize) -> Result<Vec<f32>, KernelInputError> {
    if w.len() != n * k {
        return Err(KernelInputError(format!(
            "weight has {} elements, [{n}, {k}] needs {}",
            w.len(),
            n * k
        )));
    }
    let panels = n.div_ceil(PANEL_WIDTH);
    let mut packed = vec![0f32; panels * k * PANEL_WIDTH];
    for (col, row) in w.chunks_exact(k.max(1)).enumerate().take(n) {
        let (p, j) = (col / PANEL_WIDTH, col % PANEL_WIDTH);
        let panel = &mut packed[p * k * PANEL_WIDTH..][..k * PANEL_WIDTH];
        for (kk, &value) in row.iter().enumerate() {
            panel[kk * PANEL_WIDTH + j] = value;
        }
    }
    Ok(packed)
}

/// `out = x @ W^T + bias` with `W` packed by [`pack`]; `bias` may be empty. Splits the panels
/// over up to `num_threads` threads. Errors instead of reading out of bounds.
pub fn linear_f32(
    shape: &LinearShape,
    x: &[f32],
    packed: &[f32],
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    run(shape, x, packed, bias, out, num_threads, Isa::Avx512)
}

/// [`linear_f32`] using at most instruction set `max_isa` (tests compare every path).
fn run(
    shape: &LinearShape,
    x: &[f32],
    packed: &[f32],
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
    max_isa: Isa,
) -> Result<(), KernelInputError> {
    shape.validate(x, packed, bias, out)?;
    if shape.m == 0 {
        return Ok(());
    }
    let kernel = Kernel {
        shape: *shape,
        x,
        packed,
        first_panel: 0,
        bias,
        out: OutPtr(out.as_mut_ptr()),
        isa: Isa::detect(max_isa),
    };
    on_panel_ranges(shape, num_threads, &|first, last| {
        // SAFETY: each range's columns are written by its task alone (`on_panel_ranges`); `out`
        // outlives the call.
        unsafe { kernel.run_panels(first, last) }
    });
    Ok(())
}

/// Calls `task(first, last)` for contiguous ranges of the panels of a `shape` call, an even
/// count each (the AVX-512 tiles take panels in pairs), one range per task of the kernels'
/// pool (`cpu_pool`): at most `num_threads` tasks, fewer for a small call (below ~256k
/// multiply-adds, or ~1 MB of weights, a thread's start-up costs more than its share), one
/// range on the calling thread when that is all. The ranges are disjoint and cover every
/// panel; returns after every task.
pub(crate) fn on_panel_ranges(
    shape: &LinearShape,
    num_threads: usize,
    task: &(dyn Fn(usize, usize) + Sync),
) {
    let panels = shape.num_panels();
    let work = shape.m.max(4) * shape.n * shape.k;
    let threads = num_threads.clamp(1, panels).min(1 + work / (1 << 18));
    if threads == 1 {
        task(0, panels);
        return;
    }
    let pool = crate::cpu_pool::global(threads);
    let threads = threads.min(pool.max_tasks());
    let per_thread = panels.div_ceil(threads).next_multiple_of(2);
    pool.run(threads, &|t| {
        task(
            (t * per_thread).min(panels),
            ((t + 1) * per_thread).min(panels),
        )
    });
}

/// [`linear_f32`] on at most `max_isa` (other kernels' tests compare against every path).
#[cfg(test)]
pub(crate) fn linear_f32_isa(
    shape: &LinearShape,
    x: &[f32],
    packed: &[f32],
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
    max_isa: Isa,
) -> Result<(), KernelInputError> {
    run(shape, x, packed, bias, out, num_threads, max_isa)
}

/// Output columns of panels `first..last` of a `shape` weight, every row, on one thread, from
/// `panels`: those panels alone (`[last - first][K][16]`, [`pack`]'s layout). For kernels that
/// form a task's panels themselves (`cpu_quant_panels`).
///
/// # Safety
/// `x`, `bias` and `out` (which outlives the call) passed `shape`'s validation, `first <= last
/// <= shape.num_panels()`, `panels` holds `last - first` panels, `isa` came from
/// [`Isa::detect`], and no other thread accesses those columns of `out` meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run_panel_range(
    shape: &LinearShape,
    x: &[f32],
    panels: &[f32],
    first: usize,
    last: usize,
    bias: &[f32],
    out: OutPtr,
    isa: Isa,
) {
    assert!(first <= last && last <= shape.num_panels());
    assert!(panels.len() >= (last - first) * shape.k * PANEL_WIDTH);
    let kernel = Kernel {
        shape: *shape,
        x,
        packed: panels,
        first_panel: first,
        bias,
        out,
        isa,
    };
    // SAFETY: the caller's contract.
    unsafe { kernel.run_panels(first, last) };
}

/// The output's base pointer, shared by threads that write disjoint columns (also used by
/// `cpu_quant_linear`, which splits its output the same way).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: the threads holding it write disjoint elements (see `run`), and the buffer outlives them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

struct Kernel<'a> {
    shape: LinearShape,
    x: &'a [f32],
    /// panels `first_panel..`, each `[K][16]`
    packed: &'a [f32],
    first_panel: usize,
    bias: &'a [f32],
    out: OutPtr,
    /// what this CPU has, at most what the caller allowed (`Isa::detect`)
    isa: Isa,
}

/// One register tile's results: up to 12 rows x 32 columns (two panels); the AVX2 and portable
/// tiles fill at most 6 rows x 16 columns of it.
pub(crate) type TileBuf = [[f32; 2 * PANEL_WIDTH]; TILE_ROWS_512];

impl Kernel<'_> {
    /// Output columns of panels `first..last`, every row.
    ///
    /// # Safety
    /// No other thread may access those columns of `out` meanwhile.
    unsafe fn run_panels(&self, first: usize, last: usize) {
        match self.isa {
            // SAFETY (both SIMD arms): `isa` was detected on this CPU, which therefore supports
            // the features the functions are compiled for; the rest is the caller's.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { self.run_panels_avx512(first, last) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { self.run_panels_avx2(first, last) },
            _ => {
                let k = self.shape.k;
                let tile = |_, rows, x: &[f32], panel: &[f32], out: &mut _| {
                    portable::tile(rows, x, k, k, panel, out)
                };
                // SAFETY: forwarded from the caller.
                unsafe { self.walk(first, last, 1, TILE_ROWS, tile) }
            }
        }
    }

    /// [`Kernel::walk`] with the AVX-512 tiles (two panels at a time), compiled for AVX-512F so
    /// that the walk and its tile calls inline into one function.
    ///
    /// # Safety
    /// As [`Kernel::run_panels`], on a CPU with AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_panels_avx512(&self, first: usize, last: usize) {
        let k = self.shape.k;
        let tile = |np: usize, rows, x: &[f32], panels: &[f32], out: &mut _| {
            // SAFETY: this CPU has AVX-512F (the caller's contract).
            unsafe { avx512::tile::<true>(np == 2, rows, x, k, k, panels, out) }
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.walk(first, last, 2, TILE_ROWS_512, tile) }
    }

    /// [`Kernel::walk`] with the AVX2 tiles, compiled for AVX2 + FMA (see `run_panels_avx512`).
    ///
    /// # Safety
    /// As [`Kernel::run_panels`], on a CPU with AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_panels_avx2(&self, first: usize, last: usize) {
        let k = self.shape.k;
        let tile = |_, rows, x: &[f32], panel: &[f32], out: &mut _| {
            // SAFETY: this CPU has AVX2 and FMA (the caller's contract).
            unsafe { avx2::tile::<true>(rows, x, k, k, panel, out) }
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.walk(first, last, 1, TILE_ROWS, tile) }
    }

    /// The walk every instruction set shares: passes of rows whose x block stays in L2, groups
    /// of up to `group` neighbouring panels, and row tiles of near-equal height, at most
    /// `tile_rows` each (16 rows at 6 = 6 + 5 + 5, not 6 + 6 + 4: a short tile does less work
    /// per weight it loads); `tile(panels, rows, x, packed, out)` adds one tile's products to
    /// `out` (which starts as the bias).
    ///
    /// # Safety
    /// As [`Kernel::run_panels`].
    #[inline(always)]
    unsafe fn walk(
        &self,
        first: usize,
        last: usize,
        group: usize,
        tile_rows: usize,
        tile: impl Fn(usize, usize, &[f32], &[f32], &mut TileBuf),
    ) {
        let LinearShape { m, n, k } = self.shape;
        // Rows per pass over the weights: the x block (rows_per_pass * K floats) stays in L2
        // while the panels stream by; more rows re-read x from L3 for every panel.
        let rows_per_pass =
            ((256 * 1024 / 4) / k).clamp(tile_rows, 1 << 16) / tile_rows * tile_rows;
        for row0 in (0..m).step_by(rows_per_pass) {
            let rows = (m - row0).min(rows_per_pass);
            let mut p = first;
            while p < last {
                let np = group.min(last - p);
                let at = (p - self.first_panel) * k * PANEL_WIDTH;
                let panels = &self.packed[at..][..np * k * PANEL_WIDTH];
                let col0 = p * PANEL_WIDTH;
                let cols = (n - col0).min(np * PANEL_WIDTH);
                let mut bias = [0f32; 2 * PANEL_WIDTH];
                if !self.bias.is_empty() {
                    bias[..cols].copy_from_slice(&self.bias[col0..col0 + cols]);
                }
                let num_tiles = rows.div_ceil(tile_rows);
                let mut r = row0;
                for tile_index in 0..num_tiles {
                    let height = (rows - (r - row0)) / (num_tiles - tile_index);
                    let x = &self.x[r * k..(r + height) * k];
                    let mut out_tile: TileBuf = [bias; TILE_ROWS_512];
                    tile(np, height, x, panels, &mut out_tile);
                    for (i, values) in out_tile.iter().take(height).enumerate() {
                        // SAFETY: row r + i < m and columns col0..col0 + cols <= n are inside
                        // `out` (validated length m * n) and belong to this thread's panels.
                        unsafe {
                            let dst = self.out.0.add((r + i) * n + col0);
                            std::ptr::copy_nonoverlapping(values.as_ptr(), dst, cols);
                        }
                    }
                    r += height;
                }
                debug_assert_eq!(r, row0 + rows);
                p += np;
            }
        }
    }
}

pub(crate) mod portable {
    use super::{TileBuf, PANEL_WIDTH, TILE_ROWS};

    /// `tile[i] += x[i] @ panel` for the first `rows` rows of `x` (row stride `x_stride`, `kc`
    /// inputs), `panel` `[kc][16]`.
    pub(crate) fn tile(
        rows: usize,
        x: &[f32],
        x_stride: usize,
        kc: usize,
        panel: &[f32],
        tile: &mut TileBuf,
    ) {
        for (i, acc) in tile.iter_mut().take(rows.min(TILE_ROWS)).enumerate() {
            let acc = &mut acc[..PANEL_WIDTH];
            let x_row = &x[i * x_stride..][..kc];
            for (&a, w) in x_row.iter().zip(panel.chunks_exact(PANEL_WIDTH)) {
                for (c, &b) in acc.iter_mut().zip(w) {
                    *c += a * b;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{TileBuf, PANEL_WIDTH, TILE_ROWS};
    use std::arch::x86_64::*;

    /// `tile[i] += x[i] @ panel` for the first `rows` (1..=6) rows of `x` (row stride
    /// `x_stride`, `kc` inputs), `panel` `[kc][16]`; with `PREFETCH`, the lines of the panel
    /// that follows it in memory are prefetched as it goes.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn tile<const PREFETCH: bool>(
        rows: usize,
        x: &[f32],
        x_stride: usize,
        kc: usize,
        panel: &[f32],
        tile: &mut TileBuf,
    ) {
        // SAFETY (all arms): the caller is on an AVX2+FMA CPU; `tile_rows` checks the slice
        // lengths before its unchecked loads.
        unsafe {
            match rows {
                1 => tile_rows::<1, PREFETCH>(x, x_stride, kc, panel, tile),
                2 => tile_rows::<2, PREFETCH>(x, x_stride, kc, panel, tile),
                3 => tile_rows::<3, PREFETCH>(x, x_stride, kc, panel, tile),
                4 => tile_rows::<4, PREFETCH>(x, x_stride, kc, panel, tile),
                5 => tile_rows::<5, PREFETCH>(x, x_stride, kc, panel, tile),
                _ => tile_rows::<6, PREFETCH>(x, x_stride, kc, panel, tile),
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile_rows<const R: usize, const PREFETCH: bool>(
        x: &[f32],
        x_stride: usize,
        kc: usize,
        panel: &[f32],
        tile: &mut TileBuf,
    ) {
        assert!(R <= TILE_ROWS && kc <= x_stride && panel.len() >= kc * PANEL_WIDTH);
        assert!(x.len() >= (R - 1) * x_stride + kc);
        let (xp, wp) = (x.as_ptr(), panel.as_ptr());
        // SAFETY: every load below is at x[r * x_stride + kk] (r < R, kk < kc) or
        // panel[kk * 16 + 0..16], inside the slices by the asserts; the CPU has AVX2+FMA
        // (caller). Prefetches may point past the slices: they never fault.
        unsafe {
            let mut lo = [_mm256_setzero_ps(); R];
            let mut hi = [_mm256_setzero_ps(); R];
            for r in 0..R {
                lo[r] = _mm256_loadu_ps(tile[r].as_ptr());
                hi[r] = _mm256_loadu_ps(tile[r].as_ptr().add(8));
            }
            // The panel after this one follows it in memory: ask for its line at the same `k`
            // now, so DRAM keeps streaming while this panel's later row tiles run from cache.
            let next = wp.wrapping_add(kc * PANEL_WIDTH);
            for kk in 0..kc {
                if PREFETCH {
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(kk * PANEL_WIDTH).cast());
                }
                let w_lo = _mm256_loadu_ps(wp.add(kk * PANEL_WIDTH));
                let w_hi = _mm256_loadu_ps(wp.add(kk * PANEL_WIDTH + 8));
                for r in 0..R {
                    let a = _mm256_broadcast_ss(&*xp.add(r * x_stride + kk));
                    lo[r] = _mm256_fmadd_ps(a, w_lo, lo[r]);
                    hi[r] = _mm256_fmadd_ps(a, w_hi, hi[r]);
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(tile[r].as_mut_ptr(), lo[r]);
                _mm256_storeu_ps(tile[r].as_mut_ptr().add(8), hi[r]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{TileBuf, PANEL_WIDTH, TILE_ROWS_512};
    use std::arch::x86_64::*;

    /// `tile[i][..16 * P] += x[i] @ panels` for the first `rows` (1..=12) rows of `x` (row
    /// stride `x_stride`, `kc` inputs), over one panel (`pair` false, `panels` = `kc * 16`
    /// floats) or two neighbouring ones (`pair` true, `2 * kc * 16` floats: the second panel's
    /// columns follow the first's); with `PREFETCH`, the lines of the panels that follow them
    /// in memory are prefetched as it goes.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn tile<const PREFETCH: bool>(
        pair: bool,
        rows: usize,
        x: &[f32],
        x_stride: usize,
        kc: usize,
        panels: &[f32],
        tile: &mut TileBuf,
    ) {
        macro_rules! dispatch {
            ($p:literal) => {
                match rows {
                    1 => tile_rows::<1, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    2 => tile_rows::<2, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    3 => tile_rows::<3, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    4 => tile_rows::<4, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    5 => tile_rows::<5, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    6 => tile_rows::<6, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    7 => tile_rows::<7, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    8 => tile_rows::<8, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    9 => tile_rows::<9, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    10 => tile_rows::<10, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    11 => tile_rows::<11, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                    _ => tile_rows::<12, $p, PREFETCH>(x, x_stride, kc, panels, tile),
                }
            };
        }
        // SAFETY (all arms): the caller is on an AVX-512F CPU; `tile_rows` checks the slice
        // lengths before its unchecked loads.
        unsafe {
            if pair {
                dispatch!(2)
            } else {
                dispatch!(1)
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile_rows<const R: usize, const P: usize, const PREFETCH: bool>(
        x: &[f32],
        x_stride: usize,
        kc: usize,
        panels: &[f32],
        tile: &mut TileBuf,
    ) {
        assert!(R <= TILE_ROWS_512 && kc <= x_stride && panels.len() >= P * kc * PANEL_WIDTH);
        assert!(x.len() >= (R - 1) * x_stride + kc);
        let (xp, wp) = (x.as_ptr(), panels.as_ptr());
        // SAFETY: every load below is at x[r * x_stride + kk] (r < R, kk < kc), at
        // panels[j * kc * 16 + kk * 16 + 0..16] (j < P) or in `tile`'s first R rows, inside the
        // slices by the asserts; the CPU has AVX-512F (caller). Prefetches may point past the
        // slices: they never fault.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            for (row, t) in acc.iter_mut().zip(tile.iter()) {
                for (j, a) in row.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(t.as_ptr().add(j * PANEL_WIDTH));
                }
            }
            // the panels after these follow them in memory: ask for their lines at this `k`
            let next = wp.wrapping_add(P * kc * PANEL_WIDTH);
            for kk in 0..kc {
                let mut w = [_mm512_setzero_ps(); P];
                for (j, wj) in w.iter_mut().enumerate() {
                    if PREFETCH {
                        _mm_prefetch::<_MM_HINT_T0>(
                            next.wrapping_add(j * kc * PANEL_WIDTH + kk * PANEL_WIDTH)
                                .cast(),
                        );
                    }
                    *wj = _mm512_loadu_ps(wp.add(j * kc * PANEL_WIDTH + kk * PANEL_WIDTH));
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*xp.add(r * x_stride + kk));
                    for (j, acc_j) in row.iter_mut().enumerate() {
                        *acc_j = _mm512_fmadd_ps(a, w[j], *acc_j);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (j, &a) in row.iter().enumerate() {
                    _mm512_storeu_ps(tile[r].as_mut_ptr().add(j * PANEL_WIDTH), a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    /// out[i, j] = bias[j] + sum_k x[i, k] w[j, k], in f64.
    fn reference(x: &[f32], w: &[f32], bias: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|kk| x[i * k + kk] as f64 * w[j * k + kk] as f64)
                    .sum();
                out[i * n + j] = dot + bias.get(j).map_or(0.0, |&b| b as f64);
            }
        }
        out
    }

    fn case(seed: u64, m: usize, n: usize, k: usize, with_bias: bool, threads: usize, isa: Isa) {
        let mut rng = Lcg(seed);
        let (x, w) = (rng.vec(m * k), rng.vec(n * k));
        let bias = if with_bias { rng.vec(n) } else { Vec::new() };
        let packed = pack(&w, n, k).unwrap();
        let mut out = vec![f32::NAN; m * n]; // poisoned: every element must be written
        let shape = LinearShape { m, n, k };
        run(&shape, &x, &packed, &bias, &mut out, threads, isa).unwrap();
        let want = reference(&x, &w, &bias, m, n, k);
        for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
            let tol = 1e-5 * (k as f64).sqrt() * (1.0 + want.abs());
            assert!(
                (got as f64 - want).abs() <= tol,
                "m={m} n={n} k={k} bias={with_bias} threads={threads} isa={isa:?}: \
                 out[{i}] = {got}, reference {want}"
            );
        }
    }

    #[test]
    fn matches_reference_across_shapes_threads_and_paths() {
        let mut seed = 1;
        for &(m, n, k) in &[
            (1, 16, 1),
            (1, 17, 3),
            (2, 40, 64),
            (5, 33, 100),
            (6, 64, 576),
            (7, 96, 57),
            (13, 200, 33),
            (16, 960, 576),
            (33, 130, 260),
            (70, 48, 1536),
            (25, 80, 64),
            (12, 48, 576),
        ] {
            for threads in [1, 2, 3, 8] {
                for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
                    for with_bias in [false, true] {
                        seed += 1;
                        case(seed, m, n, k, with_bias, threads, isa);
                    }
                }
            }
        }
    }

    #[test]
    fn many_rows_take_several_passes_over_the_weights() {
        // K = 4096 gives 12 rows per pass, so 40 rows need 4 passes (the last a partial one).
        case(99, 40, 40, 4096, true, 2, Isa::Avx512);
        case(97, 40, 40, 4096, true, 2, Isa::Avx2);
        case(98, 40, 40, 4096, true, 2, Isa::Portable);
    }

    #[test]
    fn zero_rows_is_a_no_op() {
        let packed = pack(&[1.0; 32], 16, 2).unwrap();
        let shape = LinearShape { m: 0, n: 16, k: 2 };
        linear_f32(&shape, &[], &packed, &[], &mut [], 2).unwrap();
    }

    #[test]
    fn pack_lays_out_panels_with_zero_padding() {
        // W [17, 2]: column j of the output is row j of W.
        let w: Vec<f32> = (0..34).map(|v| v as f32).collect();
        let packed = pack(&w, 17, 2).unwrap();
        assert_eq!(packed.len(), 2 * 2 * PANEL_WIDTH);
        assert_eq!(packed[0], 0.0); // W[0, 0]
        assert_eq!(packed[1], 2.0); // W[1, 0]
        assert_eq!(packed[PANEL_WIDTH], 1.0); // W[0, 1]
        assert_eq!(packed[2 * PANEL_WIDTH], 32.0); // panel 1, k=0: W[16, 0]
        assert_eq!(packed[2 * PANEL_WIDTH + 1], 0.0); // padding
        assert!(pack(&w, 16, 2).is_err());
    }

    #[test]
    fn rejects_mismatched_buffers() {
        let packed = pack(&[0.5; 64], 16, 4).unwrap();
        let shape = LinearShape { m: 2, n: 16, k: 4 };
        let (x, mut out) = (vec![1.0; 8], vec![0.0; 32]);
        assert!(linear_f32(&shape, &x[..7], &packed, &[], &mut out, 1).is_err());
        assert!(linear_f32(&shape, &x, &packed[..63], &[], &mut out, 1).is_err());
        assert!(linear_f32(&shape, &x, &packed, &[0.0; 3], &mut out, 1).is_err());
        assert!(linear_f32(&shape, &x, &packed, &[], &mut out[..31], 1).is_err());
        let zero_k = LinearShape { m: 2, n: 16, k: 0 };
        assert!(linear_f32(&zero_k, &[], &[], &[], &mut out, 1).is_err());
        linear_f32(&shape, &x, &packed, &[], &mut out, 1).unwrap();
        assert!(out.iter().all(|&v| v == 2.0));
    }
}
