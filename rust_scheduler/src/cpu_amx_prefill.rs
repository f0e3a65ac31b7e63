//! Paged prefill attention through Intel AMX tiles (`TDPBF16PS`), at float32 accuracy: the path
//! `cpu_prefill_attention` takes where `Isa::detect` gives `Isa::Amx` and the head dim is a
//! multiple of 64. Same inputs, outputs and causal rule as the vector paths (that module's
//! header); only how the two products are computed differs.
//!
//! Why float32 accuracy: every float32 is the exact sum of three bfloat16 parts
//! (`cpu_amx_tiles::split3`: top, middle and low 8 significant bits). A dot product
//! `sum_i a_i b_i` is then the sum of the nine part products `a_p b_q`, each exact in float32
//! (8 x 8 significant bits). The three with `p + q >= 3` (middle x low, low x middle, low x low)
//! are below 2^-23 of `|a_i b_i|`, float32's own rounding, and are left out: a score, or a
//! weighted sum of V, is 6 tile products summed in float32. Both products work this way: the
//! scores (the scaled query rows split per tile of rows, the keys split once per call) and the
//! weighted sums of V (the softmax weights split per panel, the values split once per call).
//! `TDPBF16PS` treats subnormal parts as zero: parts below 2^-126, far below any sum they enter.
//!
//! Everything is computed transposed, one column per query row, so that the online softmax
//! runs across the 16 rows of a tile in one vector (no horizontal reductions, one vector `exp`
//! for the 16 rescale factors): scores `S^T = K . Q^T` (tiles of 16 keys x 16 rows), weights
//! `P^T`, and `O^T += V^T . P^T` (16 dims x 16 rows).
//!
//! Split keys and values (job 1, [`pack_panel`]): per (sequence, KV head), per panel of
//! [`KEYS`] = 32 keys (keys past the sequence's last are zero), [`panel_len`] `u16`:
//! - `K[part][key][dim]` (`3 x 32 x D`): the keys' parts as rows, the A operand of the scores
//!   (16 keys x 32 dims a tile, rows `2D` bytes apart);
//! - `V^T[part][dim][key]` (`3 x D x 32`): the values' parts transposed, the A operand of
//!   `V^T . P^T` (16 dims x 32 keys a tile, 64 bytes a row).
//!
//! Items (job 2): (sequence, KV head, up to [`CHUNK_TOKENS`] query tokens), heaviest first; an
//! item's `tokens x G` rows (`G = Hq / Hkv`, row `i` = token `i / G`, head `i % G`) form tiles of
//! 16 rows (the last padded with zero queries, never written out), each with its queries split
//! into pair-interleaved B operands (`[part][dims / 2][16 rows][2]`). The item walks its
//! panels once; every row tile that sees a panel takes it while it is in L1 (a step). A step:
//! the scores into tmm0 / tmm1 (keys 0-15 / 16-31), stored; the online softmax on the vector
//! units, a lane per row (running max and denominator, keys past a row's last weigh exactly
//! 0); the weights split and pair-interleaved into B operands; `V^T . P^T` into tmm4-7 (64 dims
//! at a time), stored and merged into the row tile's float32 accumulators
//! (`acc = rescale * acc + V^T . P^T`, one vector per dim). Steps are pipelined three deep (see
//! `ItemView::run`). A task loads one configuration (8 tiles of 16 x 64 bytes) and releases the
//! tiles when its job is done.
//!
//! Measured on a 2-core Xeon (SmolLM2's shapes): the tile unit and the vector units do not
//! overlap here, so a step costs its ~270 ns of tile products plus ~200 ns of softmax and
//! merge; 1.8x the AVX-512 kernel on 512-token chunks over 2k keys, 1.25-1.4x on 256-512
//! fresh tokens, a loss on short chunks (the split keys cost more than they save), which
//! therefore stay on the vector path (`cpu_prefill_attention::amx_pays`).
//!
//! Invariants: the caller has validated shapes, rows and block ids (`PrefillShape::validate`)
//! and calls this only with `D % 64 == 0` on a CPU where AMX is permitted; every tile load reads
//! inside a buffer sized here for it; items write disjoint rows of `out`, and job 1's units
//! disjoint panels.

