//! Linear layers on the CPU through Intel AMX (tile registers, `TDPBF16PS`), for steps of
//! [`min_rows`] rows or more (fewer go to the GGUF-block kernel, `cpu_quant_linear`):
//! `out[M, N] = x[M, K] @ W^T + bias` with `W` given by the model's Q4_1 / Q8_0 blocks
//! (`w = scale * q + min`, `min = 0` for Q8_0), at float32 accuracy.
//!
//! Why it is exact enough: a block's integers `q` (0..16 or -128..128) are bfloat16 numbers, and
//! every float32 `x` is the exact sum of three bfloat16 numbers (its mantissa's top, middle and
//! low 8 bits: [`split3`]). So `S = sum_i q_i x_i` over a block of 32 inputs is three tile
//! products whose every multiply is exact (8 x 8 bits); only the float32 additions round, as in
//! any float32 dot product. Each block's `S` is then scaled into the output:
//! `acc += scale * S + min * sum_i x_i`. This multiplies by the real-number weights
//! `scale * q + min`, which the panels (`cpu_linear`) hold rounded to float32: the results differ
//! at float32-rounding level (~1e-7 of a weight, summation order aside). `TDPBF16PS` treats
//! subnormal inputs as zero: a part below 2^-126 is dropped (an `x` under ~1e-33 loses its low
//! bits), far below float32 rounding of any sum it enters.
//!
//! Packed layout ([`pack`]): for each tile of 16 output features (zero features past `N`) and
//! each block `b` of 32 inputs, one chunk. Chunks run over `b` within a tile, so a task streams
//! its features' weights in address order. The tile loads read one layout, the *unpacked* one
//! ([`CHUNK`] `u16`): the 32 x 16 integers as bfloat16 in the pair-interleaved order
//! `TDPBF16PS` reads (chunk row `r` = inputs `32b + 2r` and `32b + 2r + 1` of features 0..16,
//! interleaved), then the 16 features' scales and their mins as float32 bit patterns (two `u16`
//! each, little-endian). The packed weights store their integers smaller ([`AmxFormat`]):
//! - `Int8` (Q8_0), [`INT8_CHUNK`] `u16`: the same rows as int8, a byte each, the 32 bytes of a
//!   row in the order `unpack_int8_ints` widens them ([`INT8_SLOT`]), then the 16 scales (Q8_0
//!   has no mins). 1.125 bytes per weight, as much as the GGUF blocks (1.0625).
//! - `Nibbles` (Q4_1), [`NIBBLE_CHUNK`] `u16`: the same rows as 4-bit integers, rows `2g` and
//!   `2g + 1` sharing 32 bytes (byte `j`: row `2g`'s value `j` in the low nibble, row `2g + 1`'s
//!   in the high one), then the scales and mins. 0.75 bytes per weight.
//!
//! A step of a few rows is bound by reading the weights, so it reads the small form: a task
//! unpacks each chunk into the unpacked layout in L1 right before its tile load (steps of up to
//! `DIRECT_MAX_ROWS` rows), or a pass of chunks at once into a scratch of its own (L2) that all
//! the rows then read.
//!
//! Invariants checked by [`AmxShape::validate`] before any read, so no tile load leaves its
//! slice: `K % 32 == 0`, `x.len() == M * K`, `tiles.len() == ceil(N / 16) * K / 32 * chunk`,
//! `out.len() == M * N`, `bias` empty or of length `N`.
//! AMX runs only where [`available`] says so: the CPU has AMX-TILE, AMX-BF16, AVX-512F and
//! AVX-512BW, Linux granted this process the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`,
//! asked once), and `FERROBATCH_CPU_ISA` does not cap the kernels below `amx`. Each task of the kernels' pool
//! loads its own tile configuration (per-thread state) and releases the tiles when done.
//! Work split: tiles of 16 features in contiguous ranges, one range per task; a task writes only
//! its own columns of `out`.

use crate::cpu_amx_tiles::{aligned_64, Shared, TileConfig};
use crate::cpu_error::{check_bias, check_lengths, KernelInputError};
use crate::cpu_isa::Isa;
use crate::cpu_linear::OutPtr;
use crate::load_parallel::{load_threads, split, Out};

/// Inputs per block (both formats), and per tile product.
pub const BLOCK: usize = 32;
/// Output features per tile.
pub const TILE_FEATURES: usize = 16;
/// `u16` per unpacked chunk (what the tile loads read): 32 x 16 bfloat16 integers, then 16
/// float32 scales and 16 float32 mins.
pub const CHUNK: usize = BLOCK * TILE_FEATURES + PARAMS;
/// `u16` per chunk of nibbles: 32 x 16 4-bit integers, then the scales and mins.
pub const NIBBLE_CHUNK: usize = BLOCK * TILE_FEATURES / 4 + PARAMS;
/// `u16` per chunk of int8: 32 x 16 bytes, then the 16 scales.
pub const INT8_CHUNK: usize = BLOCK * TILE_FEATURES / 2 + SCALES;
/// `u16` of a chunk's 16 scales and 16 mins (float32).
const PARAMS: usize = 4 * TILE_FEATURES;
/// `u16` of a chunk's 16 scales (float32).
const SCALES: usize = 2 * TILE_FEATURES;

/// Where an `Int8` chunk row keeps the integer of each position of the unpacked row (`pos = 2c
/// + i % 2` for feature `c` and input `i`): `unpack_int8_ints` widens bytes 0..16 and 16..32
/// to float32 lanes, and `packus` interleaves them four at a time, so position `8l + j` comes
/// from byte `4l + j` (`j < 4`) or `16 + 4l + j - 4`.
pub const INT8_SLOT: [usize; 2 * TILE_FEATURES] = {
    let mut slot = [0; 2 * TILE_FEATURES];
    let mut pos = 0;
    while pos < 2 * TILE_FEATURES {
        let (l, j) = (pos / 8, pos % 8);
        slot[pos] = if j < 4 { 4 * l + j } else { 16 + 4 * l + j - 4 };
        pos += 1;
    }
    slot
};

/// How a packed weight stores its integers (the module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxFormat {
    /// as bytes, widened to bfloat16 before use (Q8_0's int8)
    Int8,
    /// as 4-bit nibbles, unpacked to bfloat16 before use (Q4_1)
    Nibbles,
}

impl AmxFormat {
    /// The format [`pack`] gives block weights of this kind (None: Q8G16 has no AMX layout).
    pub fn of(w: &QuantWeight<'_>) -> Option<AmxFormat> {
        match w {
            QuantWeight::Q4_1 { .. } => Some(AmxFormat::Nibbles),
            QuantWeight::Q8_0 { .. } => Some(AmxFormat::Int8),
            QuantWeight::Q8G16 { .. } => None,
        }
    }

    /// `u16` per chunk.
    pub fn chunk_len(self) -> usize {
        match self {
            AmxFormat::Int8 => INT8_CHUNK,
            AmxFormat::Nibbles => NIBBLE_CHUNK,
        }
    }

    /// `u16` of a chunk's parameters (its last ones): scales, and mins where the blocks have them.
    fn params_len(self) -> usize {
        match self {
            AmxFormat::Int8 => SCALES,
            AmxFormat::Nibbles => PARAMS,
        }
    }
}

