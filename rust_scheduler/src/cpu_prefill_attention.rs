//! Paged prefill attention on the CPU (float32 math over any `cpu_kv` cache type; a scaled
//! one's rows read with their scales, `dequantize_blocks` off the AMX path): each sequence's
//! chunk of query tokens attends, causally, to its whole context read in place through the
//! block table (earlier chunks and this step's own keys, which the caller has
//! written into the cache first).
//!
//! Layout (row-major, as the Python side's torch tensors): `q` / `out` `[T, Hq, D]` (the step's
//! flat rows), `k_cache` / `v_cache` `[num_blocks, block_size, Hkv, D + ROW_EXTRA]`; per sequence
//! `s` of the call: `q_starts[s]` (its first row of `q`), `q_lens[s]` (its query tokens),
//! `seq_lens[s]` (its keys once this step's are written) and row `s` of `block_tables` `[S,
//! max_blocks]`. Query
//! `j` (0-based) of sequence `s` attends keys `0 ..= seq_lens[s] - q_lens[s] + j`; with a
//! sliding `window` (Gemma 3's local layers), only the last `window` of those (its own
//! included). Rows of `out` that belong to no sequence of the call are left untouched.
//!
//! Invariants checked by `PrefillShape::validate` before any read or write, so no index below
//! leaves its slice and no two tasks write one element: `Hq % Hkv == 0`; slice lengths equal
//! their shapes; `1 <= q_lens[s] <= seq_lens[s] <= max_blocks * block_size`; the sequences'
//! rows lie in `0..T`, in ascending order, and do not overlap; every block id a sequence uses is
//! in `0..num_blocks`.
//!
//! Work, in two jobs on up to `num_threads` tasks of the kernels' pool, each pulling from an
//! atomic counter: (1) each (sequence, KV head)'s keys are copied once into panels of `KEYS`
//! keys laid out `[D][KEYS]` (key-minor, so a row's scores against a panel are vector FMAs
//! over the dimensions); (2) items (sequence, KV head, chunk of up to `CHUNK_TOKENS` query
//! tokens), heaviest first (causal chunks differ in cost), each writing the `out` rows of its
//! tokens for the `G = Hq / Hkv` query heads of its KV head, disjoint from every other item's.
//! An item walks tiles of `ROWS` (token, head) rows over the panels its tile sees (with a
//! window, from the panel of the tile's earliest first key): scores of the scaled queries, the
//! online softmax (running max and denominator, f32; keys outside a row's range weigh exactly
//! 0), then the weighted sum of the panel's V rows, read in place from
//! the cache (an f16 cache's converted to f32 as they are loaded), into the tile's accumulators
//! (rescaled when a row's max grows). An f16 cache's keys enter the panels as f32.
//!
//! Where the CPU has AMX (`Isa::detect` gives `Amx`), the head dim is a multiple of 64 and
//! enough queries share each key (`amx_pays`), the call goes to `cpu_amx_prefill` instead:
//! the same contract and validation, bfloat16 tile products at float32 accuracy (not for a
//! window that cuts a context: those calls stay on the vector path).

use crate::cpu_attention::CacheGeometry;
use crate::cpu_error::KernelInputError;
use crate::cpu_exp::exp;
use crate::cpu_isa::Isa;
use crate::cpu_kv::KvElement;
use crate::cpu_linear::OutPtr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Keys per panel (two AVX-512 vectors of scores per row).
const KEYS: usize = 32;
/// (token, head) query rows per tile.
const ROWS: usize = 8;
/// Query tokens per work item.
const CHUNK_TOKENS: usize = 16;

/// Shapes of one prefill-attention call.
#[derive(Clone, Copy, Debug)]
pub struct PrefillShape {
    /// rows of `q` / `out` (the step's tokens)
    pub num_tokens: usize,
    /// sequences of this call
    pub num_seqs: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
}

/// One sequence's query rows and context, as validated.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqQuery {
    pub(crate) q_start: usize,
    pub(crate) q_len: usize,
    pub(crate) seq_len: usize,
}

fn bad<T>(msg: String) -> Result<T, KernelInputError> {
    Err(KernelInputError(msg))
}

impl PrefillShape {
    /// Checks every invariant of the module header against the given buffers (`chunks`:
    /// `q_starts`, `q_lens`, `seq_lens`); returns the sequences' query ranges.
    pub(crate) fn validate<E: KvElement>(
        &self,
        q: &[f32],
        k_cache: &[E],
        v_cache: &[E],
        block_tables: &[i32],
        (q_starts, q_lens, seq_lens): (&[i32], &[i32], &[i32]),
        out: &[f32],
    ) -> Result<Vec<SeqQuery>, KernelInputError> {
        let s = *self;
        let geometry = CacheGeometry {
            num_heads: s.num_heads,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            num_blocks: s.num_blocks,
            block_size: s.block_size,
            max_blocks_per_seq: s.max_blocks_per_seq,
        };
        geometry.validate(k_cache, v_cache)?;
        let q_len = s.num_tokens * s.num_heads * s.head_dim;
        for (name, len, want) in [
            ("q", q.len(), q_len),
            ("out", out.len(), q_len),
            (
                "block_tables",
                block_tables.len(),
                s.num_seqs * s.max_blocks_per_seq,
            ),
            ("q_starts", q_starts.len(), s.num_seqs),
            ("q_lens", q_lens.len(), s.num_seqs),
            ("seq_lens", seq_lens.len(), s.num_seqs),
        ] {
            if len != want {
                return bad(format!("{name} has {len} elements, its shape needs {want}"));
            }
        }
        let max_ctx = s.max_blocks_per_seq * s.block_size;
        let mut rows_end = 0usize; // end of the previous sequence's rows
        let mut seqs = Vec::with_capacity(s.num_seqs);
        for seq in 0..s.num_seqs {
            let (start, len, ctx) = (q_starts[seq], q_lens[seq], seq_lens[seq]);
            if len < 1 || ctx < len || ctx as usize > max_ctx {
                return bad(format!(
                    "sequence {seq}: needs 1 <= q_lens ({len}) <= seq_lens ({ctx}) <= {max_ctx}"
                ));
            }
            if start < 0
                || (start as usize) < rows_end
                || start as usize + len as usize > s.num_tokens
            {
                return bad(format!(
                    "sequence {seq}: rows {start}..{} are not after the previous sequence's \
                     (which end at {rows_end}) and within 0..{}",
                    start as i64 + len as i64,
                    s.num_tokens
                ));
            }
            rows_end = start as usize + len as usize;
            geometry.check_blocks(block_tables, seq, ctx as usize)?;
            seqs.push(SeqQuery {
                q_start: start as usize,
                q_len: len as usize,
                seq_len: ctx as usize,
            });
        }
        Ok(seqs)
    }
}