use crate::cpu_amx_tiles::{
    aligned_64, release, split3_16, split3_bits, tile_dp, tile_load, tile_store, tile_zero, Shared,
    TileConfig,
};
use crate::cpu_exp::avx512::exp16;
use crate::cpu_kv::KvElement;
use crate::cpu_linear::OutPtr;
use crate::cpu_prefill_attention::{on_tasks, work_items, Item, PrefillShape, SeqQuery};
use std::arch::x86_64::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Keys per panel (two score tiles of 16).
pub const KEYS: usize = 32;
/// Rows per tile.
const ROWS: usize = 16;
/// `u16` per tile (16 rows of 64 bytes).
const TILE: usize = 512;
/// Query tokens per item: enough rows that a panel read from memory serves many tiles (halved
/// when that would leave fewer than 4 items per thread).
const CHUNK_TOKENS: usize = 64;
/// Panels per unit of job 1.
const PACK_PANELS: usize = 8;

/// `u16` of one panel's split keys and values.
fn panel_len(d: usize) -> usize {
    6 * d / 16 * TILE
}

/// Runs prefill attention (see the module header) for the validated `seqs`; `key_rows[s][t]`
/// is key `t` of sequence `s`'s element offset in the caches (KV head 0).
///
/// # Safety
/// `Isa::detect` returned `Isa::Amx`; `shape.head_dim % 64 == 0`; the inputs passed
/// `PrefillShape::validate`, which returned `seqs`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run<E: KvElement>(
    shape: &PrefillShape,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    seqs: &[SeqQuery],
    key_rows: &[Vec<usize>],
    out: &mut [f32],
    scale: f32,
    num_threads: usize,
) {
    let (d, hkv) = (shape.head_dim, shape.num_kv_heads);
    let dr = d + E::ROW_EXTRA;
    assert!(d > 0 && d.is_multiple_of(64) && out.len() == q.len());
    let threads = num_threads.max(1);
    let items_of = |chunk: usize| {
        seqs.iter()
            .map(|sq| sq.q_len.div_ceil(chunk) * hkv)
            .sum::<usize>()
    };
    let chunk = if items_of(CHUNK_TOKENS) >= 4 * threads {
        CHUNK_TOKENS
    } else {
        CHUNK_TOKENS / 2
    };
    let items = work_items(seqs, hkv, chunk);
    if items.is_empty() {
        return;
    }
    let plen = panel_len(d);
    let panels_of = |sq: &SeqQuery| sq.seq_len.div_ceil(KEYS);
    let mut base = Vec::with_capacity(seqs.len()); // each sequence's first panel
    let mut total = 0;
    for sq in seqs {
        base.push(total);
        total += hkv * panels_of(sq);
    }
    let mut storage = vec![0u16; total * plen + 32];
    let panels = aligned_64(&mut storage, total * plen);
    let mut units = Vec::new(); // job 1: (sequence, KV head, panels)
    for (seq, sq) in seqs.iter().enumerate() {
        for kv_head in 0..hkv {
            for lo in (0..panels_of(sq)).step_by(PACK_PANELS) {
                units.push((seq, kv_head, lo..(lo + PACK_PANELS).min(panels_of(sq))));
            }
        }
    }
    // Job 1: the keys and values of every (sequence, KV head) split into their panels.
    let next = AtomicUsize::new(0);
    let dst = Shared(panels.as_mut_ptr());
    on_tasks(threads.min(units.len()), &|_| {
        let mut rows = vec![0f32; 2 * KEYS * d];
        let mut parts = vec![0u16; 3 * KEYS * d];
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some((seq, kv_head, range)) = units.get(i) else {
                break;
            };
            for p in range.clone() {
                let at = (base[*seq] + kv_head * panels_of(&seqs[*seq]) + p) * plen;
                let keys = &key_rows[*seq][p * KEYS..key_rows[*seq].len().min((p + 1) * KEYS)];
                let (k_rows, v_rows) = rows.split_at_mut(KEYS * d);
                for (t, &row) in keys.iter().enumerate() {
                    // a head row: its values, then (a scaled cache) its scale, `cpu_kv`
                    let src = row + kv_head * dr;
                    E::head_row_to_f32(&k_cache[src..src + dr], &mut k_rows[t * d..(t + 1) * d]);
                    E::head_row_to_f32(&v_cache[src..src + dr], &mut v_rows[t * d..(t + 1) * d]);
                }
                k_rows[keys.len() * d..].fill(0.0);
                v_rows[keys.len() * d..].fill(0.0);
                // SAFETY: panel `at / plen` is inside `panels` (sized above) and belongs to
                // this unit alone; AVX-512F comes with AMX (the caller's contract).
                unsafe {
                    let panel = std::slice::from_raw_parts_mut(dst.get().add(at), plen);
                    pack_panel(&rows, d, &mut parts, panel)
                };
            }
        }
    });
    // Job 2: the items.
    let panels: &[u16] = panels;
    let next = AtomicUsize::new(0);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let group = shape.num_heads / hkv;
    on_tasks(threads.min(items.len()), &|_| {
        let max_tiles = (chunk * group).div_ceil(ROWS);
        let mut scratch = Scratch::new(max_tiles, d);
        // SAFETY: AMX permitted (the caller's contract).
        unsafe { TileConfig::new(&[16; 8]).load() };
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&Item {
                seq,
                kv_head,
                ref tokens,
            }) = items.get(i)
            else {
                break;
            };
            let sq = seqs[seq];
            let first = (base[seq] + kv_head * panels_of(&sq)) * plen;
            let item = ItemView {
                shape,
                q,
                sq,
                kv_head,
                tokens: tokens.clone(),
                panels: &panels[first..first + panels_of(&sq) * plen],
                scale,
                out: out_ptr,
            };
            // SAFETY: tiles configured above; the item's rows of `out` are its own.
            unsafe { item.run(&mut scratch) };
        }
        // SAFETY: AMX permitted.
        unsafe { release() };
    });
}