/// A weight packed by [`pack`].
#[derive(Clone, Copy)]
pub struct AmxTiles<'a> {
    pub format: AmxFormat,
    pub data: &'a [u16],
}

/// The most rows [`min_rows`] asks for: the fewest rows of a step that go to this kernel rather
/// than the GGUF-block kernel (`cpu_quant_linear`) on a small layer (SmolLM2's). 5 until session
/// 44, when computing two feature tiles together made the tiles cheaper at few rows: SmolLM2's
/// whole decode steps with AMX from 1 / 2 / 3 / 4 rows against the blocks there took 0.93x /
/// 0.97x / 1.01x / 1.10x (`benches/build_ab.py --mode step`, context 128).
pub const MIN_ROWS: usize = 4;

/// The fewest rows of a step that go to this kernel rather than the GGUF-block kernel on a layer
/// of `k` inputs: the longer a weight row, the more of the block kernel's per-row work a step's
/// extra row adds, while the tiles' costs per chunk stay. Session 44's kernel on the AMX Xeon,
/// whole decode steps with every layer on AMX against the blocks below this limit
/// (`benches/build_ab.py --mode step`): a 1B Q8_0 shape (k 2048 and 8192) 0.88x / 0.95x /
/// 1.08x at 1 / 2 / 3 rows, its Q4_K_M form 0.94x / 1.06x / 1.11x; SmolLM2 (k 576 and 1536)
/// as [`MIN_ROWS`]. (Session 43's kernel: 4 from 2048 inputs, 3 from 4096, else 5.)
pub fn min_rows(k: usize) -> usize {
    match k {
        2048.. => 3,
        _ => MIN_ROWS,
    }
}

/// Steps of at most this many rows (one row tile) unpack each chunk right before its use;
/// larger ones unpack a pass of chunks once into a scratch (L2) that all their row tiles read.
/// At 17-32 rows, where a direct chunk would be unpacked twice, the scratch took 0.86-0.94x the
/// time for Int8 (a 1B Llama shape in Q8_0, session 43) and 0.98-1.01x for nibbles.
const DIRECT_MAX_ROWS: usize = TILE_ROWS;
/// Rows per tile (the tile registers' height).
const TILE_ROWS: usize = 16;
/// Bytes of weight chunks a task computes for every row tile before moving on to the next
/// features: they stay in L2 while the row tiles walk over them.
const PASS_BYTES: usize = 512 << 10;

/// The block weights [`pack`] reads (the formats of `cpu_quant_linear`).
pub use crate::cpu_quant_linear::QuantWeight;

/// Whether the AMX kernel runs on this machine (see the module header); checked once.
pub fn available() -> bool {
    Isa::detect(Isa::Amx) == Isa::Amx
}

/// Asks Linux for the AMX tile data state (once per process); true if the CPU has AMX-TILE,
/// AMX-BF16, AVX-512F and AVX-512BW and the request was granted. Used by `Isa::detect`.
pub(crate) fn amx_permitted() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            let (tile, bf16) = ((leaf7.edx >> 24) & 1 == 1, (leaf7.edx >> 22) & 1 == 1);
            let avx512 = std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw");
            if !(tile && bf16 && avx512) {
                return false;
            }
            const SYS_ARCH_PRCTL: i64 = 158;
            const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
            const XFEATURE_XTILEDATA: i64 = 18;
            let ret: i64;
            // SAFETY: the arch_prctl system call with two integer arguments; it reads and
            // writes no user memory. `syscall` clobbers rcx and r11.
            unsafe {
                std::arch::asm!(
                    "syscall",
                    inlateout("rax") SYS_ARCH_PRCTL => ret,
                    in("rdi") ARCH_REQ_XCOMP_PERM,
                    in("rsi") XFEATURE_XTILEDATA,
                    lateout("rcx") _,
                    lateout("r11") _,
                    options(nostack)
                );
            }
            ret == 0
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

/// Shapes of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AmxShape {
    /// rows of `x` and `out`
    pub m: usize,
    /// output features (rows of `W`)
    pub n: usize,
    /// input features (a multiple of 32)
    pub k: usize,
}

impl AmxShape {
    /// Tiles of 16 output features.
    pub fn feature_tiles(&self) -> usize {
        self.n.div_ceil(TILE_FEATURES)
    }

    /// `u16` in the packed weight.
    pub fn tiles_len(&self, format: AmxFormat) -> usize {
        self.feature_tiles() * (self.k / BLOCK) * format.chunk_len()
    }

    /// Checks the module header's invariants.
    pub fn validate(
        &self,
        x: &[f32],
        tiles: &AmxTiles<'_>,
        bias: &[f32],
        out: &[f32],
    ) -> Result<(), KernelInputError> {
        crate::cpu_quant_linear::check_block_shape(self.n, self.k)?;
        check_lengths(&[
            ("x", x.len(), self.m * self.k),
            (
                "packed tiles",
                tiles.data.len(),
                self.tiles_len(tiles.format),
            ),
            ("out", out.len(), self.m * self.n),
        ])?;
        check_bias(bias.len(), self.n)?;
        Ok(())
    }
}

/// Packs `[n, k]` block weights into the layout of the module header, in the format
/// [`AmxFormat::of`] gives them (validated by the quantized kernel's own check first).
pub fn pack(w: &QuantWeight<'_>, n: usize, k: usize) -> Result<Vec<u16>, KernelInputError> {
    let mut tiles = vec![0u16; packed_len(w, n, k)?];
    pack_into(w, n, k, &mut tiles)?;
    Ok(tiles)
}

/// The length of [`pack`]'s output for `[n, k]` block weights (validated first).
pub fn packed_len(w: &QuantWeight<'_>, n: usize, k: usize) -> Result<usize, KernelInputError> {
    crate::cpu_quant_linear::QuantShape { m: 0, n, k }.validate(&[], w, &[], &[])?;
    let format = AmxFormat::of(w)
        .ok_or_else(|| KernelInputError("Q8G16 weights have no AMX layout".into()))?;
    Ok(AmxShape { m: 0, n, k }.tiles_len(format))
}

/// [`pack`] into `tiles`: zeroed, [`packed_len`] long (where the caller wants them: the
/// bindings start them on a 64-byte boundary, a tile row's size).
pub fn pack_into(
    w: &QuantWeight<'_>,
    n: usize,
    k: usize,
    tiles: &mut [u16],
) -> Result<(), KernelInputError> {
    crate::cpu_error::check_lengths(&[("tiles", tiles.len(), packed_len(w, n, k)?)])?;
    let nb = k / BLOCK;
    match *w {
        QuantWeight::Q4_1 { scale, min, qs } => {
            pack_tiles(tiles, nb * NIBBLE_CHUNK, |t, chunks| {
                pack_nibble_tile(scale, min, qs, n, nb, t, chunks)
            });
        }
        QuantWeight::Q8_0 { scale, qs } => {
            pack_tiles(tiles, nb * INT8_CHUNK, |t, chunks| {
                pack_int8_tile(scale, qs, n, nb, t, chunks)
            });
        }
        QuantWeight::Q8G16 { .. } => unreachable!("refused by packed_len"),
    }
    Ok(())
}

