//! Linear layers on the CPU from GGUF's Q4_1 / Q8_0 blocks laid out as panels, for steps of more
//! rows than `cpu_quant_linear` takes, on CPUs without AMX: `out[M, N] = x[M, K] @ W^T + bias`
//! with `W` streamed from memory at 0.75 (Q4_1) or 1.125 (Q8_0) bytes per weight instead of the
//! float32 panels' 4, and multiplied by exactly the float32 panels' tile kernel.
//!
//! Packed layout ([`pack`]): per panel of 16 output features (`cpu_linear`'s panels; features
//! past `N` have zero scales, mins and integers), per block of 32 inputs, one record:
//! - Q4_1 (384 bytes): the 16 features' scales (`f32 x 16`), their mins (`f32 x 16`), then 16
//!   groups `j` of 16 bytes, byte `c` of group `j` = byte `j` of feature `c`'s GGUF block (low
//!   nibble: input `j`, high nibble: input `j + 16`);
//! - Q8_0 (576 bytes): the 16 scales, then 32 groups `i` of 16 int8, byte `c` = input `i` of
//!   feature `c`;
//! - Q8G16 (768 bytes): the 16 features' scales of inputs 0-15, of inputs 16-31, their mins
//!   likewise (`f32 x 16` each), then 32 groups of 16 int8 as Q8_0's;
//! - Q8S16 (640 bytes): Q8G16 blocks whose minimums are all +0 (Q6_K's form, and the LM head
//!   of most Q4_K_M files): the two rows of scales, then the 32 groups, no minimums (each
//!   weight still `scale * q + 0`, the loader's value bit for bit). A one-row step is bound by
//!   reading the record, and this one is 10 bits a weight instead of 12.
//! - Bf16 / F16 (1,024 bytes): not blocks but float32 weights that a 16-bit float holds
//!   exactly (a bfloat16 or float16 checkpoint's), 16 bits each (`cpu_half_panels`); bfloat16
//!   steps of `cpu_half_amx::MIN_ROWS` rows or more go to AMX tiles where the CPU has them
//!   (`cpu_half_amx`: float32 accuracy, not `linear_f32`'s bits).
//!
//! A panel's records follow each other (`K / 32` per panel), panels follow each other.
//!
//! The kernel walks the panels as `cpu_linear` does (the same passes of rows, pairs of panels
//! and register tiles). Per group of panels, `CHUNK` inputs at a time are unpacked into the
//! task's 8 KiB buffer (L1), each weight formed as the loader's dequantization forms it (one
//! float32 multiply, then one add, never fused), and `cpu_linear`'s tile function adds every
//! row tile's products to its running accumulators. A step of several passes of rows (a prompt
//! chunk) instead unpacks the task's panels once, whole, into a reused thread-local buffer (up
//! to `WHOLE_MAX_BYTES`), and `cpu_linear`'s walk reads them on every pass: unpacking per
//! pass cost 8-12 % of a 512-row step. Either way the sums run in `linear_f32`'s order over the
//! loader's float32 weights, so the output is **bit for bit** `linear_f32`'s (tests check it on
//! every instruction set), while DRAM delivers 3.6-5.3x fewer bytes.
//!
//! Work split: panels in contiguous ranges of an even count, one per task of the kernels' pool
//! (`cpu_pool`); a task writes only its own columns of `out`.
//!
//! Invariants checked by [`QuantPanelShape::validate`] before any read: `K % 32 == 0`,
//! `x.len() == M * K`, `out.len() == M * N`, `data.len()` the packed length of `[N, K]` in its
//! format, `bias` empty or of length `N`.

use crate::cpu_error::{check_bias, check_lengths, KernelInputError};
use crate::cpu_isa::Isa;
#[cfg(target_arch = "x86_64")]
use crate::cpu_linear::{avx2 as linear_avx2, avx512 as linear_avx512};
use crate::cpu_linear::{
    on_panel_ranges, portable as linear_portable, run_panel_range, LinearShape, OutPtr, TileBuf,
    PANEL_WIDTH, TILE_ROWS, TILE_ROWS_512,
};
use crate::cpu_quant_linear::{QuantShape, QuantWeight, BLOCK};
use crate::load_parallel::{load_threads, split, Out};
use std::cell::RefCell;

/// The fewest rows of a step that go to this kernel rather than the GGUF-block kernel
/// (`cpu_quant_linear`), on CPUs without AMX, on AVX-512 (and the portable path, not measured).
/// SmolLM2's linears on two threads of an AMD EPYC (Zen 5), three alternating rounds: blocks
/// 7.8 vs 9.0 ms at 5 rows, 12.7 vs 9.8 at 6, 14.8 vs 10.8 at 7, 11.7 vs 11.1 at 8.
pub const MIN_ROWS: usize = 6;

/// [`MIN_ROWS`] on AVX2, where the block kernel is bound by its instructions, not by memory (as
/// fast from L3 as from DRAM: 5.5 GB/s on one Zen 3 thread at one row), so the panels' register
/// tiles overtake it sooner. SmolLM2's linears on two threads (`benches/cpu_kernels.py --only blocks`):
/// AMD EPYC Zen 3, three rounds, blocks vs these panels 10.3-10.8 vs 10.1-10.4 ms at 2 rows,
/// 11.5-11.6 vs 10.3-10.7 at 3, 12.9-14.0 vs 10.6-11.2 at 4, 15.0-15.1 vs 12.2-12.3 at 5 (and
/// 8.7-9.3 vs 9.8-10.0 at one row); Zen 5 capped at AVX2 (session 17): 10.8 vs 10.1 at 4 rows,
/// 12.6 vs 10.2 at 5. Four is the fewest rows where both machines gain. Re-measured on the
/// Zen 3 after the block kernel's row loop moved into one call (session 20): 9.0 vs 10.1 ms at
/// 3 rows, 10.4-12.1 vs 10.5-10.6 at 4, 13.3 vs 11.9 at 5, so four still holds.
pub const MIN_ROWS_AVX2: usize = 4;

/// The fewest rows of a step that go to this kernel on this CPU ([`MIN_ROWS_AVX2`] where its
/// widest instruction set, at most `FERROBATCH_CPU_ISA`, is AVX2; else [`MIN_ROWS`]).
pub fn min_rows() -> usize {
    match Isa::detect(Isa::Avx512) {
        Isa::Avx2 => MIN_ROWS_AVX2,
        _ => MIN_ROWS,
    }
}