/// Splits 32 keys' and values' float32 rows (`rows`: `[K or V][KEYS][D]`) into one panel (the
/// module header's layout), the values through `parts` (`[part][KEYS][D]` bfloat16).
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn pack_panel(rows: &[f32], d: usize, parts: &mut [u16], panel: &mut [u16]) {
    assert!(d.is_multiple_of(64) && rows.len() == 2 * KEYS * d);
    assert!(parts.len() == 3 * KEYS * d && panel.len() == panel_len(d));
    let (keys, values) = rows.split_at(KEYS * d);
    let (k_parts, vt_parts) = panel.split_at_mut(3 * KEYS * d);
    for (src, dst) in [(keys, &mut *k_parts), (values, &mut *parts)] {
        for (i, chunk) in src.chunks_exact(16).enumerate() {
            // SAFETY: 16 floats; each store writes 16 u16 of `dst` (`[3][KEYS][D]`).
            unsafe {
                let split = split3_16(_mm512_loadu_ps(chunk.as_ptr()));
                for (part, bits) in split.into_iter().enumerate() {
                    let at = part * KEYS * d + 16 * i;
                    _mm256_storeu_si256(dst.as_mut_ptr().add(at).cast(), bits);
                }
            }
        }
    }
    for part in 0..3 {
        let v = &parts[part * KEYS * d..][..KEYS * d];
        let vt = &mut vt_parts[part * d * KEYS..][..d * KEYS];
        for (key, row) in v.chunks_exact(d).enumerate() {
            for (dim, &x) in row.iter().enumerate() {
                vt[dim * KEYS + key] = x;
            }
        }
    }
}

/// A task's buffers, reused across its items: per row tile the queries' B operands
/// (`[3][D / 2][16][2]` bfloat16) and the float32 accumulators `O^T` (`[D][16]`); two of each
/// per-panel buffer (one row tile's while the next one's is being filled): the stored scores
/// (`[32][16]` float32), the weights' B operands (`[3][16][16][2]` bfloat16)
/// and `V^T . P^T` (`[D][16]`); one tile's scaled queries as rows (`[16][D]`).
struct Scratch {
    queries: Vec<u16>,
    acc: Vec<f32>,
    scores: Vec<f32>,
    weights: Vec<u16>,
    pv: Vec<f32>,
    rows: Vec<f32>,
}