/// Runs prefill attention on up to `num_threads` threads of the kernels' pool (`cpu_pool`);
/// see the module header for the layout. With `amx`, calls that `amx_pays` for take the AMX
/// path (`cpu_amx_prefill`) where the CPU has it. `window`: each query attends its last
/// `window` positions only (`Some(0)` is an error). Errors instead of reading or writing out
/// of bounds.
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_attention_f32<E: KvElement>(
    shape: &PrefillShape,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    q_starts: &[i32],
    q_lens: &[i32],
    seq_lens: &[i32],
    out: &mut [f32],
    scale: f32,
    num_threads: usize,
    amx: bool,
    window: Option<usize>,
) -> Result<(), KernelInputError> {
    let max_isa = if amx { Isa::Amx } else { Isa::Avx512 };
    run_windowed(
        shape,
        q,
        k_cache,
        v_cache,
        block_tables,
        (q_starts, q_lens, seq_lens),
        out,
        scale,
        num_threads,
        (max_isa, AMX_MIN_QUERIES),
        window,
    )
}

/// Whether the AMX path (`cpu_amx_prefill`) is worth its set-up for these sequences: it splits
/// every key and value of their contexts once per call, which pays off only when enough
/// queries use each key. The rule: at least [`AMX_MIN_QUERIES`] query tokens per key, averaged
/// over the call's keys (measured on SmolLM2's shapes, 2 threads: 64 queries over 256 keys
/// and 128 over 128 break even; 256 over 256 gain 1.25x, 512 over 512 1.4x, 512 over 2048
/// 1.8x; 16 over 1016 lose 1.2x).
fn amx_pays(seqs: &[SeqQuery], min_queries: usize) -> bool {
    let keys: usize = seqs.iter().map(|s| s.seq_len).sum();
    let weighted: usize = seqs.iter().map(|s| s.q_len * s.seq_len).sum();
    weighted >= min_queries * keys.max(1)
}

/// See [`amx_pays`].
const AMX_MIN_QUERIES: usize = 128;

/// Runs `job(task)` on `tasks` tasks of the kernels' pool (`cpu_pool`), or here when one task
/// (or the pool's one worker) is all there is.
pub(crate) fn on_tasks(tasks: usize, job: &(dyn Fn(usize) + Sync)) {
    let pool = (tasks > 1).then(|| crate::cpu_pool::global(tasks));
    match pool.map(|pool| (pool, tasks.min(pool.max_tasks()))) {
        Some((pool, tasks)) if tasks > 1 => pool.run(tasks, job),
        _ => job(0),
    }
}

/// One unit of work: query tokens `tokens` (of the sequence's `q_len`) of sequence `seq`, all
/// query heads of KV head `kv_head`.
#[derive(Clone, Debug)]
pub(crate) struct Item {
    pub(crate) seq: usize,
    pub(crate) kv_head: usize,
    pub(crate) tokens: std::ops::Range<usize>,
}

/// The call's items, chunks of up to `chunk` query tokens per (sequence, KV head), heaviest
/// first (keys read x tokens; causal chunks differ in cost), so the last items a thread pulls
/// are short ones.
pub(crate) fn work_items(seqs: &[SeqQuery], num_kv_heads: usize, chunk: usize) -> Vec<Item> {
    let mut items: Vec<(usize, Item)> = Vec::new(); // (keys the item reads, item)
    for (seq, sq) in seqs.iter().enumerate() {
        for lo in (0..sq.q_len).step_by(chunk) {
            let hi = (lo + chunk).min(sq.q_len);
            let keys = sq.seq_len - sq.q_len + hi;
            for kv_head in 0..num_kv_heads {
                let tokens = lo..hi;
                items.push((
                    keys,
                    Item {
                        seq,
                        kv_head,
                        tokens,
                    },
                ));
            }
        }
    }
    items.sort_by_key(|(keys, item)| (std::cmp::Reverse(*keys * item.tokens.len()), item.seq));
    items.into_iter().map(|(_, item)| item).collect()
}

/// The blocks `seqs` read from a scaled cache (`cpu_kv`; validated inputs), in order of first
/// use, as f32 caches of their values, with the shape and block tables that address them there
/// (the copy split over `num_threads` tasks of the pool). Prefill reads each key and value many
/// times over (once per query tile), so this copy costs little beside it, and the vector path
/// then runs unchanged; the AMX path converts each row it reads with its scale, and decode,
/// which reads each row once, applies the scales in place (`cpu_attention`).
fn dequantize_blocks<E: KvElement>(
    shape: &PrefillShape,
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    seqs: &[SeqQuery],
    num_threads: usize,
) -> (Vec<f32>, Vec<f32>, PrefillShape, Vec<i32>) {
    let (d, hkv, bs) = (shape.head_dim, shape.num_kv_heads, shape.block_size);
    let dr = d + E::ROW_EXTRA;
    let mut compact_id: std::collections::HashMap<i32, i32> = Default::default();
    let mut tables = vec![0i32; block_tables.len()];
    let mut used: Vec<usize> = Vec::new();
    for (seq, sq) in seqs.iter().enumerate() {
        let row = seq * shape.max_blocks_per_seq;
        for b in 0..sq.seq_len.div_ceil(bs) {
            let block = block_tables[row + b];
            tables[row + b] = *compact_id.entry(block).or_insert_with(|| {
                used.push(block as usize);
                used.len() as i32 - 1
            });
        }
    }
    // Blocks in runs of `per_task`; run `t` writes its own part of each output.
    let block_values = bs * hkv * d;
    let mut k_values = vec![0f32; used.len() * block_values];
    let mut v_values = vec![0f32; used.len() * block_values];
    let tasks = num_threads.clamp(1, used.len().max(1));
    let per_task = used.len().div_ceil(tasks).max(1);
    let parts: Vec<Mutex<(&mut [f32], &mut [f32])>> = k_values
        .chunks_mut(per_task * block_values)
        .zip(v_values.chunks_mut(per_task * block_values))
        .map(Mutex::new)
        .collect();
    let next = AtomicUsize::new(0); // the pool may run fewer tasks than asked: they pull runs
    on_tasks(parts.len(), &|_| loop {
        let t = next.fetch_add(1, Ordering::Relaxed);
        let Some(part) = parts.get(t) else { break };
        let mut part = part.lock().unwrap_or_else(|e| e.into_inner());
        let (k_out, v_out) = &mut *part;
        let blocks = &used[t * per_task..][..k_out.len() / block_values];
        for (cache, values) in [(k_cache, &mut **k_out), (v_cache, &mut **v_out)] {
            let rows = blocks.iter().flat_map(|&block| {
                cache[block * bs * hkv * dr..][..bs * hkv * dr].chunks_exact(dr)
            });
            for (src, dst) in rows.zip(values.chunks_exact_mut(d)) {
                E::head_row_to_f32(src, dst);
            }
        }
    });
    drop(parts);
    let compact = PrefillShape {
        num_blocks: used.len(),
        ..*shape
    };
    (k_values, v_values, compact, tables)
}