/// The block format of packed panels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PanelFormat {
    /// `w = scale * q + min`, q in 0..16 (two per byte)
    Q4_1,
    /// `w = scale * q`, q an int8
    Q8_0,
    /// `w = scale * q + min`, q an int8, a scale and a min per 16 inputs
    Q8G16,
    /// `w = scale * q + 0`, q an int8, a scale per 16 inputs: Q8G16 blocks whose minimums are
    /// all +0 (bit for bit)
    Q8S16,
    /// float32 weights that are bfloat16 values, as their bfloat16 bits (`cpu_half_panels`)
    Bf16,
    /// float32 weights that are float16 values, as their float16 bits (`cpu_half_panels`)
    F16,
}

impl PanelFormat {
    /// The format [`pack`] gives block weights of this kind.
    pub fn of(w: &QuantWeight<'_>) -> Option<PanelFormat> {
        match w {
            QuantWeight::Q4_1 { .. } => Some(PanelFormat::Q4_1),
            QuantWeight::Q8_0 { .. } => Some(PanelFormat::Q8_0),
            QuantWeight::Q8G16 { min, .. } if min.iter().all(|m| m.to_bits() == 0) => {
                Some(PanelFormat::Q8S16)
            }
            QuantWeight::Q8G16 { .. } => Some(PanelFormat::Q8G16),
        }
    }

    /// Bytes of one (panel, block) record.
    pub fn record_bytes(self) -> usize {
        match self {
            PanelFormat::Q4_1 => 2 * 4 * PANEL_WIDTH + PANEL_WIDTH * BLOCK / 2,
            PanelFormat::Q8_0 => 4 * PANEL_WIDTH + PANEL_WIDTH * BLOCK,
            PanelFormat::Q8G16 => 4 * 4 * PANEL_WIDTH + PANEL_WIDTH * BLOCK,
            PanelFormat::Q8S16 => 2 * 4 * PANEL_WIDTH + PANEL_WIDTH * BLOCK,
            PanelFormat::Bf16 | PanelFormat::F16 => crate::cpu_half_panels::RECORD,
        }
    }
}

/// Packed panels ([`pack`]) and their format.
#[derive(Clone, Copy)]
pub struct QuantPanels<'a> {
    pub format: PanelFormat,
    pub data: &'a [u8],
}

/// Shapes of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantPanelShape {
    /// rows of `x` and `out`
    pub m: usize,
    /// output features (rows of `W`)
    pub n: usize,
    /// input features (a multiple of 32)
    pub k: usize,
}

impl QuantPanelShape {
    /// Bytes [`pack`] gives a `[N, K]` weight in `format`.
    pub fn packed_len(&self, format: PanelFormat) -> usize {
        self.n.div_ceil(PANEL_WIDTH) * (self.k / BLOCK) * format.record_bytes()
    }

    /// Checks the module header's invariants.
    pub fn validate(
        &self,
        x: &[f32],
        panels: &QuantPanels<'_>,
        bias: &[f32],
        out: &[f32],
    ) -> Result<(), KernelInputError> {
        crate::cpu_quant_linear::check_block_shape(self.n, self.k)?;
        check_lengths(&[
            ("x", x.len(), self.m * self.k),
            (
                "packed panels",
                panels.data.len(),
                self.packed_len(panels.format),
            ),
            ("out", out.len(), self.m * self.n),
        ])?;
        check_bias(bias.len(), self.n)
    }
}

/// The length of [`pack`]'s output for the blocks of a `[n, k]` weight (validated first).
pub fn packed_len(w: &QuantWeight<'_>, n: usize, k: usize) -> Result<usize, KernelInputError> {
    QuantShape { m: 0, n, k }.validate(&[], w, &[], &[])?;
    let format = PanelFormat::of(w).expect("every block format has a panel layout");
    Ok(QuantPanelShape { m: 0, n, k }.packed_len(format))
}

/// Packs the blocks of a `[n, k]` weight into the layout of the module header.
pub fn pack(w: &QuantWeight<'_>, n: usize, k: usize) -> Result<Vec<u8>, KernelInputError> {
    let mut data = vec![0u8; packed_len(w, n, k)?];
    pack_into(w, n, k, &mut data)?;
    Ok(data)
}

/// [`pack`] into `data`, [`packed_len`] bytes (where the caller wants them: the bindings
/// start them on a 64-byte boundary, as the kernel's records are multiples of 64 bytes).
pub fn pack_into(
    w: &QuantWeight<'_>,
    n: usize,
    k: usize,
    data: &mut [u8],
) -> Result<(), KernelInputError> {
    check_lengths(&[("packed", data.len(), packed_len(w, n, k)?)])?;
    let format = PanelFormat::of(w).expect("every block format has a panel layout");
    let (nb, record) = (k / BLOCK, format.record_bytes());
    let panel_len = nb * record;
    let out = Out(data.as_mut_ptr());
    // panels are independent: each thread packs (and first touches) its own range of them
    split(n.div_ceil(PANEL_WIDTH), load_threads(), |first, count| {
        // SAFETY: panels first .. first + count, this thread's alone
        let part = unsafe { out.range(first * panel_len, count * panel_len) };
        let features = first * PANEL_WIDTH..((first + count) * PANEL_WIDTH).min(n);
        pack_features(w, format, features, nb, first, part);
    });
    Ok(())
}