impl Scratch {
    fn new(max_tiles: usize, d: usize) -> Scratch {
        Scratch {
            queries: vec![0; max_tiles * 3 * ROWS * d + 32],
            acc: vec![0.0; max_tiles * ROWS * d + 16],
            scores: vec![0.0; 2 * SCORES + 16],
            weights: vec![0; 2 * WEIGHTS + 32],
            pv: vec![0.0; 2 * ROWS * d + 16],
            rows: vec![0.0; ROWS * d],
        }
    }
}

/// `f32` of one tile's stored scores (32 keys x 16 rows).
const SCORES: usize = KEYS * ROWS;
/// `u16` of one tile's weights (three parts of 16 x 32).
const WEIGHTS: usize = 3 * ROWS * KEYS;

/// The 64-byte aligned `len` floats of `v` (at least `len + 16` long).
fn aligned_f32(v: &mut [f32], len: usize) -> &mut [f32] {
    let skip = v.as_ptr().align_offset(64).min(16);
    &mut v[skip..skip + len]
}

/// One item and what it reads.
struct ItemView<'a> {
    shape: &'a PrefillShape,
    q: &'a [f32],
    sq: SeqQuery,
    kv_head: usize,
    tokens: std::ops::Range<usize>,
    /// this (sequence, KV head)'s panels
    panels: &'a [u16],
    scale: f32,
    out: OutPtr,
}

/// One row tile's softmax state, a lane per row.
struct TileState {
    /// last key each row sees (padding rows: the last real row's)
    key_max: __m512i,
    running_max: __m512,
    denom: __m512,
}