/// [`paged_prefill_attention_f32`] without a window, using at most instruction set `max_isa`,
/// and AMX only where [`amx_pays`] with `amx_min_queries` (tests compare every path, AMX forced
/// by 0).
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn run<E: KvElement>(
    shape: &PrefillShape,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    chunks: (&[i32], &[i32], &[i32]),
    out: &mut [f32],
    scale: f32,
    num_threads: usize,
    limits: (Isa, usize),
) -> Result<(), KernelInputError> {
    run_windowed(
        shape,
        q,
        k_cache,
        v_cache,
        block_tables,
        chunks,
        out,
        scale,
        num_threads,
        limits,
        None,
    )
}

/// [`paged_prefill_attention_f32`] using at most instruction set `max_isa`, and AMX only where
/// [`amx_pays`] with `amx_min_queries`, with a sliding `window` (module header).
#[allow(clippy::too_many_arguments)]
fn run_windowed<E: KvElement>(
    shape: &PrefillShape,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    (q_starts, q_lens, seq_lens): (&[i32], &[i32], &[i32]),
    out: &mut [f32],
    scale: f32,
    num_threads: usize,
    (max_isa, amx_min_queries): (Isa, usize),
    window: Option<usize>,
) -> Result<(), KernelInputError> {
    let chunks = (q_starts, q_lens, seq_lens);
    if window == Some(0) {
        return bad("a sliding window of 0 positions".into());
    }
    let seqs = shape.validate(q, k_cache, v_cache, block_tables, chunks, out)?;
    // a window no context outruns changes nothing
    let window = window.filter(|&w| seqs.iter().any(|sq| sq.seq_len > w));
    let (d, hkv, bs) = (shape.head_dim, shape.num_kv_heads, shape.block_size);
    let isa = Isa::detect(max_isa);
    let amx = isa == Isa::Amx
        && d.is_multiple_of(64)
        && window.is_none()
        && amx_pays(&seqs, amx_min_queries);
    if E::ROW_EXTRA > 0 && !amx {
        // A scaled cache off the AMX path (which converts every row it reads anyway): the
        // blocks this call reads, as the f32 values they hold.
        let (k_values, v_values, shape, tables) =
            dequantize_blocks(shape, k_cache, v_cache, block_tables, &seqs, num_threads);
        let limits = (max_isa, amx_min_queries);
        let (k, v) = (&k_values[..], &v_values[..]);
        return run_windowed(
            &shape,
            q,
            k,
            v,
            &tables,
            chunks,
            out,
            scale,
            num_threads,
            limits,
            window,
        );
    }
    // Each key's element offset in the caches (KV head 0; head rows of `d + ROW_EXTRA`).
    let row = hkv * (d + E::ROW_EXTRA);
    let key_rows: Vec<Vec<usize>> = seqs
        .iter()
        .enumerate()
        .map(|(seq, sq)| {
            let table = &block_tables[seq * shape.max_blocks_per_seq..];
            (0..sq.seq_len.div_ceil(bs))
                .flat_map(|b| {
                    let block = table[b] as usize;
                    (0..bs).map(move |off| (block * bs + off) * row)
                })
                .take(sq.seq_len)
                .collect()
        })
        .collect();
    #[cfg(target_arch = "x86_64")]
    if amx {
        // SAFETY: Isa::detect gave Amx, d % 64 == 0, and the inputs were validated into `seqs`.
        unsafe {
            crate::cpu_amx_prefill::run(
                shape,
                q,
                k_cache,
                v_cache,
                &seqs,
                &key_rows,
                out,
                scale,
                num_threads,
            )
        };
        return Ok(());
    }
    let items = work_items(&seqs, hkv, CHUNK_TOKENS);
    if items.is_empty() {
        return Ok(());
    }
    // Where each (sequence, KV head)'s panels start in `panels`.
    let mut panel_base = Vec::with_capacity(seqs.len());
    let mut panels_len = 0;
    for sq in &seqs {
        panel_base.push(panels_len);
        panels_len += hkv * sq.seq_len.div_ceil(KEYS) * d * KEYS;
    }
    let mut panels = vec![0f32; panels_len];
    let kernel = Kernel {
        shape: *shape,
        q,
        v_cache,
        seqs: &seqs,
        key_rows: &key_rows,
        panel_base: &panel_base,
        scale,
        window,
        // The SIMD paths take whole vectors of the head dimension.
        isa: if d.is_multiple_of(16) {
            isa
        } else {
            Isa::Portable
        },
        out: OutPtr(out.as_mut_ptr()),
    };
    let threads = num_threads.clamp(1, items.len());
    let run_job = |job: &(dyn Fn(usize) + Sync)| on_tasks(threads, job);
    // Job 1: every (sequence, KV head)'s keys into its panels.
    let next = AtomicUsize::new(0);
    let panels_out = &OutPtr(panels.as_mut_ptr()); // (a reference: closures capture it whole)
    run_job(&|_| {
        let mut key = vec![0f32; d];
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= seqs.len() * hkv {
                break;
            }
            let (seq, kv_head) = (i / hkv, i % hkv);
            let dst = panel_base[seq] + kv_head * seqs[seq].seq_len.div_ceil(KEYS) * d * KEYS;
            for (t, &row) in key_rows[seq].iter().enumerate() {
                E::row_to_f32(&k_cache[row + kv_head * d..][..d], &mut key);
                let at = dst + (t / KEYS) * d * KEYS + t % KEYS;
                for (dim, &k) in key.iter().enumerate() {
                    // SAFETY: inside `panels` (sized above), in this (sequence, KV head)'s
                    // panels, which only this iteration writes.
                    unsafe { *panels_out.0.add(at + dim * KEYS) = k };
                }
            }
        }
    });
    // Job 2: the items.
    let next = AtomicUsize::new(0);
    let panels = &panels;
    run_job(&|_| {
        let mut acc = vec![0f32; ROWS * d];
        let mut qs = vec![0f32; ROWS * d];
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            kernel.run_item(item, panels, &mut qs, &mut acc);
        }
    });
    Ok(())
}