/// [`pack_into`] of `features` (whole panels from panel `first`) into `part`, their records
/// in `format` (`PanelFormat::of(w)`).
fn pack_features(
    w: &QuantWeight<'_>,
    format: PanelFormat,
    features: std::ops::Range<usize>,
    nb: usize,
    first: usize,
    part: &mut [u8],
) {
    let record = format.record_bytes();
    for (j, feature_blocks) in features.map(|j| (j, j * nb..(j + 1) * nb)) {
        let (p, c) = (j / PANEL_WIDTH - first, j % PANEL_WIDTH);
        for (b, block) in feature_blocks.enumerate() {
            let rec = &mut part[(p * nb + b) * record..][..record];
            let mut put_f32 = |at: usize, v: f32| {
                rec[at + 4 * c..at + 4 * c + 4].copy_from_slice(&v.to_le_bytes())
            };
            match w {
                QuantWeight::Q4_1 { scale, min, qs } => {
                    put_f32(0, scale[block]);
                    put_f32(4 * PANEL_WIDTH, min[block]);
                    for i in 0..BLOCK / 2 {
                        rec[8 * PANEL_WIDTH + i * PANEL_WIDTH + c] = qs[block * BLOCK / 2 + i];
                    }
                }
                QuantWeight::Q8_0 { scale, qs } => {
                    put_f32(0, scale[block]);
                    for i in 0..BLOCK {
                        rec[4 * PANEL_WIDTH + i * PANEL_WIDTH + c] = qs[block * BLOCK + i] as u8;
                    }
                }
                QuantWeight::Q8G16 { scale, min, qs } => {
                    // Q8S16: the scales, then the integers (its minimums are all +0)
                    let with_mins = format == PanelFormat::Q8G16;
                    for half in 0..2 {
                        put_f32(4 * PANEL_WIDTH * half, scale[2 * block + half]);
                        if with_mins {
                            put_f32(4 * PANEL_WIDTH * (2 + half), min[2 * block + half]);
                        }
                    }
                    let q_at = if with_mins { 16 } else { 8 } * PANEL_WIDTH;
                    for i in 0..BLOCK {
                        rec[q_at + i * PANEL_WIDTH + c] = qs[block * BLOCK + i] as u8;
                    }
                }
            }
        }
    }
}

/// `out = x @ W^T + bias` with `W` packed by [`pack`]; `bias` may be empty. Splits the panels
/// over up to `num_threads` threads. Errors instead of reading out of bounds.
pub fn linear_quant_panels_f32(
    shape: &QuantPanelShape,
    x: &[f32],
    panels: QuantPanels<'_>,
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    run(shape, x, panels, bias, out, num_threads, Isa::Amx)
}

/// [`linear_quant_panels_f32`] using at most instruction set `max_isa` (tests compare every
/// path).
fn run(
    shape: &QuantPanelShape,
    x: &[f32],
    panels: QuantPanels<'_>,
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
    max_isa: Isa,
) -> Result<(), KernelInputError> {
    shape.validate(x, &panels, bias, out)?;
    if shape.m == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if panels.format == PanelFormat::Bf16
        && shape.m >= crate::cpu_half_amx::MIN_ROWS
        && Isa::detect(max_isa) == Isa::Amx
    {
        let QuantPanelShape { m, n, k } = *shape;
        // SAFETY: Isa::Amx detected; `validate` checked every length, m >= 1.
        unsafe { crate::cpu_half_amx::run((m, n, k), x, panels.data, bias, out, num_threads) };
        return Ok(());
    }
    let kernel = Kernel {
        shape: *shape,
        x,
        panels,
        bias,
        out: OutPtr(out.as_mut_ptr()),
        // the vector kernels (AMX: bfloat16 panels of many rows, above)
        isa: Isa::detect(max_isa.min(Isa::Avx512)),
    };
    let QuantPanelShape { m, n, k } = *shape;
    on_panel_ranges(&LinearShape { m, n, k }, num_threads, &|first, last| {
        // SAFETY: each range's columns are written by its task alone (`on_panel_ranges`); `out`
        // outlives the call.
        unsafe { kernel.run_panels(first, last) }
    });
    Ok(())
}

/// Inputs per chunk: a group's unpacked chunk (2 panels x 64 inputs x 16 floats, 8 KiB) stays
/// in L1 while every row tile of the step uses it.
const CHUNK: usize = 64;

/// Rows per pass over the weights (as `cpu_linear`'s walk): the x block (rows per pass x K
/// floats) stays in L2 while the panels stream by.
fn rows_per_pass(k: usize, tile_rows: usize) -> usize {
    ((256 * 1024 / 4) / k).clamp(tile_rows, 1 << 16) / tile_rows * tile_rows
}

/// The most bytes a task unpacks whole for a step of several passes of rows (SmolLM2's largest
/// layer, the gate and up projections, is 3.5 MB per task of two).
const WHOLE_MAX_BYTES: usize = 8 << 20;

thread_local! {
    /// A task's whole unpacked panels, kept between calls (a kernel-pool thread's).
    static WHOLE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// How many chunks ahead of the one being unpacked the walk prefetches records: without it
/// the unpacking waited on DRAM at the start of every record (`perf annotate`).
const PREFETCH_CHUNKS: usize = 4;

/// A group's unpacked chunk, `[np][kc][16]`, on a cache-line boundary.
#[repr(align(64))]
struct ChunkBuf([f32; 2 * CHUNK * PANEL_WIDTH]);

struct Kernel<'a> {
    shape: QuantPanelShape,
    x: &'a [f32],
    panels: QuantPanels<'a>,
    bias: &'a [f32],
    out: OutPtr,
    /// what this CPU has, at most what the caller allowed (`Isa::detect`)
    isa: Isa,
}