impl ItemView<'_> {
    /// (token of the sequence, query head) of the item's row `i`.
    fn row(&self, i: usize) -> (usize, usize) {
        let group = self.shape.num_heads / self.shape.num_kv_heads;
        (
            self.tokens.start + i / group,
            self.kv_head * group + i % group,
        )
    }

    /// Element offset in `q` / `out` of the item's row `i`.
    fn offset(&self, i: usize) -> usize {
        let (token, head) = self.row(i);
        ((self.sq.q_start + token) * self.shape.num_heads + head) * self.shape.head_dim
    }

    /// Computes the item (module header). Within a panel the row tiles are pipelined: the
    /// tile unit computes the next tile's scores while the vector units run this tile's
    /// softmax, and this tile's `V^T . P^T` while they merge the previous one's.
    ///
    /// # Safety
    /// Tiles configured as in [`run`]; no other thread writes the item's rows of `out`.
    #[target_feature(enable = "avx512f")]
    unsafe fn run(&self, scratch: &mut Scratch) {
        let d = self.shape.head_dim;
        let num_rows = self.tokens.len() * self.shape.num_heads / self.shape.num_kv_heads;
        let num_tiles = num_rows.div_ceil(ROWS);
        let first_key_max = self.sq.seq_len - self.sq.q_len;
        let queries = aligned_64(&mut scratch.queries, num_tiles * 3 * ROWS * d);
        let mut states = Vec::with_capacity(num_tiles);
        for tile in 0..num_tiles {
            // row r of the tile is the item's row min(16 tile + r, last): padding rows repeat
            // the last row's keys, with zero queries
            let rows: [usize; ROWS] = std::array::from_fn(|r| (tile * ROWS + r).min(num_rows - 1));
            let real = (num_rows - tile * ROWS).min(ROWS);
            for (r, &i) in rows.iter().enumerate() {
                let dst = &mut scratch.rows[r * d..][..d];
                if r < real {
                    let src = &self.q[self.offset(i)..][..d];
                    dst.iter_mut()
                        .zip(src)
                        .for_each(|(o, &x)| *o = x * self.scale);
                } else {
                    dst.fill(0.0);
                }
            }
            let b = &mut queries[tile * 3 * ROWS * d..][..3 * ROWS * d];
            // SAFETY: `scratch.rows` holds [16][d] floats, `b` [3][d / 2][16] u32.
            unsafe { query_operands(&scratch.rows, d, b) };
            let key_max: [i32; ROWS] =
                std::array::from_fn(|r| (first_key_max + self.row(rows[r]).0) as i32);
            states.push(TileState {
                key_max: _mm512_loadu_si512(key_max.as_ptr().cast()),
                running_max: _mm512_set1_ps(f32::NEG_INFINITY),
                denom: _mm512_setzero_ps(),
            });
        }
        let acc = aligned_f32(&mut scratch.acc, num_tiles * ROWS * d);
        acc.fill(0.0);
        let scores = aligned_f32(&mut scratch.scores, 2 * SCORES);
        let weights = aligned_64(&mut scratch.weights, 2 * WEIGHTS);
        let pv = aligned_f32(&mut scratch.pv, 2 * ROWS * d);
        let plen = panel_len(d);
        let last_key = first_key_max + self.tokens.end - 1;
        let b_queries = |t: usize| &queries[t * 3 * ROWS * d..][..3 * ROWS * d];
        // The work, as (panel, row tile) steps in order: per panel, the tiles with a row that
        // sees its keys (a suffix of the tiles: keys grow with the rows).
        let mut steps = Vec::new();
        for panel in 0..(last_key + 1).div_ceil(KEYS) {
            let key0 = _mm512_set1_epi32((panel * KEYS) as i32);
            let first = states
                .iter()
                .position(|s| _mm512_cmpge_epi32_mask(s.key_max, key0) != 0)
                .unwrap_or(num_tiles);
            steps.extend((first..num_tiles).map(|tile| (panel, tile)));
        }
        let panel = |n: usize| &self.panels[steps[n].0 * plen..][..plen];
        let mut rescale = [_mm512_setzero_ps(); 3];
        // A three-stage pipeline over the steps, so that the tile unit and the vector units
        // work at once: at stage n the tile unit computes step n + 1's scores while the vector
        // units run step n's softmax, then step n - 1's `V^T . P^T` while they merge step
        // n - 2's. Step n's buffers are scores / weights / pv `n % 2` (the rescale factors
        // `n % 3`): no stage writes what an unfinished one reads.
        // SAFETY (the block): tiles configured (caller); every tile load reads 16 rows of 64
        // bytes inside `self.panels` / `queries` / `weights`, every tile store writes inside
        // `scores` / `pv`.
        unsafe {
            let n_steps = steps.len();
            if n_steps > 0 {
                tile_scores(panel(0), b_queries(steps[0].1), d);
                store_scores(&mut scores[..SCORES]);
            }
            for n in 0..n_steps + 2 {
                let next = n + 1 < n_steps;
                if next {
                    tile_scores(panel(n + 1), b_queries(steps[n + 1].1), d);
                }
                if n < n_steps {
                    let (p, tile) = steps[n];
                    rescale[n % 3] = softmax(
                        &scores[n % 2 * SCORES..][..SCORES],
                        p * KEYS,
                        &mut states[tile],
                        &mut weights[n % 2 * WEIGHTS..][..WEIGHTS],
                    );
                }
                if (2..=n_steps + 1).contains(&n) {
                    let tile = steps[n - 2].1;
                    merge(
                        &mut acc[tile * ROWS * d..][..ROWS * d],
                        rescale[(n - 2) % 3],
                        &pv[n % 2 * ROWS * d..][..ROWS * d],
                    );
                }
                if next {
                    store_scores(&mut scores[(n + 1) % 2 * SCORES..][..SCORES]);
                }
                if (1..=n_steps).contains(&n) {
                    let w = &weights[(n - 1) % 2 * WEIGHTS..][..WEIGHTS];
                    tile_values(
                        panel(n - 1),
                        w,
                        d,
                        &mut pv[(n - 1) % 2 * ROWS * d..][..ROWS * d],
                    );
                }
            }
        }
        for (tile, state) in states.iter().enumerate() {
            let inv = _mm512_div_ps(_mm512_set1_ps(1.0), state.denom);
            let real = (num_rows - tile * ROWS).min(ROWS);
            let offsets: [i32; ROWS] = std::array::from_fn(|r| {
                (self.offset((tile * ROWS + r).min(num_rows - 1)) as i64 - self.offset(0) as i64)
                    as i32
            });
            let offsets = _mm512_loadu_si512(offsets.as_ptr().cast());
            let mask: __mmask16 = if real == ROWS {
                0xFFFF
            } else {
                (1 << real) - 1
            };
            let base = self.out.0.add(self.offset(0));
            for dim in 0..d {
                // SAFETY: `acc` holds [tiles][D][16]; every unmasked lane writes element `dim`
                // of one of the item's rows of `out` (inside it: validated shapes), which this
                // item alone writes.
                unsafe {
                    let o = _mm512_mul_ps(
                        _mm512_load_ps(acc.as_ptr().add((tile * d + dim) * ROWS)),
                        inv,
                    );
                    _mm512_mask_i32scatter_ps::<4>(base.add(dim).cast(), mask, offsets, o);
                }
            }
        }
    }
}

