//! Linear layers on the CPU through Intel AMX (tile registers, `TDPBF16PS`), for steps of
//! [`MIN_ROWS`] rows or more (fewer go to the GGUF-block kernel, `cpu_quant_linear`):
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
//! its features' weights in address order. Two formats ([`AmxFormat`]):
//! - `Bf16` (Q8_0), [`CHUNK`] `u16`: the 32 x 16 integers as bfloat16 in the pair-interleaved
//!   order `TDPBF16PS` reads (chunk row `r` = inputs `32b + 2r` and `32b + 2r + 1` of features
//!   0..16, interleaved), then the 16 features' scales and their mins as float32 bit patterns
//!   (two `u16` each, little-endian). 2.25 bytes per weight.
//! - `Nibbles` (Q4_1), [`NIBBLE_CHUNK`] `u16`: the same rows as 4-bit integers, rows `2g` and
//!   `2g + 1` sharing 32 bytes (byte `j`: row `2g`'s value `j` in the low nibble, row `2g + 1`'s
//!   in the high one), then the scales and mins. 0.75 bytes per weight: a step of a few rows,
//!   bound by reading the weights, reads 3x fewer bytes. A task unpacks each chunk into the
//!   `Bf16` layout in L1 right before its tile load (steps of up to [`DIRECT_MAX_ROWS`] rows),
//!   or a pass of chunks at once into a scratch of its own (L2) that all the rows then read.
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

use crate::cpu_amx_tiles::{aligned_64, bf16_bits, Shared, TileConfig};
use crate::cpu_error::{check_bias, check_lengths, KernelInputError};
use crate::cpu_isa::Isa;
use crate::cpu_linear::OutPtr;
use crate::load_parallel::{load_threads, split, Out};

/// Inputs per block (both formats), and per tile product.
pub const BLOCK: usize = 32;
/// Output features per tile.
pub const TILE_FEATURES: usize = 16;
/// `u16` per chunk: 32 x 16 bfloat16 integers, then 16 float32 scales and 16 float32 mins.
pub const CHUNK: usize = BLOCK * TILE_FEATURES + PARAMS;
/// `u16` per chunk of nibbles: 32 x 16 4-bit integers, then the scales and mins.
pub const NIBBLE_CHUNK: usize = BLOCK * TILE_FEATURES / 4 + PARAMS;
/// `u16` of a chunk's 16 scales and 16 mins (float32).
const PARAMS: usize = 4 * TILE_FEATURES;

/// How a packed weight stores its integers (the module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxFormat {
    /// as bfloat16, ready for the tile loads (Q8_0's int8)
    Bf16,
    /// as 4-bit nibbles, unpacked to bfloat16 before use (Q4_1)
    Nibbles,
}

impl AmxFormat {
    /// The format [`pack`] gives block weights of this kind (None: Q8G16 has no AMX layout).
    pub fn of(w: &QuantWeight<'_>) -> Option<AmxFormat> {
        match w {
            QuantWeight::Q4_1 { .. } => Some(AmxFormat::Nibbles),
            QuantWeight::Q8_0 { .. } => Some(AmxFormat::Bf16),
            QuantWeight::Q8G16 { .. } => None,
        }
    }

    /// `u16` per chunk.
    pub fn chunk_len(self) -> usize {
        match self {
            AmxFormat::Bf16 => CHUNK,
            AmxFormat::Nibbles => NIBBLE_CHUNK,
        }
    }
}

/// A weight packed by [`pack`].
#[derive(Clone, Copy)]
pub struct AmxTiles<'a> {
    pub format: AmxFormat,
    pub data: &'a [u16],
}