impl Kernel<'_> {
    /// Output columns of panels `first..last`, every row.
    ///
    /// # Safety
    /// No other thread may access those columns of `out` meanwhile.
    unsafe fn run_panels(&self, first: usize, last: usize) {
        let QuantPanelShape { m, n, k } = self.shape;
        // a few rows of 16-bit float panels: each weight widened in a register, no unpacking
        #[cfg(target_arch = "x86_64")]
        if matches!(self.panels.format, PanelFormat::Bf16 | PanelFormat::F16)
            && match self.isa {
                Isa::Avx512 | Isa::Amx => m <= crate::cpu_half_panels::FEW_ROWS_AVX512,
                Isa::Avx2 => m <= crate::cpu_half_panels::FEW_ROWS_AVX2,
                Isa::Portable => false,
            }
        {
            // SAFETY: `isa` came from `Isa::detect` and is AVX2 or wider, `m` within its limit;
            // the caller owns the columns of panels first..last; `validate` checked every length
            unsafe {
                crate::cpu_half_panels::few_rows(
                    self.isa,
                    self.panels.format,
                    (self.x, m),
                    self.panels.data,
                    (n, k),
                    (first, last),
                    self.bias,
                    self.out.0,
                )
            };
            return;
        }
        let floats = (last - first) * k * PANEL_WIDTH;
        if m > rows_per_pass(k, TILE_ROWS_512) && 4 * floats <= WHOLE_MAX_BYTES {
            // Several passes of rows: unpack this task's panels once, whole, and let the
            // float32 walk read them (from L2 / L3) on every pass.
            WHOLE.with(|whole| {
                let mut whole = whole.borrow_mut();
                if whole.len() < floats + 16 {
                    *whole = vec![0.0; floats + 16];
                }
                let skip = whole.as_ptr().align_offset(64).min(16);
                let panels = &mut whole[skip..skip + floats];
                self.unpack_all(first, last, panels);
                let shape = LinearShape { m, n, k };
                // SAFETY: the caller's contract; `panels` holds panels first..last.
                unsafe {
                    run_panel_range(
                        &shape, self.x, panels, first, last, self.bias, self.out, self.isa,
                    )
                };
            });
            return;
        }
        match self.isa {
            // SAFETY (both SIMD arms): `isa` was detected on this CPU, which therefore supports
            // the features the functions are compiled for; the rest is the caller's.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Amx => unsafe { self.run_avx512(first, last) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { self.run_avx2(first, last) },
            _ => {
                let tile = |_, rows, x: &[f32], k, kc, panel: &[f32], acc: &mut _| {
                    linear_portable::tile(rows, x, k, kc, panel, acc)
                };
                // SAFETY: forwarded from the caller.
                unsafe { self.walk(first, last, 1, TILE_ROWS, tile) }
            }
        }
    }

    /// [`Kernel::walk`] with the AVX-512 tiles (two panels at a time).
    ///
    /// # Safety
    /// As [`Kernel::run_panels`], on a CPU with AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run_avx512(&self, first: usize, last: usize) {
        let tile = |np: usize, rows, x: &[f32], k, kc, panels: &[f32], acc: &mut _| {
            // SAFETY: this CPU has AVX-512F (the caller's contract).
            unsafe { linear_avx512::tile::<false>(np == 2, rows, x, k, kc, panels, acc) }
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.walk(first, last, 2, TILE_ROWS_512, tile) }
    }

    /// [`Kernel::walk`] with the AVX2 tiles.
    ///
    /// # Safety
    /// As [`Kernel::run_panels`], on a CPU with AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, first: usize, last: usize) {
        let tile = |_, rows, x: &[f32], k, kc, panel: &[f32], acc: &mut _| {
            // SAFETY: this CPU has AVX2 and FMA (the caller's contract).
            unsafe { linear_avx2::tile::<false>(rows, x, k, kc, panel, acc) }
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.walk(first, last, 1, TILE_ROWS, tile) }
    }

    /// Unpacks panels `first..last` whole into `out` (`[last - first][K][16]`).
    fn unpack_all(&self, first: usize, last: usize, out: &mut [f32]) {
        let format = self.panels.format;
        let record = format.record_bytes();
        let panel_bytes = self.shape.k / BLOCK * record;
        let src = &self.panels.data[first * panel_bytes..last * panel_bytes];
        for (rec, dst) in src
            .chunks_exact(record)
            .zip(out.chunks_exact_mut(BLOCK * PANEL_WIDTH))
        {
            // SAFETY: `self.isa` came from `Isa::detect` (`run`).
            unsafe { unpack_record(self.isa, format, rec, dst) };
        }
    }

    /// Hints the CPU to fetch the records of inputs `k0..k0 + CHUNK` of the group of `np`
    /// panels at `p`, or of the next group where `k0` is past the panels' end.
    #[inline(always)]
    fn prefetch(&self, p: usize, np: usize, k0: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let record = self.panels.format.record_bytes();
            let panel_bytes = self.shape.k / BLOCK * record;
            let (panel, at) = if k0 < self.shape.k {
                (p, k0 / BLOCK * record)
            } else {
                (p + np, (k0 - self.shape.k) / BLOCK * record)
            };
            let base = self.panels.data.as_ptr();
            for j in 0..np {
                let start = (panel + j) * panel_bytes + at;
                for line in (0..CHUNK / BLOCK * record).step_by(64) {
                    // SAFETY: a prefetch never faults, whatever the address.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(start + line).cast()) };
                }
            }
        }
    }

    /// The walk every instruction set shares: passes of rows whose x block stays in L2 (as
    /// `cpu_linear`'s); per pass, groups of up to `group` neighbouring panels; per group,
    /// chunks of [`CHUNK`] inputs unpacked ([`unpack_record`]) into the task's buffer; per chunk, every row tile of the pass (near-
    /// equal heights of at most `tile_rows`) adds its products to its accumulators
    /// (`tile(panels, rows, x, x_stride, kc, chunk, acc)`), which start as the bias and end in
    /// `out`.
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
        tile: impl Fn(usize, usize, &[f32], usize, usize, &[f32], &mut TileBuf),
    ) {
        let QuantPanelShape { m, k, .. } = self.shape;
        let rows_per_pass = rows_per_pass(k, tile_rows);
        let max_tiles = m.min(rows_per_pass).div_ceil(tile_rows);
        let mut accs: Vec<TileBuf> = vec![[[0.0; 2 * PANEL_WIDTH]; TILE_ROWS_512]; max_tiles];
        let mut starts = vec![0usize; max_tiles + 1];
        let mut buf = ChunkBuf([0.0; 2 * CHUNK * PANEL_WIDTH]);
        for row0 in (0..m).step_by(rows_per_pass) {
            let rows = (m - row0).min(rows_per_pass);
            let num_tiles = rows.div_ceil(tile_rows);
            // row tile t covers rows starts[t]..starts[t + 1]
            starts[0] = row0;
            for t in 0..num_tiles {
                starts[t + 1] = starts[t] + (row0 + rows - starts[t]) / (num_tiles - t);
            }
            let accs = &mut accs[..num_tiles];
            // SAFETY: forwarded from the caller.
            unsafe { self.pass(first, last, group, &starts, accs, &mut buf, &tile) };
        }
    }

    /// One pass of [`Kernel::walk`] over the row tiles `starts[t]..starts[t + 1]`.
    ///
    /// # Safety
    /// As [`Kernel::run_panels`].
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn pass(
        &self,
        first: usize,
        last: usize,
        group: usize,
        starts: &[usize],
        accs: &mut [TileBuf],
        buf: &mut ChunkBuf,
        tile: &impl Fn(usize, usize, &[f32], usize, usize, &[f32], &mut TileBuf),
    ) {
        let QuantPanelShape { n, k, .. } = self.shape;
        let format = self.panels.format;
        let record = format.record_bytes();
        let panel_bytes = k / BLOCK * record;
        let mut p = first;
        while p < last {
            let np = group.min(last - p);
            let col0 = p * PANEL_WIDTH;
            let cols = (n - col0).min(np * PANEL_WIDTH);
            let mut bias = [0f32; 2 * PANEL_WIDTH];
            if !self.bias.is_empty() {
                bias[..cols].copy_from_slice(&self.bias[col0..col0 + cols]);
            }
            accs.iter_mut().for_each(|acc| acc.fill(bias));
            for k0 in (0..k).step_by(CHUNK) {
                let kc = CHUNK.min(k - k0);
                self.prefetch(p, np, k0 + PREFETCH_CHUNKS * CHUNK);
                for j in 0..np {
                    let src = &self.panels.data[(p + j) * panel_bytes + k0 / BLOCK * record..];
                    let dst = &mut buf.0[j * kc * PANEL_WIDTH..][..kc * PANEL_WIDTH];
                    for (rec, out) in src
                        .chunks_exact(record)
                        .zip(dst.chunks_exact_mut(BLOCK * PANEL_WIDTH))
                    {
                        // SAFETY: `self.isa` came from `Isa::detect` (`run`).
                        unsafe { unpack_record(self.isa, format, rec, out) };
                    }
                }
                let chunk = &buf.0[..np * kc * PANEL_WIDTH];
                for (t, acc) in accs.iter_mut().enumerate() {
                    let (r, height) = (starts[t], starts[t + 1] - starts[t]);
                    let x = &self.x[r * k + k0..(r + height - 1) * k + k0 + kc];
                    tile(np, height, x, k, kc, chunk, acc);
                }
            }
            for (t, acc) in accs.iter().enumerate() {
                for (i, values) in acc.iter().take(starts[t + 1] - starts[t]).enumerate() {
                    // SAFETY: row starts[t] + i < m and columns col0..col0 + cols <= n are
                    // inside `out` (validated length m * n) and belong to this task's panels.
                    unsafe {
                        let dst = self.out.0.add((starts[t] + i) * n + col0);
                        std::ptr::copy_nonoverlapping(values.as_ptr(), dst, cols);
                    }
                }
            }
            p += np;
        }
    }
}