/// `acc = rescale * acc + pv` for one row tile (`[D][16]` each, 64-byte aligned).
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn merge(acc: &mut [f32], rescale: __m512, pv: &[f32]) {
    assert!(acc.len() == pv.len() && acc.len().is_multiple_of(16));
    for (a, p) in acc.chunks_exact_mut(16).zip(pv.chunks_exact(16)) {
        // SAFETY: 16 aligned floats each (the caller's buffers are 64-byte aligned).
        unsafe {
            let merged = _mm512_fmadd_ps(
                _mm512_load_ps(a.as_ptr()),
                rescale,
                _mm512_load_ps(p.as_ptr()),
            );
            _mm512_store_ps(a.as_mut_ptr(), merged);
        }
    }
}

/// A row tile's scaled queries (`rows`, `[16][D]` float32) as the scores' B operands (`b`,
/// `[3][D / 2][16][2]` bfloat16: part `p`, row `k`, `u16` `2r + e` = part `p` of dim `2k + e`
/// of row `r`), a dim of all 16 rows at a time.
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn query_operands(rows: &[f32], d: usize, b: &mut [u16]) {
    assert!(rows.len() == ROWS * d && b.len() == 3 * ROWS * d && d.is_multiple_of(2));
    let index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(d as i32),
    );
    for k in 0..d / 2 {
        // SAFETY: dims 2k and 2k + 1 of the 16 rows (offsets 16 x d + dim < rows.len()).
        let (even, odd) = unsafe {
            let base = rows.as_ptr().add(2 * k);
            (
                _mm512_i32gather_ps::<4>(index, base.cast()),
                _mm512_i32gather_ps::<4>(index, base.add(1).cast()),
            )
        };
        let (even, odd) = (split3_bits(even), split3_bits(odd));
        for part in 0..3 {
            let pair = _mm512_or_si512(_mm512_srli_epi32::<16>(even[part]), odd[part]);
            // SAFETY: row k of part `part`: 16 u32 inside `b`.
            unsafe {
                _mm512_storeu_si512(
                    b.as_mut_ptr().add((part * d / 2 + k) * 2 * ROWS).cast(),
                    pair,
                )
            };
        }
    }
}