struct Kernel<'a, E> {
    shape: PrefillShape,
    q: &'a [f32],
    v_cache: &'a [E],
    seqs: &'a [SeqQuery],
    key_rows: &'a [Vec<usize>],
    panel_base: &'a [usize],
    scale: f32,
    /// each query's last this-many positions only (None: all of them)
    window: Option<usize>,
    isa: Isa,
    out: OutPtr,
}

/// A tile's softmax state per row.
struct RowState {
    running_max: [f32; ROWS],
    denom: [f32; ROWS],
}

impl<E: KvElement> Kernel<'_, E> {
    /// Computes one item (module header) with the caller's `[ROWS][D]` buffers.
    fn run_item(&self, item: &Item, panels: &[f32], qs: &mut [f32], acc: &mut [f32]) {
        let sh = &self.shape;
        let d = sh.head_dim;
        let group = sh.num_heads / sh.num_kv_heads;
        let sq = self.seqs[item.seq];
        let first_key_max = sq.seq_len - sq.q_len; // query j sees keys 0..=first_key_max + j
        let key_rows = &self.key_rows[item.seq];
        let panel_len = d * KEYS;
        let my_panels = &panels
            [self.panel_base[item.seq] + item.kv_head * sq.seq_len.div_ceil(KEYS) * panel_len..];
        let head_offset = item.kv_head * d;
        let num_rows = item.tokens.len() * group;
        for tile_start in (0..num_rows).step_by(ROWS) {
            let tile_rows = (num_rows - tile_start).min(ROWS);
            // (token of the sequence, query head) of each row of the tile
            let row_of = |r: usize| {
                let i = tile_start + r;
                (
                    item.tokens.start + i / group,
                    item.kv_head * group + i % group,
                )
            };
            let mut key_max = [0usize; ROWS]; // last key each row sees (padding rows: the last's)
            let mut key_min = [0usize; ROWS]; // and its first (a window's start, else 0)
            for r in 0..ROWS {
                let (token, head) = row_of(r.min(tile_rows - 1));
                key_max[r] = first_key_max + token;
                key_min[r] = self
                    .window
                    .map_or(0, |w| (key_max[r] + 1).saturating_sub(w));
                let dst = &mut qs[r * d..][..d];
                if r < tile_rows {
                    let src = &self.q[((sq.q_start + token) * sh.num_heads + head) * d..][..d];
                    dst.iter_mut()
                        .zip(src)
                        .for_each(|(o, &x)| *o = x * self.scale);
                } else {
                    dst.fill(0.0);
                }
            }
            let tile_keys = key_max.iter().max().copied().unwrap_or(0) + 1;
            let mut state = RowState {
                running_max: [f32::NEG_INFINITY; ROWS],
                denom: [0.0; ROWS],
            };
            acc.fill(0.0);
            let first_panel = key_min.iter().min().copied().unwrap_or(0) / KEYS;
            for panel in first_panel..tile_keys.div_ceil(KEYS) {
                let key0 = panel * KEYS;
                let visible: [(usize, usize); ROWS] = std::array::from_fn(|r| {
                    let hi = (key_max[r] + 1).saturating_sub(key0).min(KEYS);
                    (key_min[r].saturating_sub(key0).min(hi), hi)
                });
                // keys past the sequence's last (zero-padded in the panel) read key 0's V row,
                // with weight 0
                let mut v_rows = [key_rows[0] + head_offset; KEYS];
                let in_panel = (sq.seq_len - key0).min(KEYS);
                for (v, &row) in v_rows.iter_mut().zip(&key_rows[key0..key0 + in_panel]) {
                    *v = row + head_offset;
                }
                let kt = &my_panels[panel * panel_len..][..panel_len];
                self.panel(qs, kt, &v_rows, &visible, &mut state, acc);
            }
            for r in 0..tile_rows {
                let (token, head) = row_of(r);
                let inv = 1.0 / state.denom[r];
                let dst = ((sq.q_start + token) * sh.num_heads + head) * d;
                for (i, &a) in acc[r * d..][..d].iter().enumerate() {
                    // SAFETY: `dst + i` is inside `out` (validated shapes) and in a row this
                    // item alone writes (module header: items own disjoint rows).
                    unsafe { *self.out.0.add(dst + i) = a * inv };
                }
            }
        }
    }

    /// One tile against one panel: scores, online softmax, `acc += P . V`.
    fn panel(
        &self,
        qs: &[f32],
        kt: &[f32],
        v_rows: &[usize; KEYS],
        visible: &[(usize, usize); ROWS],
        state: &mut RowState,
        acc: &mut [f32],
    ) {
        let d = self.shape.head_dim;
        #[cfg(target_arch = "x86_64")]
        match self.isa {
            // SAFETY: Isa::detect found the features (cpu_isa's invariant); d is a multiple of
            // 16 (run); qs / acc hold ROWS * d, kt d * KEYS, and every v_rows entry is a
            // validated key row of this KV head, so `row + d` is inside the cache.
            Isa::Avx512 | Isa::Amx => {
                return unsafe {
                    avx512::panel(qs, kt, self.v_cache, v_rows, d, visible, state, acc)
                }
            }
            Isa::Avx2 => {
                let mut p = [0f32; ROWS * KEYS];
                unsafe { avx2::scores(qs, kt, d, &mut p) };
                let rescale = softmax(&mut p, visible, state, |row, max| unsafe {
                    avx2::exp_shifted(row, max)
                });
                return unsafe { avx2::accumulate(&p, &rescale, self.v_cache, v_rows, d, acc) };
            }
            Isa::Portable => {}
        }
        let mut p = [0f32; ROWS * KEYS];
        for (r, row) in p.chunks_exact_mut(KEYS).enumerate() {
            for (dim, &x) in qs[r * d..][..d].iter().enumerate() {
                for (s, &k) in row.iter_mut().zip(&kt[dim * KEYS..][..KEYS]) {
                    *s += x * k;
                }
            }
        }
        let rescale = softmax(&mut p, visible, state, |row, max| {
            row.iter_mut().fold(0.0, |sum, x| {
                *x = exp(*x - max);
                sum + *x
            })
        });
        for (r, acc_row) in acc.chunks_exact_mut(d).enumerate() {
            acc_row.iter_mut().for_each(|a| *a *= rescale[r]);
        }
        for (k, &row) in v_rows.iter().enumerate() {
            let v = &self.v_cache[row..][..d];
            for (r, acc_row) in acc.chunks_exact_mut(d).enumerate() {
                let w = p[r * KEYS + k];
                acc_row
                    .iter_mut()
                    .zip(v)
                    .for_each(|(a, &x)| *a += w * x.to_f32());
            }
        }
    }
}