/// Unpacks one record into `out` (`[32 inputs][16 features]` floats) with `isa`'s unpacker.
///
/// # Safety
/// `isa` came from [`Isa::detect`] (on this CPU).
#[inline]
unsafe fn unpack_record(isa: Isa, format: PanelFormat, rec: &[u8], out: &mut [f32]) {
    match (isa, format) {
        // SAFETY (x86 arms): the caller's contract: this CPU has `isa`'s features.
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Amx, PanelFormat::Q4_1) => unsafe { avx512::q4_1(rec, out) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Amx, PanelFormat::Q8_0) => unsafe { avx512::q8_0(rec, out) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, PanelFormat::Q4_1) => unsafe { avx2::q4_1(rec, out) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, PanelFormat::Q8_0) => unsafe { avx2::q8_0(rec, out) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Amx, PanelFormat::Q8G16) => unsafe { avx512::q8_g16(rec, out) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, PanelFormat::Q8G16) => unsafe { avx2::q8_g16(rec, out) },
        (_, PanelFormat::Q4_1) => portable::q4_1(rec, out),
        (_, PanelFormat::Q8_0) => portable::q8_0(rec, out),
        (_, PanelFormat::Q8G16) => portable::q8_g16(rec, out),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Amx, PanelFormat::Q8S16) => unsafe { avx512::q8_s16(rec, out) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, PanelFormat::Q8S16) => unsafe { avx2::q8_s16(rec, out) },
        (_, PanelFormat::Q8S16) => portable::q8_s16(rec, out),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Amx, PanelFormat::Bf16 | PanelFormat::F16) => unsafe {
            crate::cpu_half_panels::x86::unpack_avx512(format, rec, out)
        },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, PanelFormat::Bf16 | PanelFormat::F16) => unsafe {
            crate::cpu_half_panels::x86::unpack_avx2(format, rec, out)
        },
        (_, PanelFormat::Bf16 | PanelFormat::F16) => {
            crate::cpu_half_panels::unpack_portable(format, rec, out)
        }
    }
}

/// A Q4_1 record's bytes.
const Q4_1_RECORD: usize = 384;
/// A Q8_0 record's bytes.
const Q8_0_RECORD: usize = 576;
/// A Q8G16 record's bytes.
const Q8G16_RECORD: usize = 768;
/// A Q8S16 record's bytes.
const Q8S16_RECORD: usize = 640;

/// Feature `c`'s float32 at byte `at` of a record.
fn record_f32(rec: &[u8], at: usize, c: usize) -> f32 {
    f32::from_le_bytes(rec[at + 4 * c..at + 4 * c + 4].try_into().unwrap())
}

mod portable {
    use super::{record_f32, PANEL_WIDTH, Q4_1_RECORD, Q8G16_RECORD, Q8S16_RECORD, Q8_0_RECORD};