/// One row tile's scores against one panel, `S^T = K . Q^T`, left in tmm0 / tmm1 (keys 0-15
/// / 16-31; [`store_scores`] stores them); tmm4-6 the queries' three parts, tmm2 / tmm3 a part
/// of the keys.
///
/// # Safety
/// Tiles configured as in [`run`]; `tiles` one panel, `b_queries` a tile's query operands.
#[inline]
unsafe fn tile_scores(tiles: &[u16], b_queries: &[u16], d: usize) {
    debug_assert!(tiles.len() == panel_len(d) && b_queries.len() == 3 * ROWS * d);
    // part p of keys 16h..16h + 16, dims 32s..32s + 32 (rows 2d bytes apart)
    let k = |p: usize, h: usize, s: usize| tiles[(p * KEYS + 16 * h) * d + 32 * s..].as_ptr();
    // part p of the queries' dims 32s..32s + 32 (16 rows of 64 bytes)
    let q = |p: usize, s: usize| b_queries[(p * d / 2 + 16 * s) * 2 * ROWS..].as_ptr();
    let row_bytes = 2 * d;
    // Key part $i (tmm2: keys 0-15, tmm3: keys 16-31) against the query parts $q that pair
    // with it, all held in tmm4-6.
    macro_rules! key_part {
        ($i:expr, $s:expr, $($q:literal),+) => {
            tile_load!("tmm2", k($i, 0, $s), row_bytes);
            tile_load!("tmm3", k($i, 1, $s), row_bytes);
            $(
                tile_dp!("tmm0", "tmm2", $q);
                tile_dp!("tmm1", "tmm3", $q);
            )+
        };
    }
    // SAFETY: the caller's contract; every pointer starts 16 rows inside its buffer.
    unsafe {
        tile_zero!("tmm0");
        tile_zero!("tmm1");
        for s in 0..d / 32 {
            // the queries' three parts stay in tile registers while each part of the keys
            // meets the ones that pair with it (key part i with query parts 0..3 - i)
            tile_load!("tmm4", q(0, s), 64usize);
            tile_load!("tmm5", q(1, s), 64usize);
            tile_load!("tmm6", q(2, s), 64usize);
            key_part!(0, s, "tmm4", "tmm5", "tmm6");
            key_part!(1, s, "tmm4", "tmm5");
            key_part!(2, s, "tmm4");
        }
    }
}

/// Stores the scores [`tile_scores`] left in tmm0 / tmm1 into `scores` (`[32 keys][16 rows]`
/// float32, 64-byte aligned).
///
/// # Safety
/// Tiles configured as in [`run`].
#[inline]
unsafe fn store_scores(scores: &mut [f32]) {
    assert!(scores.len() == SCORES);
    // SAFETY: 16 rows of 64 bytes each, inside `scores`.
    unsafe {
        tile_store!("tmm0", scores.as_mut_ptr(), 64usize);
        tile_store!("tmm1", scores.as_mut_ptr().add(16 * ROWS), 64usize);
    }
}

/// `V^T . P^T` of one panel's values and a row tile's weights (`[3][16][16][2]` bfloat16) into
/// `pv` (`[D][16]` float32), 64 dims at a time in tmm4-7; tmm0-2 the weights' three parts, tmm3
/// a part of 16 dims of the values.
///
/// # Safety
/// As [`tile_scores`]; `weights` 64-byte aligned, `pv` 64-byte aligned `[D][16]`.
#[inline]
unsafe fn tile_values(tiles: &[u16], weights: &[u16], d: usize, pv: &mut [f32]) {
    debug_assert!(weights.len() == 3 * ROWS * KEYS && pv.len() == ROWS * d);
    // part p of V^T's dims 16t..16t + 16 (16 rows of 64 bytes)
    let v = |p: usize, t: usize| tiles[3 * KEYS * d + (p * d + 16 * t) * KEYS..].as_ptr();
    // Into output tile $c: each part of V^T (tmm3) meets the weights' parts that pair with it
    // (V part i with weight parts 0..3 - i, held in tmm0-2).
    macro_rules! dims {
        ($c:literal, $t:expr) => {
            tile_load!("tmm3", v(0, $t), 64usize);
            tile_dp!($c, "tmm3", "tmm0");
            tile_dp!($c, "tmm3", "tmm1");
            tile_dp!($c, "tmm3", "tmm2");
            tile_load!("tmm3", v(1, $t), 64usize);
            tile_dp!($c, "tmm3", "tmm0");
            tile_dp!($c, "tmm3", "tmm1");
            tile_load!("tmm3", v(2, $t), 64usize);
            tile_dp!($c, "tmm3", "tmm0");
        };
    }
    // SAFETY: the caller's contract.
    unsafe {
        tile_load!("tmm0", weights.as_ptr(), 64usize);
        tile_load!("tmm1", weights[ROWS * KEYS..].as_ptr(), 64usize);
        tile_load!("tmm2", weights[2 * ROWS * KEYS..].as_ptr(), 64usize);
        for t in (0..d / 16).step_by(4) {
            tile_zero!("tmm4");
            tile_zero!("tmm5");
            tile_zero!("tmm6");
            tile_zero!("tmm7");
            dims!("tmm4", t);
            dims!("tmm5", t + 1);
            dims!("tmm6", t + 2);
            dims!("tmm7", t + 3);
            let at = pv.as_mut_ptr().add(16 * t * ROWS);
            tile_store!("tmm4", at, 64usize);
            tile_store!("tmm5", at.add(16 * ROWS), 64usize);
            tile_store!("tmm6", at.add(32 * ROWS), 64usize);
            tile_store!("tmm7", at.add(48 * ROWS), 64usize);
        }
    }
}