/// Turns a tile's scores into softmax weights in place (keys outside `visible[r]`, a range
/// `lo..hi` of the panel's, weigh 0),
/// updating each row's running max and denominator; returns the factor each row's accumulator
/// must be multiplied by first. `exp_shifted(row, max)` sets `row[k] = e^(row[k] - max)` and
/// returns their sum.
fn softmax(
    p: &mut [f32; ROWS * KEYS],
    visible: &[(usize, usize); ROWS],
    state: &mut RowState,
    exp_shifted: impl Fn(&mut [f32], f32) -> f32,
) -> [f32; ROWS] {
    let mut rescale = [1f32; ROWS];
    for (r, row) in p.chunks_exact_mut(KEYS).enumerate() {
        let (lo, hi) = visible[r];
        let (before, rest) = row.split_at_mut(lo);
        let (seen, hidden) = rest.split_at_mut(hi - lo);
        before.fill(0.0);
        hidden.fill(0.0);
        if seen.is_empty() {
            continue;
        }
        let panel_max = seen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let new_max = state.running_max[r].max(panel_max);
        rescale[r] = exp(state.running_max[r] - new_max);
        state.running_max[r] = new_max;
        state.denom[r] = state.denom[r] * rescale[r] + exp_shifted(seen, new_max);
    }
    rescale
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{RowState, KEYS, ROWS};
    use crate::cpu_exp::avx512::exp16;
    use crate::cpu_exp::exp;
    use crate::cpu_kv::KvElement;
    use std::arch::x86_64::*;

    /// [`super::Kernel::panel`] with AVX-512: the scores in 16 accumulators (8 rows x 2
    /// vectors), the softmax on whole vectors, then `acc` 32 dimensions of every row at a time.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn panel<E: KvElement>(
        qs: &[f32],
        kt: &[f32],
        v_cache: &[E],
        v_rows: &[usize; KEYS],
        d: usize,
        visible: &[(usize, usize); ROWS],
        state: &mut RowState,
        acc: &mut [f32],
    ) {
        debug_assert!(qs.len() >= ROWS * d && kt.len() >= d * KEYS && acc.len() >= ROWS * d);
        debug_assert!(v_rows.iter().all(|&r| r + d <= v_cache.len()));
        let (q, k) = (qs.as_ptr(), kt.as_ptr());
        let mut s = [[_mm512_setzero_ps(); 2]; ROWS];
        for dim in 0..d {
            let k0 = _mm512_loadu_ps(k.add(dim * KEYS));
            let k1 = _mm512_loadu_ps(k.add(dim * KEYS + 16));
            for (r, sr) in s.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*q.add(r * d + dim));
                sr[0] = _mm512_fmadd_ps(x, k0, sr[0]);
                sr[1] = _mm512_fmadd_ps(x, k1, sr[1]);
            }
        }
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut p = [0f32; ROWS * KEYS];
        let mut rescale = [1f32; ROWS];
        for (r, sr) in s.iter().enumerate() {
            let (lo, hi) = (visible[r].0 as i32, visible[r].1 as i32);
            let m0 = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(hi))
                & _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(lo));
            let m1 = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(hi - 16))
                & _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(lo - 16));
            if lo >= hi {
                continue; // all weights 0 (p stays 0), state unchanged
            }
            let x0 = _mm512_mask_blend_ps(m0, neg_inf, sr[0]);
            let x1 = _mm512_mask_blend_ps(m1, neg_inf, sr[1]);
            let panel_max = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
            let new_max = state.running_max[r].max(panel_max);
            rescale[r] = exp(state.running_max[r] - new_max);
            state.running_max[r] = new_max;
            let m = _mm512_set1_ps(new_max);
            let e0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(x0, m)));
            let e1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(x1, m)));
            _mm512_storeu_ps(p.as_mut_ptr().add(r * KEYS), e0);
            _mm512_storeu_ps(p.as_mut_ptr().add(r * KEYS + 16), e1);
            state.denom[r] =
                state.denom[r] * rescale[r] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        }
        let (v, o) = (v_cache.as_ptr(), acc.as_mut_ptr());
        let mut dim = 0;
        while dim < d {
            let two = d - dim >= 32;
            let mut a = [[_mm512_setzero_ps(); 2]; ROWS];
            for (r, ar) in a.iter_mut().enumerate() {
                let f = _mm512_set1_ps(rescale[r]);
                ar[0] = _mm512_mul_ps(f, _mm512_loadu_ps(o.add(r * d + dim)));
                if two {
                    ar[1] = _mm512_mul_ps(f, _mm512_loadu_ps(o.add(r * d + dim + 16)));
                }
            }
            for (key, &row) in v_rows.iter().enumerate() {
                let v0 = E::load16(v.add(row + dim));
                let v1 = if two {
                    E::load16(v.add(row + dim + 16))
                } else {
                    v0
                };
                for (r, ar) in a.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(p[r * KEYS + key]);
                    ar[0] = _mm512_fmadd_ps(w, v0, ar[0]);
                    if two {
                        ar[1] = _mm512_fmadd_ps(w, v1, ar[1]);
                    }
                }
            }
            for (r, ar) in a.iter().enumerate() {
                _mm512_storeu_ps(o.add(r * d + dim), ar[0]);
                if two {
                    _mm512_storeu_ps(o.add(r * d + dim + 16), ar[1]);
                }
            }
            dim += if two { 32 } else { 16 };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{KEYS, ROWS};
    use crate::cpu_exp::avx2::exp8;
    use crate::cpu_kv::KvElement;
    use std::arch::x86_64::*;

    /// `row[k] = e^(row[k] - max)` eight lanes at a time (a scalar tail); returns their sum.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
        let m = _mm256_set1_ps(max);
        let mut sum = _mm256_setzero_ps();
        let mut chunks = row.chunks_exact_mut(8);
        for c in &mut chunks {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        let mut total: f32 = lanes.iter().sum();
        for x in chunks.into_remainder() {
            *x = crate::cpu_exp::exp(*x - max);
            total += *x;
        }
        total
    }

    /// `scores[r][k] = qs[r] . kt[:, k]`, a quarter (8 keys) of the panel at a time: 8
    /// accumulators.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(qs: &[f32], kt: &[f32], d: usize, scores: &mut [f32; ROWS * KEYS]) {
        debug_assert!(qs.len() >= ROWS * d && kt.len() >= d * KEYS);
        let (q, k) = (qs.as_ptr(), kt.as_ptr());
        for quarter in 0..KEYS / 8 {
            let mut acc = [_mm256_setzero_ps(); ROWS];
            for dim in 0..d {
                let keys = _mm256_loadu_ps(k.add(dim * KEYS + quarter * 8));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(*q.add(r * d + dim)), keys, *a);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(scores.as_mut_ptr().add(r * KEYS + quarter * 8), *a);
            }
        }
    }

    /// `acc[r] = rescale[r] * acc[r] + sum_k p[r][k] * V[v_rows[k]]`, 8 dimensions of every row
    /// at a time: 8 accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn accumulate<E: KvElement>(
        p: &[f32; ROWS * KEYS],
        rescale: &[f32; ROWS],
        v_cache: &[E],
        v_rows: &[usize; KEYS],
        d: usize,
        acc: &mut [f32],
    ) {
        debug_assert!(acc.len() >= ROWS * d && v_rows.iter().all(|&r| r + d <= v_cache.len()));
        let (v, o) = (v_cache.as_ptr(), acc.as_mut_ptr());
        for dim in (0..d).step_by(8) {
            let mut a = [_mm256_setzero_ps(); ROWS];
            for (r, ar) in a.iter_mut().enumerate() {
                *ar = _mm256_mul_ps(
                    _mm256_set1_ps(rescale[r]),
                    _mm256_loadu_ps(o.add(r * d + dim)),
                );
            }
            for (key, &row) in v_rows.iter().enumerate() {
                let vk = E::load8(v.add(row + dim));
                for (r, ar) in a.iter_mut().enumerate() {
                    *ar = _mm256_fmadd_ps(_mm256_set1_ps(p[r * KEYS + key]), vk, *ar);
                }
            }
            for (r, ar) in a.iter().enumerate() {
                _mm256_storeu_ps(o.add(r * d + dim), *ar);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_kv::{f16, KvElement};
    use crate::cpu_kv_fp8::F8E4M3;
    use crate::cpu_kv_q8::{dequantize_cache, quantize_cache};
    use crate::test_rng::Lcg;

    /// One call's inputs: `seqs` as (first row, query tokens, keys), tables shuffled over the
    /// cache, random q/K/V, `out` poisoned with NaN.
    struct Case {
        shape: PrefillShape,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        tables: Vec<i32>,
        q_starts: Vec<i32>,
        q_lens: Vec<i32>,
        seq_lens: Vec<i32>,
    }

    impl Case {
        #[allow(clippy::too_many_arguments)]
        fn new(
            seed: u64,
            num_tokens: usize,
            seqs: &[(usize, usize, usize)],
            num_heads: usize,
            num_kv_heads: usize,
            head_dim: usize,
            block_size: usize,
        ) -> Case {
            let mut rng = Lcg(seed);
            let max_blocks = seqs
                .iter()
                .map(|s| s.2.div_ceil(block_size))
                .max()
                .unwrap_or(1);
            let num_blocks = seqs.len() * max_blocks + 3;
            // every sequence's blocks distinct, in a shuffled order
            let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.below(i + 1));
            }
            let shape = PrefillShape {
                num_tokens,
                num_seqs: seqs.len(),
                num_heads,
                num_kv_heads,
                head_dim,
                num_blocks,
                block_size,
                max_blocks_per_seq: max_blocks,
            };
            let cache = num_blocks * block_size * num_kv_heads * head_dim;
            Case {
                shape,
                q: rng.vec(num_tokens * num_heads * head_dim),
                k: rng.vec(cache),
                v: rng.vec(cache),
                tables: ids[..seqs.len() * max_blocks].to_vec(),
                q_starts: seqs.iter().map(|s| s.0 as i32).collect(),
                q_lens: seqs.iter().map(|s| s.1 as i32).collect(),
                seq_lens: seqs.iter().map(|s| s.2 as i32).collect(),
            }
        }

        fn run(&self, threads: usize, isa: Isa) -> Result<Vec<f32>, KernelInputError> {
            self.run_in(threads, isa, None)
        }

        fn run_in(
            &self,
            threads: usize,
            isa: Isa,
            window: Option<usize>,
        ) -> Result<Vec<f32>, KernelInputError> {
            let mut out = vec![f32::NAN; self.q.len()];
            run_windowed(
                &self.shape,
                &self.q,
                &self.k,
                &self.v,
                &self.tables,
                (&self.q_starts, &self.q_lens, &self.seq_lens),
                &mut out,
                0.125,
                threads,
                (isa, 0),
                window,
            )?;
            Ok(out)
        }

        fn reference(&self) -> Vec<f32> {
            self.reference_in(None)
        }

        /// Two-pass softmax attention in f64 straight from the header's definition (over the
        /// last `window` keys of each query); rows of no sequence stay NaN.
        fn reference_in(&self, window: Option<usize>) -> Vec<f32> {
            let s = &self.shape;
            let d = s.head_dim;
            let group = s.num_heads / s.num_kv_heads;
            let mut out = vec![f32::NAN; self.q.len()];
            for seq in 0..s.num_seqs {
                let (start, len, ctx) = (
                    self.q_starts[seq] as usize,
                    self.q_lens[seq] as usize,
                    self.seq_lens[seq] as usize,
                );
                for j in 0..len {
                    for h in 0..s.num_heads {
                        let slot = |t: usize| {
                            let b = self.tables[seq * s.max_blocks_per_seq + t / s.block_size];
                            ((b as usize * s.block_size + t % s.block_size) * s.num_kv_heads
                                + h / group)
                                * d
                        };
                        let qv = &self.q[((start + j) * s.num_heads + h) * d..][..d];
                        let keys = ctx - len + j + 1;
                        let first = window.map_or(0, |w| keys.saturating_sub(w));
                        let logits: Vec<f64> = (first..keys)
                            .map(|t| {
                                (0..d)
                                    .map(|i| qv[i] as f64 * self.k[slot(t) + i] as f64)
                                    .sum::<f64>()
                                    * 0.125
                            })
                            .collect();
                        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let w: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
                        let z: f64 = w.iter().sum();
                        for i in 0..d {
                            let o = (first..keys)
                                .map(|t| w[t - first] * self.v[slot(t) + i] as f64)
                                .sum::<f64>();
                            out[((start + j) * s.num_heads + h) * d + i] = (o / z) as f32;
                        }
                    }
                }
            }
            out
        }
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            if w.is_nan() {
                assert!(
                    g.is_nan(),
                    "{what}: element {i} outside every sequence was written"
                );
            } else {
                assert!((g - w).abs() <= 2e-5, "{what}: element {i}: {g} vs {w}");
            }
        }
    }

    const ISAS: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Amx];

    #[test]
    fn matches_the_f64_reference_on_every_path() {
        // (heads, kv heads, head dim, block size, tokens, sequences as (start, q_len, seq_len))
        type Seqs = &'static [(usize, usize, usize)];
        let cases: [(usize, usize, usize, usize, usize, Seqs); 8] = [
            // SmolLM2-like GQA 3, a first chunk and a later chunk after 37 keys of context
            (9, 3, 64, 16, 70, &[(0, 40, 40), (41, 29, 66)]),
            // long contexts: many panels, items of several row tiles (AMX: 32 tokens x 3
            // heads), a part tile, chunks whose first rows see none of the last panels
            (9, 3, 64, 16, 150, &[(0, 77, 77), (80, 70, 517)]),
            // Llama-like: head dim 128, GQA 4, a context that is not a multiple of 32
            (8, 2, 128, 16, 45, &[(0, 45, 301)]),
            // MHA, head dim 128, a block size that cuts panels, one row between sequences
            (4, 4, 128, 12, 60, &[(0, 9, 9), (10, 50, 131)]),
            // GQA 4, 1 and 17 tokens (a chunk boundary + 1), block size 32
            (8, 2, 64, 32, 40, &[(2, 1, 20), (3, 17, 17), (21, 19, 300)]),
            // GQA 8 with a head dim the SIMD paths do not take (portable fallback)
            (8, 1, 24, 16, 33, &[(0, 33, 50)]),
            // rows before and after the only sequence are not written
            (6, 2, 32, 16, 30, &[(5, 20, 20)]),
            // a single token whose context fills its last block exactly
            (2, 1, 16, 16, 1, &[(0, 1, 48)]),
        ];
        for (n, &(hq, hkv, d, bs, t, seqs)) in cases.iter().enumerate() {
            let case = Case::new(n as u64 + 1, t, seqs, hq, hkv, d, bs);
            let want = case.reference();
            for isa in ISAS {
                for threads in 1..=3 {
                    let got = case.run(threads, isa).unwrap();
                    assert_close(
                        &got,
                        &want,
                        &format!("case {n}, {isa:?}, {threads} threads"),
                    );
                }
            }
        }
    }

    /// A cache of `E` gives what the f32 cache holding its (rounded) values gives.
    /// `rounded` gives a cache's elements and the f32 values they hold.
    fn rounded_cache_reads_as_its_values<E: KvElement>(
        rounded: impl Fn(&[f32]) -> (Vec<E>, Vec<f32>),
    ) {
        // The keys enter the panels as f32 and the V rows are read from an f32 copy (a scaled
        // cache's blocks are first copied out as their values), so the result is the f32
        // kernel's over the rounded values, bit for bit, on every path.
        let mut case = Case::new(11, 70, &[(0, 40, 40), (41, 29, 66)], 9, 3, 64, 16);
        let ((k_e, k32), (v_e, v32)) = (rounded(&case.k), rounded(&case.v));
        (case.k, case.v) = (k32, v32);
        for isa in ISAS {
            for threads in 1..=3 {
                let want = case.run(threads, isa).unwrap();
                let mut got = vec![f32::NAN; case.q.len()];
                run(
                    &case.shape,
                    &case.q,
                    &k_e,
                    &v_e,
                    &case.tables,
                    (&case.q_starts, &case.q_lens, &case.seq_lens),
                    &mut got,
                    0.125,
                    threads,
                    (isa, 0),
                )
                .unwrap();
                let apart = got
                    .iter()
                    .zip(&want)
                    .filter(|(g, w)| g.to_bits() != w.to_bits())
                    .collect::<Vec<_>>();
                assert!(
                    apart.is_empty(),
                    "{isa:?}, {threads} threads: {} cache vs its f32 values: {} apart, e.g. {:?}",
                    E::NAME,
                    apart.len(),
                    &apart[..apart.len().min(4)]
                );
            }
        }
    }

    /// Each element rounded by `E::from_f32`, and its value.
    fn each_rounded<E: KvElement>(xs: &[f32]) -> (Vec<E>, Vec<f32>) {
        let elements: Vec<E> = xs.iter().map(|&x| E::from_f32(x)).collect();
        let back = elements.iter().map(|h| h.to_f32()).collect();
        (elements, back)
    }

    #[test]
    fn an_f16_cache_gives_what_its_values_in_f32_give() {
        rounded_cache_reads_as_its_values(each_rounded::<f16>);
    }

    #[test]
    fn an_fp8_cache_gives_what_its_values_in_f32_give() {
        rounded_cache_reads_as_its_values(each_rounded::<F8E4M3>);
    }

    #[test]
    fn an_int8_cache_gives_what_its_values_in_f32_give() {
        rounded_cache_reads_as_its_values(|xs: &[f32]| {
            let q = quantize_cache(xs, 64);
            let values = dequantize_cache(&q, 64);
            (q, values)
        });
    }

    #[test]
    fn bad_inputs_are_errors_and_write_nothing() {
        let base = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        let mut cases: Vec<(&str, Case)> = Vec::new();
        let mut c = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        c.q_starts[1] = 7; // overlaps the first sequence's rows
        cases.push(("overlap", c));
        let mut c = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        c.q_starts[1] = 9; // runs past the last row
        cases.push(("past the end", c));
        let mut c = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        c.seq_lens[0] = 7; // fewer keys than queries
        cases.push(("seq_len < q_len", c));
        let mut c = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        c.q_lens[0] = 0;
        cases.push(("empty query", c));
        let mut c = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        c.seq_lens[1] = 33; // more keys than the table holds
        cases.push(("context past the table", c));
        let mut c = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        let last = c.tables.len() - 1;
        c.tables[last] = c.shape.num_blocks as i32; // a block id past the cache
        cases.push(("block id", c));
        let mut c = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        c.shape.num_heads = 3; // does not group over 2 KV heads
        cases.push(("heads", c));
        let mut c = Case::new(7, 20, &[(0, 8, 8), (8, 12, 30)], 4, 2, 16, 16);
        c.v.pop();
        cases.push(("v_cache length", c));
        assert!(base.run(2, Isa::Avx512).is_ok());
        for (what, case) in cases {
            let mut out = vec![f32::NAN; case.q.len()];
            let err = run(
                &case.shape,
                &case.q,
                &case.k,
                &case.v,
                &case.tables,
                (&case.q_starts, &case.q_lens, &case.seq_lens),
                &mut out,
                0.125,
                2,
                (Isa::Avx512, 0),
            );
            assert!(err.is_err(), "{what} was accepted");
            assert!(out.iter().all(|x| x.is_nan()), "{what}: out was written");
        }
    }

    #[test]
    fn no_sequences_is_a_no_op() {
        let case = Case::new(3, 4, &[], 2, 1, 16, 16);
        assert!(case.run(2, Isa::Avx512).unwrap().iter().all(|x| x.is_nan()));
    }

    #[test]
    fn every_path_is_within_float32_rounding_of_the_reference() {
        // Tighter than `assert_close`: the AMX path's three-part products must be as accurate
        // as the vector paths' float32 ones (a lost part would err by ~2^-16 of the values).
        let case = Case::new(21, 150, &[(0, 77, 77), (80, 70, 517)], 9, 3, 64, 16);
        let want = case.reference();
        for isa in ISAS {
            let got = case.run(2, isa).unwrap();
            let worst = got
                .iter()
                .zip(&want)
                .filter(|(_, w)| !w.is_nan())
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= 5e-7,
                "{isa:?}: {worst:e} from the float64 reference"
            );
        }
    }

    #[test]
    fn amx_is_chosen_only_where_enough_queries_share_each_key() {
        let seq = |q_len, seq_len| SeqQuery {
            q_start: 0,
            q_len,
            seq_len,
        };
        assert!(amx_pays(&[seq(512, 512)], AMX_MIN_QUERIES));
        assert!(amx_pays(&[seq(512, 8192)], AMX_MIN_QUERIES));
        assert!(!amx_pays(&[seq(16, 1016)], AMX_MIN_QUERIES));
        assert!(!amx_pays(&[seq(64, 256)], AMX_MIN_QUERIES));
        // averaged over the keys: a long chunk outweighs a short one beside it
        assert!(amx_pays(&[seq(500, 2000), seq(12, 12)], AMX_MIN_QUERIES));
        assert!(!amx_pays(&[seq(100, 4000), seq(400, 400)], AMX_MIN_QUERIES));
        assert!(!amx_pays(&[], AMX_MIN_QUERIES));
    }

    #[test]
    fn weights_and_queries_spanning_the_float_range_stay_exact() {
        // Scores of several hundred make softmax weights down to e^-87 (~1e-38), whose low
        // bfloat16 parts are subnormal; tiny queries do the same to the queries' parts. Such a
        // part must not spill into its neighbour when two are packed into one 32-bit lane:
        // every path stays as close to the float64 reference as the scalar one (whose error
        // grows with the scores' size: float32 rounding of scores in the hundreds).
        for (seed, mag, tiny) in [(9u64, 10f32, false), (10, 30.0, false), (11, 1.0, true)] {
            let mut case = Case::new(seed, 128, &[(0, 128, 128)], 9, 3, 64, 16);
            case.k.iter_mut().for_each(|x| *x *= mag);
            for (i, x) in case.q.iter_mut().enumerate() {
                *x *= if tiny && i % 3 == 0 { 1e-36 } else { mag };
            }
            let want = case.reference();
            let worst = |isa| {
                let got = case.run(2, isa).unwrap();
                got.iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(
                        0f32,
                        |m, e| if e.is_nan() { f32::INFINITY } else { m.max(e) },
                    )
            };
            let scalar = worst(Isa::Portable);
            for isa in ISAS {
                let err = worst(isa);
                assert!(
                    err <= 4.0 * scalar + 1e-6,
                    "magnitude {mag}, {isa:?}: {err:e} from the reference, the scalar path {scalar:e}"
                );
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 48, ..proptest::prelude::ProptestConfig::default()
        })]
        /// Random shapes, contexts, block sizes and score scales: every path (the AMX one
        /// forced, whatever the chunks' lengths) as close to the float64 reference as the
        /// scalar path is.
        #[test]
        fn every_path_agrees_on_random_calls(
            group in 1usize..=4,
            hkv in 1usize..=3,
            d in proptest::sample::select(vec![64usize, 128]),
            bs in proptest::sample::select(vec![8usize, 16, 32]),
            chunks in proptest::collection::vec((1usize..120, 0usize..300), 1..4),
            mag in proptest::sample::select(vec![1.0f32, 6.0]),
            threads in 1usize..=3,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let mut seqs = Vec::new();
            let mut row = 0;
            for &(q_len, prior) in &chunks {
                seqs.push((row, q_len, q_len + prior));
                row += q_len + 1; // a row between chunks, never written
            }
            let mut case = Case::new(seed, row, &seqs, group * hkv, hkv, d, bs);
            case.q.iter_mut().for_each(|x| *x *= mag);
            case.k.iter_mut().for_each(|x| *x *= mag);
            let want = case.reference();
            let worst = |isa| {
                let got = case.run(threads, isa).unwrap();
                got.iter().zip(&want).fold(0f32, |m, (g, w)| {
                    if w.is_nan() != g.is_nan() { f32::INFINITY } else if w.is_nan() { m } else { m.max((g - w).abs()) }
                })
            };
            let scalar = worst(Isa::Portable);
            for isa in ISAS {
                let err = worst(isa);
                // 1e-5: ~80 float32 ulps of outputs near 1, the floor for a case where the
                // scalar path happens to land unusually close (seen: AVX2 3.7e-6 against
                // scalar 4.3e-7, a 128-token context at magnitude 6; saved in
                // proptest-regressions)
                proptest::prop_assert!(err <= 4.0 * scalar + 1e-5, "{:?}: {} vs scalar {}", isa, err, scalar);
            }
        }
    }

    #[test]
    fn sliding_windows_match_the_reference_on_every_path() {
        // chunks at the start of a context and deep into one, a window of 1, windows inside a
        // panel, on a panel's edge, past a whole chunk, and wider than every context (no cut)
        let seqs = [(0, 40, 100), (40, 17, 17), (57, 33, 70), (90, 9, 9)];
        let case = Case::new(91, 99, &seqs, 4, 2, 32, 16);
        for window in [1, 5, 16, 32, 33, 47, 64, 1000] {
            let want = case.reference_in(Some(window));
            for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Amx] {
                for threads in [1, 3] {
                    let got = case.run_in(threads, isa, Some(window)).unwrap();
                    assert_close(&got, &want, &format!("window {window} {isa:?} x{threads}"));
                }
            }
        }
        // a window that cuts no context is the whole-context kernel, AMX included, bit for bit
        let case = Case::new(92, 64, &[(0, 64, 64)], 4, 2, 64, 16);
        for isa in [Isa::Avx512, Isa::Amx] {
            assert_eq!(
                case.run_in(2, isa, Some(64)).unwrap(),
                case.run(2, isa).unwrap()
            );
        }
        let cut = case.run_in(2, Isa::Avx512, Some(8)).unwrap();
        assert_close(&cut, &case.reference_in(Some(8)), "window 8");
        assert!(case.run_in(1, Isa::Avx512, Some(0)).is_err());
    }
}