    /// One Q8S16 record into `out[input][feature]`.
    pub(super) fn q8_s16(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8S16_RECORD);
        for c in 0..PANEL_WIDTH {
            for i in 0..32 {
                let scale = record_f32(rec, 64 * (i / 16), c);
                // + 0.0: the loader's `scale * q + min` with a +0 minimum (a -0 product is +0)
                out[i * PANEL_WIDTH + c] = scale * f32::from(rec[128 + 16 * i + c] as i8) + 0.0;
            }
        }
    }

    /// One Q8G16 record into `out[input][feature]`.
    pub(super) fn q8_g16(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8G16_RECORD);
        for c in 0..PANEL_WIDTH {
            for i in 0..32 {
                let half = i / 16;
                let scale = record_f32(rec, 64 * half, c);
                let min = record_f32(rec, 64 * (2 + half), c);
                out[i * PANEL_WIDTH + c] = scale * f32::from(rec[256 + 16 * i + c] as i8) + min;
            }
        }
    }

    /// One Q4_1 record into `out[input][feature]`.
    pub(super) fn q4_1(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q4_1_RECORD);
        for c in 0..PANEL_WIDTH {
            let (scale, min) = (record_f32(rec, 0, c), record_f32(rec, 64, c));
            for j in 0..16 {
                let byte = rec[128 + 16 * j + c];
                out[j * PANEL_WIDTH + c] = scale * f32::from(byte & 0x0F) + min;
                out[(j + 16) * PANEL_WIDTH + c] = scale * f32::from(byte >> 4) + min;
            }
        }
    }

    /// One Q8_0 record into `out[input][feature]`.
    pub(super) fn q8_0(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8_0_RECORD);
        for c in 0..PANEL_WIDTH {
            let scale = record_f32(rec, 0, c);
            for i in 0..32 {
                out[i * PANEL_WIDTH + c] = scale * f32::from(rec[64 + 16 * i + c] as i8);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{BLOCK, PANEL_WIDTH, Q4_1_RECORD, Q8G16_RECORD, Q8S16_RECORD, Q8_0_RECORD};
    use std::arch::x86_64::*;

    /// One Q8S16 record into `out[input][feature]`, 16 features a vector.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn q8_s16(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8S16_RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: every load reads inside the 640-byte record, every store 16 floats of `out`.
        unsafe {
            let zero = _mm512_setzero_ps();
            for half in 0..2 {
                let scale = _mm512_loadu_ps(r.add(64 * half).cast());
                for i in 16 * half..16 * (half + 1) {
                    let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(r.add(128 + 16 * i).cast()));
                    // scale * q, then + 0: the loader's weight with a +0 minimum
                    let w = _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(q)), zero);
                    _mm512_storeu_ps(o.add(i * PANEL_WIDTH), w);
                }
            }
        }
    }

    /// One Q8G16 record into `out[input][feature]`, 16 features a vector.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn q8_g16(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8G16_RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: every load reads inside the 768-byte record, every store 16 floats of `out`.
        unsafe {
            for half in 0..2 {
                let scale = _mm512_loadu_ps(r.add(64 * half).cast());
                let min = _mm512_loadu_ps(r.add(64 * (2 + half)).cast());
                for i in 16 * half..16 * (half + 1) {
                    let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(r.add(256 + 16 * i).cast()));
                    // scale * q, then + min: two roundings, as the loader's dequantization
                    let w = _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(q)), min);
                    _mm512_storeu_ps(o.add(i * PANEL_WIDTH), w);
                }
            }
        }
    }

    /// One Q4_1 record into `out[input][feature]`, 16 features a vector.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn q4_1(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q4_1_RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: every load reads inside the 384-byte record, every store 16 floats of the
        // 512 in `out` (input j or j + 16 < 32).
        unsafe {
            let scale = _mm512_loadu_ps(r.cast());
            let min = _mm512_loadu_ps(r.add(64).cast());
            let low = _mm512_set1_epi32(0x0F);
            for j in 0..16 {
                let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(r.add(128 + 16 * j).cast()));
                let q_lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low));
                let q_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(bytes));
                // scale * q, then + min: two roundings, as the loader's dequantization
                let w_lo = _mm512_add_ps(_mm512_mul_ps(scale, q_lo), min);
                let w_hi = _mm512_add_ps(_mm512_mul_ps(scale, q_hi), min);
                _mm512_storeu_ps(o.add(j * PANEL_WIDTH), w_lo);
                _mm512_storeu_ps(o.add((j + 16) * PANEL_WIDTH), w_hi);
            }
        }
    }

    /// One Q8_0 record into `out[input][feature]`.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn q8_0(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8_0_RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: as in `q4_1`, inside the 576-byte record and `out`.
        unsafe {
            let scale = _mm512_loadu_ps(r.cast());
            for i in 0..32 {
                let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(r.add(64 + 16 * i).cast()));
                let w = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q));
                _mm512_storeu_ps(o.add(i * PANEL_WIDTH), w);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, PANEL_WIDTH, Q4_1_RECORD, Q8G16_RECORD, Q8S16_RECORD, Q8_0_RECORD};
    use std::arch::x86_64::*;

    /// One Q8S16 record into `out[input][feature]`, 8 features a vector.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn q8_s16(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8S16_RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: every load reads inside the record, every store 8 floats inside `out`.
        unsafe {
            let zero = _mm256_setzero_ps();
            for h in 0..2 {
                for half in 0..2 {
                    let scale = _mm256_loadu_ps(r.add(64 * half + 32 * h).cast());
                    for i in 16 * half..16 * (half + 1) {
                        let at = 128 + 16 * i + 8 * h;
                        let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(r.add(at).cast()));
                        let w = _mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(q)), zero);
                        _mm256_storeu_ps(o.add(i * PANEL_WIDTH + 8 * h), w);
                    }
                }
            }
        }
    }

    /// One Q8G16 record into `out[input][feature]`, 8 features a vector.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn q8_g16(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8G16_RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: every load reads inside the record, every store 8 floats inside `out`.
        unsafe {
            for h in 0..2 {
                for half in 0..2 {
                    let scale = _mm256_loadu_ps(r.add(64 * half + 32 * h).cast());
                    let min = _mm256_loadu_ps(r.add(64 * (2 + half) + 32 * h).cast());
                    for i in 16 * half..16 * (half + 1) {
                        let at = 256 + 16 * i + 8 * h;
                        let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(r.add(at).cast()));
                        let w = _mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(q)), min);
                        _mm256_storeu_ps(o.add(i * PANEL_WIDTH + 8 * h), w);
                    }
                }
            }
        }
    }

    /// One Q4_1 record into `out[input][feature]`, 8 features a vector.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn q4_1(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q4_1_RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: every load reads inside the record, every store 8 floats inside `out`.
        unsafe {
            let low = _mm256_set1_epi32(0x0F);
            for h in 0..2 {
                let scale = _mm256_loadu_ps(r.add(32 * h).cast());
                let min = _mm256_loadu_ps(r.add(64 + 32 * h).cast());
                for j in 0..16 {
                    let at = 128 + 16 * j + 8 * h;
                    let bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(r.add(at).cast()));
                    let q_lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
                    let q_hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(bytes));
                    let w_lo = _mm256_add_ps(_mm256_mul_ps(scale, q_lo), min);
                    let w_hi = _mm256_add_ps(_mm256_mul_ps(scale, q_hi), min);
                    _mm256_storeu_ps(o.add(j * PANEL_WIDTH + 8 * h), w_lo);
                    _mm256_storeu_ps(o.add((j + 16) * PANEL_WIDTH + 8 * h), w_hi);
                }
            }
        }
    }

    /// One Q8_0 record into `out[input][feature]`.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn q8_0(rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == Q8_0_RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: as in `q4_1`.
        unsafe {
            for h in 0..2 {
                let scale = _mm256_loadu_ps(r.add(32 * h).cast());
                for i in 0..32 {
                    let at = 64 + 16 * i + 8 * h;
                    let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(r.add(at).cast()));
                    let w = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(q));
                    _mm256_storeu_ps(o.add(i * PANEL_WIDTH + 8 * h), w);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_linear::{linear_f32_isa, pack as pack_f32, LinearShape};
    use crate::cpu_quant_linear::tests::{dense as dequantized, random_blocks, FORMATS};
    use crate::test_rng::Lcg;

    const ISAS: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    #[test]
    fn record_sizes_match_the_unpackers() {
        assert_eq!(PanelFormat::Q4_1.record_bytes(), Q4_1_RECORD);
        assert_eq!(PanelFormat::Q8_0.record_bytes(), Q8_0_RECORD);
        assert_eq!(PanelFormat::Q8G16.record_bytes(), Q8G16_RECORD);
        assert_eq!(PanelFormat::Q8S16.record_bytes(), Q8S16_RECORD);
    }

    /// Q8G16 blocks whose minimums are all +0 (Q6_K's form): scales of both signs, so that some
    /// products `scale * 0` are -0 (the loader's `+ min` makes them +0).
    fn zero_min_blocks(
        rng: &mut Lcg,
        n: usize,
        k: usize,
    ) -> crate::cpu_quant_linear::tests::Blocks {
        let mut b = random_blocks(rng, n, k);
        b.min16.iter_mut().for_each(|m| *m = 0.0);
        b.scale16.iter_mut().step_by(3).for_each(|s| *s = -*s);
        b.q8.iter_mut().step_by(5).for_each(|q| *q = 0);
        b
    }

    /// Q8G16 blocks without minimums pack as Q8S16 (a minimum of -0 or anything else keeps
    /// Q8G16), and unpack to the loader's float32 weights, +0 where the product is -0, and
    /// the kernel's output is `linear_f32`'s, bit for bit, on every instruction set.
    #[test]
    fn q8_g16_blocks_without_minimums_pack_as_q8s16_bit_for_bit() {
        use crate::cpu_quant_linear::tests::Fmt;
        let mut rng = Lcg(13);
        for &(n, k) in &[(16, 32), (37, 96), (40, 1536)] {
            let mut b = zero_min_blocks(&mut rng, n, k);
            let w = b.of(Fmt::G16);
            assert_eq!(PanelFormat::of(&w), Some(PanelFormat::Q8S16));
            let data = pack(&w, n, k).unwrap();
            let dense = dequantized(&b, Fmt::G16, n, k);
            assert!(
                dense.iter().any(|v| v.to_bits() == 0)
                    && !dense.iter().any(|v| v.to_bits() == 1 << 31)
            );
            let want = pack_f32(&dense, n, k).unwrap();
            let panels = QuantPanels {
                format: PanelFormat::Q8S16,
                data: &data,
            };
            for isa in ISAS.map(Isa::detect) {
                let mut got = vec![f32::NAN; want.len()];
                for (rec, out) in data
                    .chunks_exact(Q8S16_RECORD)
                    .zip(got.chunks_exact_mut(BLOCK * PANEL_WIDTH))
                {
                    // SAFETY: detected just above.
                    unsafe { unpack_record(isa, PanelFormat::Q8S16, rec, out) };
                }
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "n={n} k={k} isa={isa:?}: unpacked"
                );
                for &m in &[1, 5, 24] {
                    let x = rng.vec(m * k);
                    let mut got = vec![f32::NAN; m * n];
                    let shape = QuantPanelShape { m, n, k };
                    run(&shape, &x, panels, &[], &mut got, 2, isa).unwrap();
                    let mut want_out = vec![f32::NAN; m * n];
                    let lin = LinearShape { m, n, k };
                    linear_f32_isa(&lin, &x, &want, &[], &mut want_out, 2, isa).unwrap();
                    assert!(
                        got.iter()
                            .zip(&want_out)
                            .all(|(g, w)| g.to_bits() == w.to_bits()),
                        "m={m} n={n} k={k} isa={isa:?}: output"
                    );
                }
            }
            // the same arrays read as Q8G16 panels are 768-byte records: not these
            let as_g16 = QuantPanels {
                format: PanelFormat::Q8G16,
                data: &data,
            };
            let mut out = vec![0.0; n];
            let shape = QuantPanelShape { m: 1, n, k };
            assert!(
                linear_quant_panels_f32(&shape, &rng.vec(k), as_g16, &[], &mut out, 1).is_err()
            );
            for other in [-0.0, 1e-30] {
                b.min16[n * k / 16 - 1] = other;
                assert_eq!(PanelFormat::of(&b.of(Fmt::G16)), Some(PanelFormat::Q8G16));
            }
        }
    }

    /// Every unpacked weight is the loader's float32 (bit for bit), on every instruction set,
    /// and padding features are zero.
    #[test]
    fn unpacked_records_are_the_float32_panels_bit_for_bit() {
        let mut rng = Lcg(7);
        for &(n, k) in &[(16, 32), (37, 96), (50, 576)] {
            let b = random_blocks(&mut rng, n, k);
            for fmt in FORMATS {
                let w = b.of(fmt);
                let format = PanelFormat::of(&w).unwrap();
                let data = pack(&w, n, k).unwrap();
                let want = pack_f32(&dequantized(&b, fmt, n, k), n, k).unwrap();
                for isa in ISAS {
                    let isa = Isa::detect(isa);
                    let mut got = vec![f32::NAN; want.len()];
                    // record r is (panel r / nb, block r % nb): panel p's [k][16] floats follow
                    // each other in `pack_f32`'s layout, 32 inputs a record
                    for (rec, out) in data
                        .chunks_exact(format.record_bytes())
                        .zip(got.chunks_exact_mut(BLOCK * PANEL_WIDTH))
                    {
                        // SAFETY: detected just above.
                        unsafe { unpack_record(isa, format, rec, out) };
                    }
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "n={n} k={k} {fmt:?} isa={isa:?}: float {i}"
                        );
                    }
                }
            }
        }
    }

    /// The kernel's output is `linear_f32`'s over the loader's float32 weights, bit for bit,
    /// across shapes, row counts (several passes and tiles), thread counts and paths.
    #[test]
    fn output_is_the_float32_panel_kernels_bit_for_bit() {
        let mut rng = Lcg(11);
        for &(n, k) in &[(1, 32), (33, 96), (100, 576), (40, 1536)] {
            let b = random_blocks(&mut rng, n, k);
            for fmt in FORMATS {
                let w = b.of(fmt);
                let data = pack(&w, n, k).unwrap();
                let dense = pack_f32(&dequantized(&b, fmt, n, k), n, k).unwrap();
                let panels = QuantPanels {
                    format: PanelFormat::of(&w).unwrap(),
                    data: &data,
                };
                for &m in &[1, 5, 13, 24, 200] {
                    let x = rng.vec(m * k);
                    let bias = if m % 2 == 1 { rng.vec(n) } else { Vec::new() };
                    for isa in ISAS {
                        for threads in [1, 3] {
                            let mut got = vec![f32::NAN; m * n]; // every element must be written
                            let shape = QuantPanelShape { m, n, k };
                            run(&shape, &x, panels, &bias, &mut got, threads, isa).unwrap();
                            let mut want = vec![f32::NAN; m * n];
                            let lin = LinearShape { m, n, k };
                            linear_f32_isa(&lin, &x, &dense, &bias, &mut want, threads, isa)
                                .unwrap();
                            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                                assert_eq!(
                                    g.to_bits(),
                                    w.to_bits(),
                                    "m={m} n={n} k={k} {fmt:?} isa={isa:?} threads={threads}: \
                                     out[{i}] = {g}, float32 panels {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// 16-bit float panels (`cpu_half_panels`) of bfloat16 / float16 weights: the output is
    /// `linear_f32`'s over the same float32 weights, bit for bit, across shapes, row counts
    /// (each of `few_rows`' register tiles, then the walk: several passes, whole unpacking and
    /// chunks), threads and paths.
    #[test]
    fn half_panels_give_the_float32_panel_kernels_output_bit_for_bit() {
        use crate::cpu_half_panels::{format_of, pack_into, packed_len};
        let mut rng = Lcg(17);
        type Rounding = fn(f32) -> f32;
        let rounders: [(PanelFormat, Rounding); 2] = [
            (PanelFormat::Bf16, |v| half::bf16::from_f32(v).to_f32()),
            (PanelFormat::F16, |v| half::f16::from_f32(v).to_f32()),
        ];
        for (format, round) in rounders {
            for &(n, k) in &[(1, 32), (33, 96), (100, 576), (1400, 1536)] {
                let weight: Vec<f32> = rng.vec(n * k).into_iter().map(round).collect();
                assert_eq!(format_of(&weight), Some(format));
                let mut data = vec![0u8; packed_len(n, k).unwrap()];
                pack_into(&weight, n, k, format, &mut data).unwrap();
                let dense = pack_f32(&weight, n, k).unwrap();
                let panels = QuantPanels {
                    format,
                    data: &data,
                };
                let rows: &[usize] = if n > 1000 {
                    &[1, 6, 50, 100]
                } else {
                    &[1, 2, 3, 4, 5, 6, 7, 8, 9, 24, 200]
                };
                for &m in rows {
                    let x = rng.vec(m * k);
                    let bias = if m % 2 == 1 { rng.vec(n) } else { Vec::new() };
                    for isa in ISAS {
                        let threads = 1 + m % 3;
                        let mut got = vec![f32::NAN; m * n];
                        let shape = QuantPanelShape { m, n, k };
                        run(&shape, &x, panels, &bias, &mut got, threads, isa).unwrap();
                        let mut want = vec![f32::NAN; m * n];
                        let lin = LinearShape { m, n, k };
                        linear_f32_isa(&lin, &x, &dense, &bias, &mut want, threads, isa).unwrap();
                        assert!(
                            got.iter()
                                .zip(&want)
                                .all(|(g, w)| g.to_bits() == w.to_bits()),
                            "{format:?} m={m} n={n} k={k} isa={isa:?}"
                        );
                    }
                }
            }
        }
    }

    /// A task's panels past `WHOLE_MAX_BYTES` are unpacked chunk by chunk on every pass of
    /// rows (smaller ones whole, once, as the test above covers): the same output either way.
    #[test]
    fn a_task_too_large_to_unpack_whole_takes_chunks_on_every_pass() {
        let mut rng = Lcg(5);
        let (n, k, m): (usize, usize, usize) = (1400, 1536, 50);
        assert!(4 * n.div_ceil(PANEL_WIDTH) * PANEL_WIDTH * k > WHOLE_MAX_BYTES);
        assert!(m > rows_per_pass(k, TILE_ROWS_512) && m > rows_per_pass(k, TILE_ROWS));
        let b = random_blocks(&mut rng, n, k);
        let w = b.weight(true);
        let data = pack(&w, n, k).unwrap();
        let dense = pack_f32(&dequantized(&b, FORMATS[0], n, k), n, k).unwrap();
        let panels = QuantPanels {
            format: PanelFormat::Q4_1,
            data: &data,
        };
        let x = rng.vec(m * k);
        for isa in ISAS {
            let mut got = vec![f32::NAN; m * n];
            run(
                &QuantPanelShape { m, n, k },
                &x,
                panels,
                &[],
                &mut got,
                1,
                isa,
            )
            .unwrap();
            let mut want = vec![f32::NAN; m * n];
            let lin = LinearShape { m, n, k };
            linear_f32_isa(&lin, &x, &dense, &[], &mut want, 1, isa).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "isa={isa:?}"
            );
        }
    }

    #[test]
    fn zero_rows_is_a_no_op_and_bad_shapes_are_refused() {
        let mut rng = Lcg(3);
        let (n, k) = (20, 64);
        let b = random_blocks(&mut rng, n, k);
        let w = b.weight(true);
        let data = pack(&w, n, k).unwrap();
        let panels = QuantPanels {
            format: PanelFormat::Q4_1,
            data: &data,
        };
        let shape = QuantPanelShape { m: 0, n, k };
        linear_quant_panels_f32(&shape, &[], panels, &[], &mut [], 2).unwrap();
        let x = rng.vec(2 * k);
        let mut out = vec![0.0; 2 * n];
        let shape = QuantPanelShape { m: 2, n, k };
        let short = QuantPanels {
            format: PanelFormat::Q4_1,
            data: &data[..data.len() - 1],
        };
        assert!(linear_quant_panels_f32(&shape, &x, short, &[], &mut out, 2).is_err());
        let as_q8 = QuantPanels {
            format: PanelFormat::Q8_0,
            data: &data,
        };
        assert!(linear_quant_panels_f32(&shape, &x, as_q8, &[], &mut out, 2).is_err());
        let odd_k = QuantPanelShape { m: 2, n, k: 48 };
        assert!(linear_quant_panels_f32(&odd_k, &x[..96], panels, &[], &mut out, 2).is_err());
        assert!(linear_quant_panels_f32(&shape, &x, panels, &[1.0; 3], &mut out, 2).is_err());
        assert!(pack(&w, n, 96).is_err());
    }
}