/// The fewest rows of a step that go to this kernel rather than the GGUF-block kernel
/// (`cpu_quant_linear`). SmolLM2's linears on two threads (`benches/cpu_kernels.py --only amx`
/// and ad-hoc runs): about even at 4-5 rows (10.4 vs 10.5 ms and 10.7 vs 9.9 in one run, 8.0
/// vs 9.0 at 5 in another), AMX ahead from 6 (8.3 vs 8.9) and 8 (12.1 vs 15.8). Whole decode
/// steps of 5-7 rows: within noise (0.96-1.02x); 8 rows 1.07-1.31x.
pub const MIN_ROWS: usize = 5;
/// Steps of at most this many rows unpack each nibble chunk right before each of its (one or
/// two) uses; larger ones unpack a pass of chunks once into a scratch (L2) that all their row
/// tiles read. Measured about even at 17-32 rows, direct 1.2x faster at 16.
const DIRECT_MAX_ROWS: usize = 2 * TILE_ROWS;
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
    if let QuantWeight::Q4_1 { scale, min, qs } = w {
        pack_nibbles(scale, min, qs, n, k, tiles);
        return Ok(());
    }
    pack_elementwise(w, n, k, tiles);
    Ok(())
}

/// [`pack_into`] for Q4_1 blocks, a `u16` at a time: group `g` of a feature's 32 values in a
/// chunk (values `4g .. 4g + 4`, rows `2g, 2g + 1` of it) is one `u16`, `v0 | v2 << 4 | v1 <<
/// 8 | v3 << 12`, the four values being the low nibbles of block bytes `4g ..` for `g < 4`,
/// the high ones of bytes `4(g - 4) ..` after (what [`pack_elementwise`] lays out value by
/// value: ~6x faster, the load of a large model's weights).
fn pack_nibbles(scale: &[f32], min: &[f32], qs: &[u8], n: usize, k: usize, tiles: &mut [u16]) {
    let nb = k / BLOCK;
    let tile_len = nb * NIBBLE_CHUNK;
    let feature_tiles = tiles.len() / tile_len;
    let out = Out(tiles.as_mut_ptr());
    split(feature_tiles, load_threads(), |first, count| {
        // SAFETY: feature tiles first .. first + count, this thread's alone
        let part = unsafe { out.range(first * tile_len, count * tile_len) };
        for (t, tile_chunks) in (first..).zip(part.chunks_exact_mut(tile_len)) {
            pack_nibble_tile(scale, min, qs, n, nb, t, tile_chunks);
        }
    });
}

/// [`pack_nibbles`] of feature tile `t` (`tile_chunks`: its `nb` chunks).
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
            let (d, mn) = (scale[j * nb + b].to_bits(), min[j * nb + b].to_bits());
            for (slot, bits) in [(c, d), (TILE_FEATURES + c, mn)] {
                params[2 * slot] = bits as u16;
                params[2 * slot + 1] = (bits >> 16) as u16;
            }
        }
    }
}