/// Runs `pack_tile(t, chunks)` for every feature tile `t` (`tile_len` `u16` each) of `tiles`,
/// the tiles split over the load's threads (the load of a large model's weights).
fn pack_tiles(tiles: &mut [u16], tile_len: usize, pack_tile: impl Fn(usize, &mut [u16]) + Sync) {
    let feature_tiles = tiles.len() / tile_len;
    let out = Out(tiles.as_mut_ptr());
    split(feature_tiles, load_threads(), |first, count| {
        // SAFETY: feature tiles first .. first + count, this thread's alone
        let part = unsafe { out.range(first * tile_len, count * tile_len) };
        for (t, tile_chunks) in (first..).zip(part.chunks_exact_mut(tile_len)) {
            pack_tile(t, tile_chunks);
        }
    });
}

/// Writes feature `c`'s float32 parameters into a chunk's parameter words (`params`: its 16
/// scales, then, where `min` is given, its 16 mins).
fn write_params(params: &mut [u16], c: usize, scale: f32, min: Option<f32>) {
    let slots = [(c, Some(scale)), (TILE_FEATURES + c, min)];
    for (slot, value) in slots.into_iter().filter_map(|(s, v)| Some((s, v?))) {
        let bits = value.to_bits();
        params[2 * slot] = bits as u16;
        params[2 * slot + 1] = (bits >> 16) as u16;
    }
}

/// Feature tile `t` of Q4_1 blocks (`tile_chunks`: its `nb` chunks), a `u16` at a time: group
/// `g` of a feature's 32 values in a chunk (values `4g .. 4g + 4`, rows `2g, 2g + 1` of it) is
/// one `u16`, `v0 | v2 << 4 | v1 << 8 | v3 << 12`, the four values being the low nibbles of block
/// bytes `4g ..` for `g < 4`, the high ones of bytes `4(g - 4) ..` after (what the tests'
/// `pack_elementwise` lays out value by value, ~6x slower).
fn pack_nibble_tile(
    scale: &[f32],
    min: &[f32],
    qs: &[u8],
    n: usize,
    nb: usize,
    t: usize,
    tile_chunks: &mut [u16],
) {
    for (b, chunk) in tile_chunks.chunks_exact_mut(NIBBLE_CHUNK).enumerate() {
        let (ints, params) = chunk.split_at_mut(NIBBLE_CHUNK - PARAMS);
        for c in 0..TILE_FEATURES.min(n.saturating_sub(t * TILE_FEATURES)) {
            let j = t * TILE_FEATURES + c;
            let bytes = &qs[(j * nb + b) * (BLOCK / 2)..][..BLOCK / 2];
            for g in 0..BLOCK / 4 {
                let (quad, shift) = (&bytes[(g % 4) * 4..][..4], 4 * (g / 4));
                let v = |m: usize| u16::from((quad[m] >> shift) & 0x0F);
                ints[g * TILE_FEATURES + c] = v(0) | (v(2) << 4) | (v(1) << 8) | (v(3) << 12);
            }
            write_params(params, c, scale[j * nb + b], Some(min[j * nb + b]));
        }
    }
}

/// Feature tile `t` of Q8_0 blocks (`tile_chunks`: its `nb` chunks): input pair `r` of a
/// block (inputs `2r, 2r + 1`) of feature `c` is one `u16` at row `r`'s [`INT8_SLOT`] of
/// position `2c` (positions `2c, 2c + 1` always share one: the slots of `8l + j` and `8l + j +
/// 1` are neighbours for even `j`: checked by a test).
fn pack_int8_tile(
    scale: &[f32],
    qs: &[i8],
    n: usize,
    nb: usize,
    t: usize,
    tile_chunks: &mut [u16],
) {
    for (b, chunk) in tile_chunks.chunks_exact_mut(INT8_CHUNK).enumerate() {
        let (ints, params) = chunk.split_at_mut(INT8_CHUNK - SCALES);
        for c in 0..TILE_FEATURES.min(n.saturating_sub(t * TILE_FEATURES)) {
            let j = t * TILE_FEATURES + c;
            let values = &qs[(j * nb + b) * BLOCK..][..BLOCK];
            let word = INT8_SLOT[2 * c] / 2;
            for (r, pair) in values.chunks_exact(2).enumerate() {
                ints[r * TILE_FEATURES + word] =
                    u16::from(pair[0] as u8) | (u16::from(pair[1] as u8) << 8);
            }
            write_params(params, c, scale[j * nb + b], None);
        }
    }
}

/// `x` as three bfloat16 arrays whose sum is `x` exactly (`hi[i] + mid[i] + lo[i] == x[i]`,
/// `cpu_amx_tiles::split3`), and the sums of `x` over each block of 32 inputs (`sums[i / 32]`).
pub fn split3(x: &[f32], hi: &mut [u16], mid: &mut [u16], lo: &mut [u16], sums: &mut [f32]) {
    for (((&v, hi), mid), lo) in x.iter().zip(hi).zip(mid).zip(lo) {
        [*hi, *mid, *lo] = crate::cpu_amx_tiles::split3(v);
    }
    for (s, block) in sums.iter_mut().zip(x.chunks_exact(BLOCK)) {
        *s = block.iter().sum();
    }
}