/// The online softmax of one row tile over one panel (keys `key0..key0 + 32`), a lane per row:
/// updates the running max and denominator, writes the weights (keys past a row's last weigh
/// 0) split into three parts and pair-interleaved as B operands (`weights`, `[3][16][16][2]`:
/// part `p`, row `k`, `u16` `2r + e` = weight of key `2k + e` for row `r`), and returns the
/// factors the rows' accumulators are multiplied by first.
///
/// # Safety
/// The CPU has AVX-512F; `scores` `[2][32][16]`, `weights` `[3][16][32]`.
#[target_feature(enable = "avx512f")]
unsafe fn softmax(
    scores: &[f32],
    key0: usize,
    state: &mut TileState,
    weights: &mut [u16],
) -> __m512 {
    assert!(scores.len() == SCORES && weights.len() == WEIGHTS);
    let mut s = [_mm512_setzero_ps(); KEYS];
    let mut seen = [0xFFFF as __mmask16; KEYS];
    let mut panel_max = _mm512_set1_ps(f32::NEG_INFINITY);
    // Whether every row sees all 32 keys (no masks needed), as in all but the last panels.
    let all_seen =
        _mm512_cmplt_epi32_mask(state.key_max, _mm512_set1_epi32((key0 + KEYS - 1) as i32)) == 0;
    for (k, (s, seen)) in s.iter_mut().zip(&mut seen).enumerate() {
        // SAFETY: key k's 16 rows.
        *s = unsafe { _mm512_loadu_ps(scores.as_ptr().add(k * ROWS)) };
        if all_seen {
            panel_max = _mm512_max_ps(panel_max, *s);
        } else {
            *seen = _mm512_cmpge_epi32_mask(state.key_max, _mm512_set1_epi32((key0 + k) as i32));
            panel_max = _mm512_mask_max_ps(panel_max, *seen, panel_max, *s);
        }
    }
    // Every row sees key 0 (panel 0), so the running max is finite after the first panel and
    // the rescale factor is e^(-inf) ~ 0 then, e^0 = 1 for rows that see none of a panel.
    let new_max = _mm512_max_ps(state.running_max, panel_max);
    let rescale = exp16(_mm512_sub_ps(state.running_max, new_max));
    state.running_max = new_max;
    let mut sum = _mm512_setzero_ps();
    let mut even = [_mm512_setzero_si512(); 3];
    for k in 0..KEYS {
        let p = _mm512_maskz_mov_ps(seen[k], exp16(_mm512_sub_ps(s[k], new_max)));
        sum = _mm512_add_ps(sum, p);
        let parts = split3_bits(p);
        if k % 2 == 0 {
            even = parts.map(|bits| _mm512_srli_epi32::<16>(bits));
        } else {
            for (part, (&e, &o)) in even.iter().zip(&parts).enumerate() {
                // SAFETY: row k / 2 of part `part`: 16 u32 inside `weights`.
                unsafe {
                    let at = (part * ROWS + k / 2) * KEYS;
                    _mm512_storeu_si512(weights.as_mut_ptr().add(at).cast(), _mm512_or_si512(e, o));
                }
            }
        }
    }
    state.denom = _mm512_fmadd_ps(state.denom, rescale, sum);
    rescale
}