/// [`pack_into`] value by value, for every format (Q8_0's bfloat16; the reference the Q4_1
/// path is tested against).
fn pack_elementwise(w: &QuantWeight<'_>, n: usize, k: usize, tiles: &mut [u16]) {
    let nb = k / BLOCK;
    let format = AmxFormat::of(w).expect("checked by packed_len");
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
    let chunk_len = format.chunk_len();
    for (t, tile_chunks) in tiles.chunks_exact_mut(nb * chunk_len).enumerate() {
        for (b, chunk) in tile_chunks.chunks_exact_mut(chunk_len).enumerate() {
            let (ints, params) = chunk.split_at_mut(chunk_len - PARAMS);
            for c in 0..TILE_FEATURES {
                let j = t * TILE_FEATURES + c;
                if j >= n {
                    break; // padding features: zero integers, scales and mins
                }
                for i in 0..BLOCK {
                    // chunk row r = i / 2, position c * 2 + i % 2 in it
                    let (r, pos) = (i / 2, c * 2 + i % 2);
                    let value = q(j, b, i);
                    match format {
                        AmxFormat::Bf16 => {
                            ints[r * 2 * TILE_FEATURES + pos] = bf16_bits(f32::from(value as i8));
                        }
                        AmxFormat::Nibbles => {
                            // byte pos of group r / 2 (16 u16 = 32 bytes per group)
                            let slot = &mut ints[(r / 2) * TILE_FEATURES + pos / 2];
                            let shift = 8 * (pos % 2) + 4 * (r % 2);
                            *slot |= u16::from(value) << shift;
                        }
                    }
                }
                let d = scale[j * nb + b].to_bits();
                let mn = min.map_or(0, |m| m[j * nb + b].to_bits());
                for (slot, bits) in [(c, d), (TILE_FEATURES + c, mn)] {
                    params[2 * slot] = bits as u16;
                    params[2 * slot + 1] = (bits >> 16) as u16;
                }
            }
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
    /// A task's nibble chunks unpacked to the `Bf16` layout for the pass it computes.
    static UNPACKED: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The 64-byte operand of `LDTILECFG` (palette 1).
/// tmm0-2: the three parts of `rows` rows of `x` (32 inputs each); tmm3: a chunk's 16 x 32
/// integers (16 rows of interleaved pairs); tmm4 and tmm5: `rows x 16` float32 products.
fn config_for_rows(rows: usize) -> TileConfig {
    let r = rows as u8;
    TileConfig::new(&[r, r, r, 16, r, r])
}

impl Kernel<'_> {
    /// Feature tiles `first..last`, every row.
    ///
    /// # Safety
    /// AMX must be [`available`]; no other thread may access those columns of `out` meanwhile.
    unsafe fn run_tiles(&self, first: usize, last: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let AmxShape { m, k, .. } = self.shape;
            let tile_len = k / BLOCK * CHUNK; // u16 of one feature tile, Bf16 layout
            let per_pass = (PASS_BYTES / (tile_len * 2)).max(1);
            let mut configured_rows = 0;
            UNPACKED.with_borrow_mut(|unpacked| {
                let mut pass = first;
                while pass < last {
                    let pass_end = (pass + per_pass).min(last);
                    let direct = self.tiles.format == AmxFormat::Nibbles && m <= DIRECT_MAX_ROWS;
                    let chunks: &[u16] = match self.tiles.format {
                        AmxFormat::Bf16 => &self.tiles.data[pass * tile_len..pass_end * tile_len],
                        // few rows: each chunk is unpacked just before each use
                        AmxFormat::Nibbles if direct => {
                            let nibble_len = k / BLOCK * NIBBLE_CHUNK;
                            &self.tiles.data[pass * nibble_len..pass_end * nibble_len]
                        }
                        AmxFormat::Nibbles => {
                            let len = (pass_end - pass) * tile_len;
                            if unpacked.len() < len + 32 {
                                unpacked.resize(len + 32, 0);
                            }
                            let dst = aligned_64(unpacked, len);
                            let nibble_len = k / BLOCK * NIBBLE_CHUNK;
                            let src = &self.tiles.data[pass * nibble_len..pass_end * nibble_len];
                            for (from, to) in src
                                .chunks_exact(NIBBLE_CHUNK)
                                .zip(dst.chunks_exact_mut(CHUNK))
                            {
                                // SAFETY: AMX available implies AVX-512F and -BW.
                                unsafe { unpack_nibbles(from, to) };
                            }
                            dst
                        }
                    };
                    for row0 in (0..m).step_by(TILE_ROWS) {
                        let rows = (m - row0).min(TILE_ROWS);
                        if rows != configured_rows {
                            // SAFETY: AMX available (the caller's contract).
                            unsafe { config_for_rows(rows).load() };
                            configured_rows = rows;
                        }
                        let stride = if direct {
                            k / BLOCK * NIBBLE_CHUNK
                        } else {
                            tile_len
                        };
                        for (i, tile) in chunks.chunks_exact(stride).enumerate() {
                            // SAFETY: AMX available and configured for `rows`; the caller owns
                            // the columns of feature tile pass + i.
                            unsafe {
                                if direct {
                                    self.tile::<true>(tile, pass + i, row0, rows)
                                } else {
                                    self.tile::<false>(tile, pass + i, row0, rows)
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

    /// Rows `row0..row0 + rows` of feature tile `t`, whose chunks are `chunks` (`rows` in
    /// 1..=16): in the `Bf16` layout, or (`NIBBLES`) in the `Nibbles` one, each unpacked just
    /// before its tile load.
    ///
    /// # Safety
    /// As [`Kernel::run_tiles`], with the tiles configured for `rows`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tile<const NIBBLES: bool>(&self, chunks: &[u16], t: usize, row0: usize, rows: usize) {
        macro_rules! dispatch {
            ($($r:literal)*) => {
                match rows {
                    // SAFETY: the caller's contract, with R == rows.
                    $($r => unsafe { self.tile_rows::<$r, NIBBLES>(chunks, t, row0) },)*
                    _ => unreachable!("a row tile has 1..=16 rows"),
                }
            };
        }
        dispatch!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    }

    /// [`Kernel::tile`] for `R` rows: the `R x 16` accumulators stay in registers. Blocks
    /// alternate between two product tiles (tmm4 / tmm5) and two buffers (and two unpacked
    /// chunks), so the tile unit computes block `b + 1` while the vector units scale block `b`'s
    /// products.
    ///
    /// # Safety
    /// As [`Kernel::tile`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_rows<const R: usize, const NIBBLES: bool>(
        &self,
        chunks: &[u16],
        t: usize,
        row0: usize,
    ) {
        use std::arch::x86_64::*;
        let AmxShape { m, n, k } = self.shape;
        let nb = k / BLOCK;
        let mut acc = [_mm512_setzero_ps(); R];
        #[repr(align(64))]
        struct Products([[f32; TILE_ROWS * TILE_FEATURES]; 2]);
        let mut products = Products([[0.0; TILE_ROWS * TILE_FEATURES]; 2]);
        #[repr(align(64))]
        struct Unpacked([[u16; BLOCK * TILE_FEATURES]; 2]);
        let mut unpacked = Unpacked([[0; BLOCK * TILE_FEATURES]; 2]);
        let chunk_len = if NIBBLES { NIBBLE_CHUNK } else { CHUNK };
        let row_bytes = k * 2;
        let part = |p: usize, b: usize| self.parts[(p * m + row0) * k + b * BLOCK..].as_ptr();
        let sums = &self.sums[row0 * nb..(row0 + R) * nb];
        for (b, chunk) in chunks.chunks_exact(chunk_len).enumerate() {
            let buffer = products.0[b % 2].as_mut_ptr();
            let ints = if NIBBLES {
                let dst = unpacked.0[b % 2].as_mut_ptr();
                // SAFETY: the chunk holds 128 u16 of nibbles, dst 512 u16; AMX available
                // implies AVX-512F and -BW.
                unsafe { unpack_ints(chunk.as_ptr(), dst) };
                dst.cast_const()
            } else {
                chunk.as_ptr()
            };
            let (x0, x1, x2) = (part(0, b), part(1, b), part(2, b));
            // SAFETY: every tile load reads R rows of 64 bytes: the parts' rows row0..row0+R
            // at inputs 32b..32b+32 (inside [3, M, K]), and the chunk's first 1024 bytes; the
            // store writes R rows of the buffer.
            unsafe {
                if b % 2 == 0 {
                    amx::block_products_tmm4(x0, x1, x2, row_bytes, ints, buffer);
                } else {
                    amx::block_products_tmm5(x0, x1, x2, row_bytes, ints, buffer);
                }
            }
            let params = chunk[chunk_len - PARAMS..].as_ptr().cast::<f32>();
            let scale = _mm512_loadu_ps(params);
            let min = _mm512_loadu_ps(params.add(TILE_FEATURES));
            for (r, acc) in acc.iter_mut().enumerate() {
                let s = _mm512_load_ps(buffer.add(r * TILE_FEATURES));
                *acc = _mm512_fmadd_ps(s, scale, *acc);
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * nb + b]), min, *acc);
            }
        }
        let col0 = t * TILE_FEATURES;
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
/// `Bf16` layout's 512 bfloat16 integers at `dst`: each group of 32 bytes becomes two rows.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW; `src` readable for 128 u16, `dst` writable for 512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_ints(src: *const u16, dst: *mut u16) {
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
}

/// One chunk of nibbles (`NIBBLE_CHUNK` u16) unpacked into the `Bf16` layout (`CHUNK` u16),
/// parameters copied.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW.
#[cfg(target_arch = "x86_64")]
unsafe fn unpack_nibbles(src: &[u16], dst: &mut [u16]) {
    assert!(src.len() == NIBBLE_CHUNK && dst.len() == CHUNK);
    // SAFETY: lengths asserted; the caller's CPU features.
    unsafe { unpack_ints(src.as_ptr(), dst.as_mut_ptr()) };
    dst[BLOCK * TILE_FEATURES..].copy_from_slice(&src[BLOCK * TILE_FEATURES / 4..]);
}

/// The AMX instructions, as inline assembly (Rust's AMX intrinsics are not stable).
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;

    /// `products = x0 @ B + x1 @ B + x2 @ B` for one block, computed in tile register
    /// `$c`: tmm0-2 loaded from the three parts (rows `row_bytes` apart), tmm3 from the chunk's
    /// interleaved integers, the products stored 64 bytes per row.
    macro_rules! block_products {
        ($name:ident, $c:literal) => {
            /// # Safety
            /// Tiles configured (`config_for_rows`); the loads and the store stay inside their
            /// arrays for the configured rows.
            #[inline(always)]
            pub(super) unsafe fn $name(
                x0: *const u16,
                x1: *const u16,
                x2: *const u16,
                row_bytes: usize,
                ints: *const u16,
                products: *mut f32,
            ) {
                unsafe {
                    asm!(
                        concat!("tilezero ", $c),
                        "tileloadd tmm3, [{w} + {s64}*1]",
                        "tileloadd tmm0, [{x0} + {s}*1]",
                        concat!("tdpbf16ps ", $c, ", tmm0, tmm3"),
                        "tileloadd tmm1, [{x1} + {s}*1]",
                        concat!("tdpbf16ps ", $c, ", tmm1, tmm3"),
                        "tileloadd tmm2, [{x2} + {s}*1]",
                        concat!("tdpbf16ps ", $c, ", tmm2, tmm3"),
                        concat!("tilestored [{p} + {s64}*1], ", $c),
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
        };
    }
    block_products!(block_products_tmm4, "tmm4");
    block_products!(block_products_tmm5, "tmm5");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_quant_linear::tests::{dequantized, random_blocks};
    use crate::test_rng::Lcg;

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

    #[test]
    fn q4_1_packs_a_u16_at_a_time_as_value_by_value() {
        for (n, k, seed) in [(20, 96, 11), (16, 32, 12), (37, 256, 13), (1, 64, 14)] {
            let mut rng = Lcg(seed);
            let b = random_blocks(&mut rng, n, k);
            let w = QuantWeight::Q4_1 {
                scale: &b.scale,
                min: &b.min,
                qs: &b.q4,
            };
            let len = packed_len(&w, n, k).unwrap();
            let (mut fast, mut slow) = (vec![0u16; len], vec![0u16; len]);
            pack_into(&w, n, k, &mut fast).unwrap();
            pack_elementwise(&w, n, k, &mut slow);
            assert_eq!(fast, slow, "n {n}, k {k}");
        }
    }

    #[test]
    fn pack_interleaves_pairs_and_pads() {
        let (n, k) = (20, 64);
        let mut rng = Lcg(3);
        let b = random_blocks(&mut rng, n, k);
        let w = QuantWeight::Q8_0 {
            scale: &b.scale,
            qs: &b.q8,
        };
        let tiles = pack(&w, n, k).unwrap();
        assert_eq!(AmxFormat::of(&w), Some(AmxFormat::Bf16));
        assert_eq!(tiles.len(), 2 * 2 * CHUNK);
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
        let bf16 = vec![0u16; AmxShape { m, n, k }.tiles_len(AmxFormat::Bf16)];
        let as_nibbles = AmxTiles {
            format: AmxFormat::Nibbles,
            data: &bf16,
        };
        let shape = AmxShape { m, n, k };
        assert!(linear_amx_f32(&shape, &x, as_nibbles, &[], &mut out, 2).is_err());
        assert!(out.iter().all(|&v| v == 7.0));
    }
}