thread_local! {
    /// The calling thread's split of `x` and its block sums, reused between calls (no
    /// allocation and no fresh pages per call).
    static SCRATCH: std::cell::RefCell<(Vec<u16>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// `out = x @ W^T + bias` with `W` packed by [`pack`]; `bias` may be empty. Splits `x` by rows
/// and then the feature tiles over up to `num_threads` threads. Errors instead of reading out
/// of bounds, and when AMX is not [`available`].
pub fn linear_amx_f32(
    shape: &AmxShape,
    x: &[f32],
    tiles: AmxTiles<'_>,
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    shape.validate(x, &tiles, bias, out)?;
    if !available() {
        return Err(KernelInputError(
            "AMX is not available on this machine (or FERROBATCH_CPU_ISA caps it)".into(),
        ));
    }
    if shape.m == 0 {
        return Ok(());
    }
    let AmxShape { m, k, .. } = *shape;
    let nb = k / BLOCK;
    let feature_tiles = shape.feature_tiles();
    let work = m.max(4) * shape.n * k;
    let threads = num_threads
        .clamp(1, feature_tiles)
        .min(1 + work / (1 << 18));
    let pool = (threads > 1).then(|| crate::cpu_pool::global(threads));
    let threads = pool.map_or(1, |p| threads.min(p.max_tasks()));
    SCRATCH.with_borrow_mut(|(parts_buffer, sums)| {
        if parts_buffer.len() < 3 * m * k + 32 {
            parts_buffer.resize(3 * m * k + 32, 0);
        }
        sums.resize(m * nb, 0.0);
        let parts = aligned_64(parts_buffer, 3 * m * k);
        let (hi, rest) = parts.split_at_mut(m * k);
        let (mid, lo) = rest.split_at_mut(m * k);
        match pool {
            None => split3(x, hi, mid, lo, sums),
            Some(pool) => {
                let rows_per_task = m.div_ceil(threads);
                let ptrs = [hi, mid, lo].map(|p| Shared(p.as_mut_ptr()));
                let sums_ptr = Shared(sums.as_mut_ptr());
                pool.run(threads, &|t| {
                    let (r0, r1) = ((t * rows_per_task).min(m), ((t + 1) * rows_per_task).min(m));
                    let len = (r1 - r0) * k;
                    // SAFETY: task t touches only rows r0..r1 of each [M, K] part and of the
                    // [M, K / 32] sums (disjoint between tasks, inside the buffers, which
                    // outlive the pool job).
                    let [hi, mid, lo] = ptrs.map(|p| unsafe {
                        std::slice::from_raw_parts_mut(p.get().add(r0 * k), len)
                    });
                    let sums = unsafe {
                        std::slice::from_raw_parts_mut(sums_ptr.get().add(r0 * nb), (r1 - r0) * nb)
                    };
                    split3(&x[r0 * k..r1 * k], hi, mid, lo, sums);
                });
            }
        }
        let kernel = Kernel {
            shape: *shape,
            parts,
            sums,
            tiles,
            bias,
            out: OutPtr(out.as_mut_ptr()),
        };
        match pool {
            // SAFETY: AMX is available (checked above); one thread writes every column.
            None => unsafe { kernel.run_tiles(0, feature_tiles) },
            Some(pool) => {
                let per_task = feature_tiles.div_ceil(threads);
                pool.run(threads, &|t| {
                    let first = (t * per_task).min(feature_tiles);
                    let last = ((t + 1) * per_task).min(feature_tiles);
                    // SAFETY: AMX is available; task t writes only the columns of tiles
                    // first..last, which no other task writes; `out` outlives the pool job
                    // (`run` returns after every task).
                    unsafe { kernel.run_tiles(first, last) };
                });
            }
        }
    });
    Ok(())
}

struct Kernel<'a> {
    shape: AmxShape,
    /// `x` split by [`split3`]: `[3, M, K]` bfloat16
    parts: &'a [u16],
    /// `[M, K / 32]` block sums of `x`
    sums: &'a [f32],
    tiles: AmxTiles<'a>,
    bias: &'a [f32],
    out: OutPtr,
}

thread_local! {
    /// A task's chunks unpacked to the unpacked layout for the pass it computes.
    static UNPACKED: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The 64-byte operand of `LDTILECFG` (palette 1).
/// tmm0-2: the three parts of `rows` rows of `x` (32 inputs each); tmm3 and tmm6: the chunks'
/// 16 x 32 integers (16 rows of interleaved pairs) of two feature tiles; tmm4 and tmm5: their
/// `rows x 16` float32 products.
fn config_for_rows(rows: usize) -> TileConfig {
    let r = rows as u8;
    TileConfig::new(&[r, r, r, 16, r, r, 16])
}

/// Feature tiles a task computes together, block by block ([`Kernel::tile_rows`]): each load
/// of `x`'s three parts (from L2 at 16 rows) serves both, and their two chains of tile products
/// overlap. One at a time (session 43's kernel), SmolLM2's 30 layers of linears at 16 rows took
/// 12.1 -> 9.2 ms a step on two threads (1.31x), 7.9 -> 6.8 ms at 8 rows, 7.05 -> 6.0 at 5,
/// with the widening of the next block's chunks moved after the tile products of this one.
const TOGETHER: usize = 2;

/// What a [`Kernel::tile_rows`] reads its chunks from (its `SRC`): the unpacked layout, or one
/// of the packed formats, each chunk unpacked right before its tile load.
const SRC_UNPACKED: u8 = 0;
const SRC_NIBBLES: u8 = 1;
const SRC_INT8: u8 = 2;

impl Kernel<'_> {
    /// Feature tiles `first..last`, every row.
    ///
    /// # Safety
    /// AMX must be [`available`]; no other thread may access those columns of `out` meanwhile.
    unsafe fn run_tiles(&self, first: usize, last: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let AmxShape { m, k, .. } = self.shape;
            let tile_len = k / BLOCK * CHUNK; // u16 of one feature tile, unpacked
            let format = self.tiles.format;
            let packed_len = k / BLOCK * format.chunk_len(); // and as packed
            let per_pass = (PASS_BYTES / (tile_len * 2)).max(1);
            // few rows: each chunk is unpacked just before each use
            let direct = m <= DIRECT_MAX_ROWS;
            let src = match (direct, format) {
                (false, _) => SRC_UNPACKED,
                (true, AmxFormat::Nibbles) => SRC_NIBBLES,
                (true, AmxFormat::Int8) => SRC_INT8,
            };
            let mut configured_rows = 0;
            UNPACKED.with_borrow_mut(|unpacked| {
                let mut pass = first;
                while pass < last {
                    let pass_end = (pass + per_pass).min(last);
                    let packed = &self.tiles.data[pass * packed_len..pass_end * packed_len];
                    let (chunks, stride): (&[u16], usize) = if direct {
                        (packed, packed_len)
                    } else {
                        let len = (pass_end - pass) * tile_len;
                        if unpacked.len() < len + 32 {
                            unpacked.resize(len + 32, 0);
                        }
                        let dst = aligned_64(unpacked, len);
                        for (from, to) in packed
                            .chunks_exact(format.chunk_len())
                            .zip(dst.chunks_exact_mut(CHUNK))
                        {
                            // SAFETY: AMX available implies AVX-512F and -BW.
                            unsafe { unpack_chunk(format, from, to) };
                        }
                        (dst, tile_len)
                    };
                    for row0 in (0..m).step_by(TILE_ROWS) {
                        let rows = (m - row0).min(TILE_ROWS);
                        if rows != configured_rows {
                            // SAFETY: AMX available (the caller's contract).
                            unsafe { config_for_rows(rows).load() };
                            configured_rows = rows;
                        }
                        let count = chunks.len() / stride;
                        for i in (0..count).step_by(TOGETHER) {
                            let first = &chunks[i * stride..(i + 1) * stride];
                            let t = pass + i;
                            // SAFETY: AMX available and configured for `rows`; the caller owns
                            // the columns of feature tiles t and t + 1.
                            unsafe {
                                if i + 1 < count {
                                    let second = &chunks[(i + 1) * stride..(i + 2) * stride];
                                    self.tile(src, [first, second], t, row0, rows)
                                } else {
                                    self.tile(src, [first], t, row0, rows)
                                }
                            };
                        }
                    }
                    pass = pass_end;
                }
            });
            if configured_rows != 0 {
                // SAFETY: releases this thread's tile state.
                unsafe { crate::cpu_amx_tiles::release() };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (first, last);
    }

    /// Rows `row0..row0 + rows` of the `T` feature tiles from `t` (`T` 1 or 2), whose chunks are
    /// `chunks` (`rows` in 1..=16), in the layout `src` names.
    ///
    /// # Safety
    /// As [`Kernel::run_tiles`], with the tiles configured for `rows`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile<const T: usize>(
        &self,
        src: u8,
        chunks: [&[u16]; T],
        t: usize,
        row0: usize,
        rows: usize,
    ) {
        macro_rules! dispatch {
            ($src:ident: $($r:literal)*) => {
                match rows {
                    // SAFETY: the caller's contract, with R == rows.
                    $($r => unsafe { self.tile_rows::<$r, $src, T>(chunks, t, row0) },)*
                    _ => unreachable!("a row tile has 1..=16 rows"),
                }
            };
        }
        match src {
            SRC_NIBBLES => dispatch!(SRC_NIBBLES: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
            SRC_INT8 => dispatch!(SRC_INT8: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
            _ => dispatch!(SRC_UNPACKED: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
        }
    }

    /// [`Kernel::tile`] for `R` rows: the `T x R x 16` accumulators stay in registers (at 16
    /// rows and two tiles some spill to the stack, in L1). Per block: the tile products of
    /// every feature tile (one load of `x`'s parts for all), then the next block's chunks
    /// widened (so no tile load reads what a store just wrote), then this block's products
    /// scaled into the accumulators.
    ///
    /// # Safety
    /// As [`Kernel::tile`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn tile_rows<const R: usize, const SRC: u8, const T: usize>(
        &self,
        chunks: [&[u16]; T],
        t: usize,
        row0: usize,
    ) {
        use std::arch::x86_64::*;
        const { assert!(T == 1 || T == 2) };
        let AmxShape { m, n, k } = self.shape;
        let nb = k / BLOCK;
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        #[repr(align(64))]
        struct Products([[f32; TILE_ROWS * TILE_FEATURES]; TOGETHER]);
        let mut products = Products([[0.0; TILE_ROWS * TILE_FEATURES]; TOGETHER]);
        let products = products.0.as_mut_ptr().cast::<f32>();
        // the widened chunks: [block parity][feature tile]
        #[repr(align(64))]
        struct Unpacked([[[u16; BLOCK * TILE_FEATURES]; TOGETHER]; 2]);
        let mut unpacked = Unpacked([[[0; BLOCK * TILE_FEATURES]; TOGETHER]; 2]);
        let (chunk_len, params_len) = match SRC {
            SRC_NIBBLES => (NIBBLE_CHUNK, PARAMS),
            SRC_INT8 => (INT8_CHUNK, SCALES),
            _ => (CHUNK, PARAMS),
        };
        for c in chunks {
            assert!(c.len() == nb * chunk_len);
        }
        // Block b's integers of feature tile j, as the tile load reads them: the chunk itself
        // (unpacked layout) or widened into `unpacked[b % 2][j]`.
        let mut ints = |j: usize, b: usize| -> *const u16 {
            let chunk = chunks[j][b * chunk_len..].as_ptr();
            let dst = unpacked.0[b % 2][j].as_mut_ptr();
            // SAFETY: the chunk holds the integers of its format (length asserted above), dst
            // 512 u16; AMX available implies AVX-512F and -BW.
            match SRC {
                SRC_NIBBLES => unsafe { unpack_ints(chunk, dst) },
                SRC_INT8 => unsafe { unpack_int8_ints(chunk, dst) },
                _ => chunk,
            }
        };
        let mut next = [std::ptr::null(); T];
        for (j, p) in next.iter_mut().enumerate() {
            *p = ints(j, 0);
        }
        let row_bytes = k * 2;
        let part = |p: usize, b: usize| self.parts[(p * m + row0) * k + b * BLOCK..].as_ptr();
        let sums = &self.sums[row0 * nb..(row0 + R) * nb];
        for b in 0..nb {
            let current = next;
            let (x0, x1, x2) = (part(0, b), part(1, b), part(2, b));
            // SAFETY: every tile load reads R rows of 64 bytes: the parts' rows row0..row0+R
            // at inputs 32b..32b+32 (inside [3, M, K]), and 1024 bytes of unpacked integers per
            // feature tile; the stores write R rows of `products`' T buffers.
            unsafe {
                if T == 2 {
                    amx::pair_products(
                        x0,
                        x1,
                        x2,
                        row_bytes,
                        [current[0], current[T - 1]],
                        products,
                    );
                } else {
                    amx::block_products(x0, x1, x2, row_bytes, current[0], products);
                }
            }
            if b + 1 < nb {
                for (j, p) in next.iter_mut().enumerate() {
                    *p = ints(j, b + 1);
                }
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let params = chunks[j][(b + 1) * chunk_len - params_len..]
                    .as_ptr()
                    .cast::<f32>();
                // SAFETY: the chunk's last params_len u16 are its 16 scales (and 16 mins);
                // buffer j of `products` holds R rows of 16 products.
                unsafe {
                    let scale = _mm512_loadu_ps(params);
                    let buffer = products.add(j * TILE_ROWS * TILE_FEATURES);
                    if SRC == SRC_INT8 {
                        // Q8_0: no mins
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let s = _mm512_load_ps(buffer.add(r * TILE_FEATURES));
                            *acc = _mm512_fmadd_ps(s, scale, *acc);
                        }
                    } else {
                        let min = _mm512_loadu_ps(params.add(TILE_FEATURES));
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let s = _mm512_load_ps(buffer.add(r * TILE_FEATURES));
                            *acc = _mm512_fmadd_ps(s, scale, *acc);
                            *acc = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * nb + b]), min, *acc);
                        }
                    }
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            let col0 = (t + j) * TILE_FEATURES;
            let width = (n - col0).min(TILE_FEATURES);
            let mask: __mmask16 = if width == TILE_FEATURES {
                0xFFFF
            } else {
                (1u16 << width) - 1
            };
            let bias = if self.bias.is_empty() {
                _mm512_setzero_ps()
            } else {
                _mm512_maskz_loadu_ps(mask, self.bias[col0..].as_ptr())
            };
            for (r, acc) in acc.iter().enumerate() {
                // SAFETY: row row0 + r < m, columns col0..col0+width < n: inside `out` (length
                // m * n), columns this task owns.
                unsafe {
                    let dst = self.out.0.add((row0 + r) * n + col0);
                    _mm512_mask_storeu_ps(dst, mask, _mm512_add_ps(*acc, bias));
                }
            }
        }
    }
}

/// bfloat16 bit patterns of 0.0, 1.0, ..., 15.0, then zeros (`vpermw` indexes 32 words).
const NIBBLE_VALUES: [u16; 32] = {
    let mut lut = [0u16; 32];
    let mut i = 0;
    while i < 16 {
        lut[i] = ((i as f32).to_bits() >> 16) as u16;
        i += 1;
    }
    lut
};

/// A chunk's 4-bit integers (the first `NIBBLE_CHUNK - 64` u16 at `src`) unpacked into the
/// unpacked layout's 512 bfloat16 integers at `dst` (returned): each group of 32 bytes becomes
/// two rows.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW; `src` readable for 128 u16, `dst` writable for 512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_ints(src: *const u16, dst: *mut u16) -> *const u16 {
    use std::arch::x86_64::*;
    let lut = unsafe { _mm512_loadu_si512(NIBBLE_VALUES.as_ptr().cast()) };
    let low4 = _mm256_set1_epi8(0x0F);
    for g in 0..TILE_ROWS / 2 {
        // SAFETY: group g is u16 16g..16g+16 of src's 128; rows 2g and 2g + 1 are u16
        // 64g..64g+64 of dst's 512.
        unsafe {
            let v = _mm256_loadu_si256(src.add(16 * g).cast());
            let even = _mm256_and_si256(v, low4);
            let odd = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
            let even = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(even), lut);
            let odd = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(odd), lut);
            _mm512_storeu_si512(dst.add(64 * g).cast(), even);
            _mm512_storeu_si512(dst.add(64 * g + 32).cast(), odd);
        }
    }
    dst
}

/// A chunk's int8 integers (the first 256 u16 at `src`, rows of 32 bytes in the
/// [`INT8_SLOT`] order) widened into the unpacked layout's 512 bfloat16 integers at `dst`
/// (returned): per row, bytes 0..16 and 16..32 become float32 lanes (exact: |q| <= 128), whose
/// top halves are their bfloat16 patterns, packed four and four per 128-bit lane.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW; `src` readable for 256 u16, `dst` writable for 512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_int8_ints(src: *const u16, dst: *mut u16) -> *const u16 {
    use std::arch::x86_64::*;
    let widen = |bytes: __m128i| {
        let f = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
        _mm512_srli_epi32::<16>(f)
    };
    for r in 0..TILE_ROWS {
        // SAFETY: row r is u16 16r..16r+16 of src's 256 and u16 32r..32r+32 of dst's 512.
        unsafe {
            let lo = _mm_loadu_si128(src.add(16 * r).cast());
            let hi = _mm_loadu_si128(src.add(16 * r + 8).cast());
            let row = _mm512_packus_epi32(widen(lo), widen(hi));
            _mm512_storeu_si512(dst.add(32 * r).cast(), row);
        }
    }
    dst
}

/// One packed chunk of `format` (its `chunk_len` u16) unpacked into the unpacked layout (`CHUNK`
/// u16): integers widened, scales copied, mins copied (`Nibbles`) or zero (`Int8`).
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW.
#[cfg(target_arch = "x86_64")]
unsafe fn unpack_chunk(format: AmxFormat, src: &[u16], dst: &mut [u16]) {
    assert!(src.len() == format.chunk_len() && dst.len() == CHUNK);
    let (ints, params) = dst.split_at_mut(BLOCK * TILE_FEATURES);
    // SAFETY: lengths asserted; the caller's CPU features.
    match format {
        AmxFormat::Nibbles => unsafe { unpack_ints(src.as_ptr(), ints.as_mut_ptr()) },
        AmxFormat::Int8 => unsafe { unpack_int8_ints(src.as_ptr(), ints.as_mut_ptr()) },
    };
    let packed_params = &src[src.len() - format.params_len()..];
    params[..packed_params.len()].copy_from_slice(packed_params);
    params[packed_params.len()..].fill(0);
}

/// The AMX instructions, as inline assembly (Rust's AMX intrinsics are not stable).
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;

    /// `products = x0 @ B + x1 @ B + x2 @ B` for one block of one feature tile, computed in
    /// tmm4: tmm0-2 loaded from the three parts (rows `row_bytes` apart), tmm3 from the chunk's
    /// interleaved integers `ints`, the products stored 64 bytes per row.
    ///
    /// # Safety
    /// Tiles configured (`config_for_rows`); the loads and the store stay inside their arrays
    /// for the configured rows.
    #[inline(always)]
    pub(super) unsafe fn block_products(
        x0: *const u16,
        x1: *const u16,
        x2: *const u16,
        row_bytes: usize,
        ints: *const u16,
        products: *mut f32,
    ) {
        unsafe {
            asm!(
                "tilezero tmm4",
                "tileloadd tmm3, [{w} + {s64}*1]",
                "tileloadd tmm0, [{x0} + {s}*1]",
                "tdpbf16ps tmm4, tmm0, tmm3",
                "tileloadd tmm1, [{x1} + {s}*1]",
                "tdpbf16ps tmm4, tmm1, tmm3",
                "tileloadd tmm2, [{x2} + {s}*1]",
                "tdpbf16ps tmm4, tmm2, tmm3",
                "tilestored [{p} + {s64}*1], tmm4",
                w = in(reg) ints,
                x0 = in(reg) x0,
                x1 = in(reg) x1,
                x2 = in(reg) x2,
                s = in(reg) row_bytes,
                s64 = in(reg) 64usize,
                p = in(reg) products,
                options(nostack)
            );
        }
    }

    /// [`block_products`] for two feature tiles at once: their integers `ints[0]` / `ints[1]`
    /// in tmm3 / tmm6, their products in tmm4 / tmm5 (two independent chains of tile products
    /// over each load of `x`'s parts), stored to `products` and `products + 256`.
    ///
    /// # Safety
    /// As [`block_products`]; `products` writable for 512 float32.
    #[inline(always)]
    pub(super) unsafe fn pair_products(
        x0: *const u16,
        x1: *const u16,
        x2: *const u16,
        row_bytes: usize,
        ints: [*const u16; 2],
        products: *mut f32,
    ) {
        unsafe {
            asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tileloadd tmm3, [{w0} + {s64}*1]",
                "tileloadd tmm6, [{w1} + {s64}*1]",
                "tileloadd tmm0, [{x0} + {s}*1]",
                "tdpbf16ps tmm4, tmm0, tmm3",
                "tdpbf16ps tmm5, tmm0, tmm6",
                "tileloadd tmm1, [{x1} + {s}*1]",
                "tdpbf16ps tmm4, tmm1, tmm3",
                "tdpbf16ps tmm5, tmm1, tmm6",
                "tileloadd tmm2, [{x2} + {s}*1]",
                "tdpbf16ps tmm4, tmm2, tmm3",
                "tdpbf16ps tmm5, tmm2, tmm6",
                "tilestored [{p0} + {s64}*1], tmm4",
                "tilestored [{p1} + {s64}*1], tmm5",
                w0 = in(reg) ints[0],
                w1 = in(reg) ints[1],
                x0 = in(reg) x0,
                x1 = in(reg) x1,
                x2 = in(reg) x2,
                s = in(reg) row_bytes,
                s64 = in(reg) 64usize,
                p0 = in(reg) products,
                p1 = in(reg) products.wrapping_add(256),
                options(nostack)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_amx_tiles::bf16_bits;
    use crate::cpu_quant_linear::tests::{dequantized, random_blocks};
    use crate::test_rng::Lcg;

    /// A layout [`pack_elementwise`] writes.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Layout {
        /// the weight's packed format
        Packed(AmxFormat),
        /// what the tile loads read (as [`unpack_chunk`] makes it)
        Unpacked,
    }

    /// [`pack_into`] value by value, into any of the layouts of the module header (the reference
    /// the packings and the unpackings are tested against).
    fn pack_elementwise(
        w: &QuantWeight<'_>,
        n: usize,
        k: usize,
        layout: Layout,
        tiles: &mut [u16],
    ) {
        let nb = k / BLOCK;
        // q(feature j, block b, input i of the block), scale and min of (j, b)
        let q = |j: usize, b: usize, i: usize| -> u8 {
            match w {
                QuantWeight::Q4_1 { qs, .. } => {
                    let byte = qs[(j * nb + b) * (BLOCK / 2) + i % 16];
                    if i < 16 {
                        byte & 0x0F
                    } else {
                        byte >> 4
                    }
                }
                QuantWeight::Q8_0 { qs, .. } => qs[(j * nb + b) * BLOCK + i] as u8,
                QuantWeight::Q8G16 { .. } => unreachable!("refused above"),
            }
        };
        let (scale, min) = match w {
            QuantWeight::Q4_1 { scale, min, .. } => (*scale, Some(*min)),
            QuantWeight::Q8_0 { scale, .. } => (*scale, None),
            QuantWeight::Q8G16 { .. } => unreachable!("refused above"),
        };
        let (chunk_len, params_len) = match layout {
            Layout::Packed(AmxFormat::Int8) => (INT8_CHUNK, SCALES),
            Layout::Packed(AmxFormat::Nibbles) => (NIBBLE_CHUNK, PARAMS),
            Layout::Unpacked => (CHUNK, PARAMS),
        };
        for (t, tile_chunks) in tiles.chunks_exact_mut(nb * chunk_len).enumerate() {
            for (b, chunk) in tile_chunks.chunks_exact_mut(chunk_len).enumerate() {
                let (ints, params) = chunk.split_at_mut(chunk_len - params_len);
                for c in 0..TILE_FEATURES {
                    let j = t * TILE_FEATURES + c;
                    if j >= n {
                        break; // padding features: zero integers, scales and mins
                    }
                    for i in 0..BLOCK {
                        // chunk row r = i / 2, position c * 2 + i % 2 in it
                        let (r, pos) = (i / 2, c * 2 + i % 2);
                        let value = q(j, b, i);
                        let (word, shift, bits) = match layout {
                            Layout::Unpacked => {
                                let as_int = if min.is_some() {
                                    i16::from(value)
                                } else {
                                    i16::from(value as i8)
                                };
                                (r * 2 * TILE_FEATURES + pos, 0, bf16_bits(f32::from(as_int)))
                            }
                            Layout::Packed(AmxFormat::Int8) => {
                                let byte = r * 2 * TILE_FEATURES + INT8_SLOT[pos];
                                (byte / 2, 8 * (byte % 2), u16::from(value))
                            }
                            // byte pos of group r / 2 (16 u16 = 32 bytes per group)
                            Layout::Packed(AmxFormat::Nibbles) => (
                                (r / 2) * TILE_FEATURES + pos / 2,
                                8 * (pos % 2) + 4 * (r % 2),
                                u16::from(value),
                            ),
                        };
                        ints[word] |= bits << shift;
                    }
                    let params_min = min
                        .map(|m| m[j * nb + b])
                        .or((params_len == PARAMS).then_some(0.0));
                    write_params(params, c, scale[j * nb + b], params_min);
                }
            }
        }
    }

    /// `sum_i x[r, i] * w[j, i]` in float64.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, bias: &[f32]) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for r in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|i| f64::from(x[r * k + i]) * f64::from(w[j * k + i]))
                    .sum();
                out[r * n + j] = dot + bias.get(j).map_or(0.0, |&b| f64::from(b));
            }
        }
        out
    }

    #[test]
    fn split3_parts_sum_to_x_exactly() {
        let mut rng = Lcg(7);
        let mut x: Vec<f32> = (0..4096).map(|_| rng.next_f32()).collect();
        x.extend([
            0.0,
            -0.0,
            1.0,
            f32::MAX,
            -f32::MAX,
            1e-30,
            3.0e38,
            123456.79,
        ]);
        x.extend((0..24).map(|e| 1.0 + f32::EPSILON * e as f32)); // low mantissa bits
        let len = x.len().next_multiple_of(BLOCK);
        x.resize(len, 0.5);
        let mut parts = vec![0u16; 3 * len];
        let mut sums = vec![0f32; len / BLOCK];
        let (hi, rest) = parts.split_at_mut(len);
        let (mid, lo) = rest.split_at_mut(len);
        split3(&x, hi, mid, lo, &mut sums);
        for (i, &v) in x.iter().enumerate() {
            let f = |p: usize| f64::from(f32::from_bits(u32::from(parts[p * len + i]) << 16));
            assert_eq!(f(0) + f(1) + f(2), f64::from(v), "x[{i}] = {v}");
        }
        let s0: f32 = x[..BLOCK].iter().sum();
        assert_eq!(sums[0], s0);
    }

    const SHAPES: [(usize, usize, u64); 4] =
        [(20, 96, 11), (16, 32, 12), (37, 256, 13), (1, 64, 14)];

    #[test]
    fn packs_a_word_at_a_time_as_value_by_value() {
        for (n, k, seed) in SHAPES {
            let mut rng = Lcg(seed);
            let b = random_blocks(&mut rng, n, k);
            for q4 in [true, false] {
                let w = b.weight(q4);
                let format = AmxFormat::of(&w).unwrap();
                let len = packed_len(&w, n, k).unwrap();
                let (mut fast, mut slow) = (vec![0u16; len], vec![0u16; len]);
                pack_into(&w, n, k, &mut fast).unwrap();
                pack_elementwise(&w, n, k, Layout::Packed(format), &mut slow);
                assert_eq!(fast, slow, "n {n}, k {k}, q4 {q4}");
            }
        }
    }

    #[test]
    fn min_rows_falls_with_longer_rows_and_never_passes_the_blocks_limit() {
        let ks = [32, 576, 1536, 2048, 3072, 4096, 8192, 14336, 1 << 20];
        let rows: Vec<usize> = ks.iter().map(|&k| min_rows(k)).collect();
        assert_eq!(rows, [4, 4, 4, 3, 3, 3, 3, 3, 3]);
        // never above MIN_ROWS, which the GGUF-block kernel covers (cpu_decoder's const assert)
        assert!(rows.iter().all(|&r| r <= MIN_ROWS));
    }

    #[test]
    fn int8_slots_are_a_permutation_keeping_pairs_together() {
        let mut seen = [false; 2 * TILE_FEATURES];
        for (pos, &slot) in INT8_SLOT.iter().enumerate() {
            assert!(!seen[slot], "slot {slot} twice");
            seen[slot] = true;
            if pos % 2 == 0 {
                assert!(
                    slot % 2 == 0 && INT8_SLOT[pos + 1] == slot + 1,
                    "pair at {pos}"
                );
            }
        }
    }

    #[test]
    fn unpacked_layout_interleaves_pairs_and_pads() {
        let (n, k) = (20, 64);
        let mut rng = Lcg(3);
        let b = random_blocks(&mut rng, n, k);
        let w = b.weight(false);
        let mut tiles = vec![0u16; 2 * 2 * CHUNK];
        pack_elementwise(&w, n, k, Layout::Unpacked, &mut tiles);
        assert_eq!(AmxFormat::of(&w), Some(AmxFormat::Int8));
        assert_eq!(packed_len(&w, n, k).unwrap(), 2 * 2 * INT8_CHUNK);
        let bf = |bits: u16| f32::from_bits(u32::from(bits) << 16);
        // feature 17 (tile 1, column 1), block 1, input 5 (pair row 2, second of the pair)
        let chunk = &tiles[(2 + 1) * CHUNK..];
        assert_eq!(
            bf(chunk[2 * 32 + 2 + 1]),
            f32::from(b.q8[(17 * 2 + 1) * 32 + 5])
        );
        let scale = |c: usize| {
            f32::from_bits(u32::from(chunk[512 + 2 * c]) | u32::from(chunk[513 + 2 * c]) << 16)
        };
        assert_eq!(scale(1), b.scale[17 * 2 + 1]);
        // features 20..32 of tile 1 are zero padding
        assert!((4..16).all(|c| (0..16).all(|r| chunk[r * 32 + 2 * c] == 0) && scale(c) == 0.0));
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn packed_chunks_unpack_into_the_unpacked_layout() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
            eprintln!("skipped: the unpacking needs AVX-512F and -BW");
            return;
        }
        for (n, k, seed) in SHAPES {
            let mut rng = Lcg(seed);
            let mut b = random_blocks(&mut rng, n, k);
            b.q8[0] = -128; // the extremes of both formats
            b.q8[1] = 127;
            b.q4[0] = 0xF0;
            for q4 in [true, false] {
                let w = b.weight(q4);
                let format = AmxFormat::of(&w).unwrap();
                let packed = pack(&w, n, k).unwrap();
                let chunks = packed.len() / format.chunk_len();
                let mut want = vec![0u16; chunks * CHUNK];
                pack_elementwise(&w, n, k, Layout::Unpacked, &mut want);
                let mut got = vec![7u16; chunks * CHUNK];
                for (from, to) in packed
                    .chunks_exact(format.chunk_len())
                    .zip(got.chunks_exact_mut(CHUNK))
                {
                    // SAFETY: AVX-512F and -BW detected above.
                    unsafe { unpack_chunk(format, from, to) };
                }
                assert_eq!(got, want, "n {n}, k {k}, q4 {q4}");
            }
        }
    }

    fn check(m: usize, n: usize, k: usize, q4: bool, threads: usize, seed: u64) {
        let mut rng = Lcg(seed);
        let b = random_blocks(&mut rng, n, k);
        let w = b.weight(q4);
        let x: Vec<f32> = (0..m * k).map(|_| 3.0 * rng.next_f32()).collect();
        let bias: Vec<f32> = if seed.is_multiple_of(2) {
            rng.vec(n)
        } else {
            vec![]
        };
        let tiles = AmxTiles {
            format: AmxFormat::of(&w).unwrap(),
            data: &pack(&w, n, k).unwrap(),
        };
        let mut out = vec![f32::NAN; m * n];
        linear_amx_f32(&AmxShape { m, n, k }, &x, tiles, &bias, &mut out, threads).unwrap();
        // the loader's float32 weights: within 2^-24 of the real-number weights the kernel uses
        let wd = dequantized(&b, q4, n, k);
        let want = reference(&x, &wd, m, n, k, &bias);
        for r in 0..m {
            for j in 0..n {
                // float32 accumulation of k products: bound by the sum of their magnitudes
                let mag: f64 = (0..k)
                    .map(|i| (f64::from(x[r * k + i]) * f64::from(wd[j * k + i])).abs())
                    .sum();
                let (got, exp) = (f64::from(out[r * n + j]), want[r * n + j]);
                assert!(
                    (got - exp).abs() <= 4e-7 * (mag + 1.0),
                    "m={m} n={n} k={k} q4={q4} row {r} feature {j}: {got} vs {exp}"
                );
            }
        }
    }

    /// Feature tiles computed in pairs ([`TOGETHER`]) give bit for bit what each gives computed
    /// alone (a one-tile layer of its 16 features), in every source layout: direct int8 or
    /// nibbles (up to 16 rows), unpacked in a pass (more).
    #[test]
    #[ignore = "needs AMX: `make test` runs it where the CPU has it"]
    fn feature_tiles_together_match_each_alone() {
        assert!(available(), "AMX is not available (or not granted) here");
        let (n, k) = (48, 96);
        let nb = k / BLOCK;
        let mut rng = Lcg(77);
        let b = random_blocks(&mut rng, n, k);
        for m in [1, 7, 16, 20] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.next_f32() - 0.5).collect();
            for q4 in [true, false] {
                let run = |w: &QuantWeight<'_>, n: usize| {
                    let tiles = AmxTiles {
                        format: AmxFormat::of(w).unwrap(),
                        data: &pack(w, n, k).unwrap(),
                    };
                    let mut out = vec![f32::NAN; m * n];
                    linear_amx_f32(&AmxShape { m, n, k }, &x, tiles, &[], &mut out, 1).unwrap();
                    out
                };
                let all = run(&b.weight(q4), n);
                for f in 0..n / TILE_FEATURES {
                    let (b0, b1) = (f * TILE_FEATURES * nb, (f + 1) * TILE_FEATURES * nb);
                    let w = if q4 {
                        QuantWeight::Q4_1 {
                            scale: &b.scale[b0..b1],
                            min: &b.min[b0..b1],
                            qs: &b.q4[b0 * 16..b1 * 16],
                        }
                    } else {
                        QuantWeight::Q8_0 {
                            scale: &b.scale[b0..b1],
                            qs: &b.q8[b0 * BLOCK..b1 * BLOCK],
                        }
                    };
                    let alone = run(&w, TILE_FEATURES);
                    for r in 0..m {
                        let together = &all[r * n + f * TILE_FEATURES..][..TILE_FEATURES];
                        let alone = &alone[r * TILE_FEATURES..][..TILE_FEATURES];
                        assert!(
                            together
                                .iter()
                                .zip(alone)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "m {m}, q4 {q4}, feature tile {f}, row {r}: {together:?} vs {alone:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    #[ignore = "needs AMX: `make test` runs it where the CPU has it"]
    fn amx_matches_a_float64_reference() {
        assert!(available(), "AMX is not available (or not granted) here");
        let mut seed = 1;
        for &(m, n, k) in &[
            (1, 16, 32),
            (9, 576, 576),
            (13, 200, 96),
            (16, 33, 64),
            (17, 1536, 576),
            (40, 100, 1536),
            (70, 48, 128),
        ] {
            for q4 in [true, false] {
                for threads in [1, 2, 3] {
                    check(m, n, k, q4, threads, seed);
                    seed += 1;
                }
            }
        }
    }

    #[test]
    fn rejects_bad_shapes_touching_nothing() {
        let (m, n, k) = (3, 20, 64);
        let tiles = vec![0u16; AmxShape { m, n, k }.tiles_len(AmxFormat::Nibbles)];
        let x = vec![1f32; m * k];
        let mut out = vec![7f32; m * n];
        let bad = [
            (AmxShape { m, n, k: 48 }, tiles.len(), m * n, n),
            (AmxShape { m, n, k }, tiles.len() - 1, m * n, n),
            (AmxShape { m, n, k }, tiles.len(), m * n - 1, n),
            (AmxShape { m, n, k }, tiles.len(), m * n, n - 1),
        ];
        for (shape, tiles_len, out_len, bias_len) in bad {
            let bias = vec![0f32; bias_len];
            let x = &x[..(shape.m * shape.k).min(x.len())];
            let r = linear_amx_f32(
                &shape,
                x,
                AmxTiles {
                    format: AmxFormat::Nibbles,
                    data: &tiles[..tiles_len],
                },
                &bias,
                &mut out[..out_len],
                2,
            );
            assert!(r.is_err(), "{shape:?} {tiles_len} {out_len} {bias_len}");
        }
        // tiles of the other format's length
        let int8 = vec![0u16; AmxShape { m, n, k }.tiles_len(AmxFormat::Int8)];
        let as_nibbles = AmxTiles {
            format: AmxFormat::Nibbles,
            data: &int8,
        };
        let shape = AmxShape { m, n, k };
        assert!(linear_amx_f32(&shape, &x, as_nibbles, &[], &mut out, 2).is_err());
        assert!(out.iter().all(|&v| v == 7.0));
    }
}
