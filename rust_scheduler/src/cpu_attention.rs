//! Paged decode attention on the CPU (float32 math over any `cpu_kv` cache type): one query
//! token per sequence, its context's K/V read in place through the block table — no gather copy,
//! no padding to the longest context.
//!
//! Layout (all row-major, as the Python side's torch tensors):
//! `q` / `out` `[S, Hq, D]`, `k_cache` / `v_cache` `[num_blocks, block_size, Hkv, D +
//! ROW_EXTRA]` (a scaled cache's head rows end in their scale, `cpu_kv`),
//! `block_tables` `[S, max_blocks]`, `ctx_lens` `[S]` (keys each query attends: all of them, so
//! causality holds because the query is the last token), and optionally `starts` `[S]`: row `s`
//! then attends keys `starts[s]..ctx_lens[s]` only (a sliding attention window, e.g. Gemma 3's
//! local layers: `max(0, ctx - window)`); `None` is all zeros and computes exactly the same.
//!
//! Invariants checked by [`DecodeShape::validate`] (and [`DecodeShape::validate_starts`])
//! before any read, so no index below can leave its slice: `Hq % Hkv == 0`; slice lengths equal
//! their shapes; `1 <= ctx_lens[s] <= max_blocks * block_size`; every block id a sequence uses
//! (`0..ceil(ctx_lens[s] / block_size)`, window or not) is in `0..num_blocks`; with `starts`,
//! `starts.len() == S` and `0 <= starts[s] < ctx_lens[s]`.
//! What is read: row `s`'s blocks `starts[s] / block_size ..= (ctx_lens[s] - 1) / block_size`
//! of its block table (those wholly before its window never), and in them only the rows of keys
//! `starts[s]..ctx_lens[s]`: the first block's K and V rows before the start are skipped (its
//! `Rows` begin at the start), so they enter neither the scores nor the softmax nor the output
//! (only the L2 prefetch hint still covers that block whole).
//! Work split (`partition`): all sequences' blocks, in order, cut into one run of consecutive
//! blocks per thread, so a task gets whole sequences plus at most a part of one at each end
//! (split-KV, as in flash-decoding: one long sequence still uses every thread). A task writes
//! the `Hq * D` outputs of its whole sequences (disjoint slices); for a cut sequence each part
//! returns its un-normalized output, running max and denominator, and the caller merges them
//! after the job (`merge`). Each block is read once, all KV heads together (`[block_size, Hkv,
//! D]` is contiguous). Softmax is the online (running max) form, in f32, per chunk of up to
//! `CHUNK_KEYS` keys: a chunk's K blocks give every head's scores, one softmax per head, then
//! its V blocks (a scaled cache's scales enter per key there, each read beside its row inside
//! the pass: a key's dot product times its K row's, a value's softmax weight times its V
//! row's, so the inner loops read bare int8). While one
//! block is computed the next one the task will read (in that order) is prefetched into L2, in
//! slices spread over the block's work (the kernel waits on memory at long contexts). The query
//! heads of one KV head go in runs of up to three (`head_subgroups`) whose scores and values
//! share each loaded key and value vector.

use crate::cpu_error::KernelInputError;
use crate::cpu_exp::exp;
use crate::cpu_isa::Isa;
use crate::cpu_kv::KvElement;
use std::sync::Mutex;

/// The fewest (key, KV head) pairs per task of the kernels' pool: below it, waking a worker
/// costs more than its share of the work. 2048 dated from threads spawned per call (~100 µs);
/// with the pool's spinning workers, SmolLM2's decode attention at 256 keys on two threads of
/// an AMD EPYC Zen 3 (`benches/step_breakdown.py`, session 21, two alternating rounds) took
/// 1.21-1.28 -> 0.76-0.81 ms per step at one row and 2.32-2.45 -> 1.29-1.36 at two (both now
/// split over the two threads), whole steps 3-10 % faster; 128 measured the same as 512.
const MIN_KEYS_PER_TASK: usize = 512;

/// Keys per softmax (a chunk of whole blocks: `CHUNK_KEYS / block_size` of them, at least one).
const CHUNK_KEYS: usize = 128;

/// How many blocks ahead (in the order a task reads them) the prefetch runs. 2 and 3 measured
/// no better with the KV in DRAM and 5-10 % slower with it in L3 (16 rows x 256 keys, Zen 3).
const PREFETCH_AHEAD: usize = 1;

/// Shapes of one decode-attention call.
#[derive(Clone, Copy, Debug)]
pub struct DecodeShape {
    pub num_seqs: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
}

fn bad(msg: String) -> Result<(), KernelInputError> {
    Err(KernelInputError(msg))
}

/// The model's heads and the paged cache's geometry, checked alike by both attention kernels
/// (this one and `cpu_prefill_attention`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CacheGeometry {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
}

impl CacheGeometry {
    /// Positive sizes, query heads that group over the KV heads, caches of the geometry's size.
    pub(crate) fn validate<E: KvElement>(
        &self,
        k_cache: &[E],
        v_cache: &[E],
    ) -> Result<(), KernelInputError> {
        let g = self;
        if g.num_kv_heads == 0 || g.head_dim == 0 || g.block_size == 0 {
            return bad("num_kv_heads, head_dim and block_size must be positive".into());
        }
        if !g.num_heads.is_multiple_of(g.num_kv_heads) || g.num_heads == 0 {
            return bad(format!(
                "num_heads {} is not a positive multiple of num_kv_heads {}",
                g.num_heads, g.num_kv_heads
            ));
        }
        let row = g.head_dim + E::ROW_EXTRA; // a (token, KV head)'s cache row (`cpu_kv`)
        let cache_len = g.num_blocks * g.block_size * g.num_kv_heads * row;
        for (name, len) in [("k_cache", k_cache.len()), ("v_cache", v_cache.len())] {
            if len != cache_len {
                return bad(format!(
                    "{name} has {len} elements, its shape needs {cache_len}"
                ));
            }
        }
        Ok(())
    }

    /// The blocks sequence `seq` reads for `keys` keys (the start of its row of
    /// `block_tables`, `[S, max_blocks_per_seq]`, validated length) are in `0..num_blocks`.
    pub(crate) fn check_blocks(
        &self,
        block_tables: &[i32],
        seq: usize,
        keys: usize,
    ) -> Result<(), KernelInputError> {
        let used = keys.div_ceil(self.block_size);
        let row = &block_tables[seq * self.max_blocks_per_seq..][..used];
        if let Some(&b) = row
            .iter()
            .find(|&&b| b < 0 || b as usize >= self.num_blocks)
        {
            return bad(format!(
                "block id {b} of sequence {seq} outside 0..{}",
                self.num_blocks
            ));
        }
        Ok(())
    }
}

impl DecodeShape {
    fn geometry(&self) -> CacheGeometry {
        CacheGeometry {
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            max_blocks_per_seq: self.max_blocks_per_seq,
        }
    }

    /// Checks every invariant of the module header against the given buffers, but the window
    /// starts' ([`Self::validate_starts`]).
    pub fn validate<E: KvElement>(
        &self,
        q: &[f32],
        k_cache: &[E],
        v_cache: &[E],
        block_tables: &[i32],
        ctx_lens: &[i32],
        out: &[f32],
    ) -> Result<(), KernelInputError> {
        let s = *self;
        let geometry = s.geometry();
        geometry.validate(k_cache, v_cache)?;
        let q_len = s.num_seqs * s.num_heads * s.head_dim;
        for (name, len, want) in [
            ("q", q.len(), q_len),
            ("out", out.len(), q_len),
            (
                "block_tables",
                block_tables.len(),
                s.num_seqs * s.max_blocks_per_seq,
            ),
            ("ctx_lens", ctx_lens.len(), s.num_seqs),
        ] {
            if len != want {
                return bad(format!("{name} has {len} elements, its shape needs {want}"));
            }
        }
        let max_ctx = s.max_blocks_per_seq * s.block_size;
        for (seq, &ctx) in ctx_lens.iter().enumerate() {
            if ctx < 1 || ctx as usize > max_ctx {
                return bad(format!("ctx_lens[{seq}] = {ctx} outside 1..={max_ctx}"));
            }
            geometry.check_blocks(block_tables, seq, ctx as usize)?;
        }
        Ok(())
    }

    /// Checks each row's first key of a sliding window (module header): one per sequence, `0
    /// <= starts[s] < ctx_lens[s]` (every row keeps at least its last key). `ctx_lens` is the
    /// one [`Self::validate`] accepted.
    pub fn validate_starts(
        &self,
        ctx_lens: &[i32],
        starts: &[i32],
    ) -> Result<(), KernelInputError> {
        if starts.len() != self.num_seqs {
            return bad(format!(
                "starts has {} elements, its shape needs {}",
                starts.len(),
                self.num_seqs
            ));
        }
        for (seq, (&start, &ctx)) in starts.iter().zip(ctx_lens).enumerate() {
            if start < 0 || start >= ctx {
                return bad(format!(
                    "starts[{seq}] = {start} outside 0..{ctx} (ctx_lens[{seq}])"
                ));
            }
        }
        Ok(())
    }
}

/// Runs decode attention on up to `num_threads` threads of the kernels' pool (`cpu_pool`),
/// each taking an equal run of the sequences' blocks (module header). Row `s` attends keys
/// `starts[s]..ctx_lens[s]` (a sliding window) where `starts` is given, all `0..ctx_lens[s]`
/// where it is `None` (bit for bit what all-zero `starts` give). Errors instead of reading out
/// of bounds; see the module header for the layout and the invariants.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_f32<E: KvElement>(
    shape: &DecodeShape,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    ctx_lens: &[i32],
    starts: Option<&[i32]>,
    out: &mut [f32],
    scale: f32,
    num_threads: usize,
) -> Result<(), KernelInputError> {
    run(
        shape,
        q,
        k_cache,
        v_cache,
        block_tables,
        ctx_lens,
        starts,
        out,
        scale,
        num_threads,
        Isa::Avx512,
    )
}

/// [`paged_decode_attention_f32`] using at most instruction set `max_isa` (tests compare every
/// path).
#[allow(clippy::too_many_arguments)]
fn run<E: KvElement>(
    shape: &DecodeShape,
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    block_tables: &[i32],
    ctx_lens: &[i32],
    starts: Option<&[i32]>,
    out: &mut [f32],
    scale: f32,
    num_threads: usize,
    max_isa: Isa,
) -> Result<(), KernelInputError> {
    shape.validate(q, k_cache, v_cache, block_tables, ctx_lens, out)?;
    if let Some(starts) = starts {
        shape.validate_starts(ctx_lens, starts)?;
    }
    if shape.num_seqs == 0 {
        return Ok(());
    }
    let kernel = Kernel {
        shape: *shape,
        q,
        k_cache,
        v_cache,
        block_tables,
        ctx_lens,
        starts,
        scale,
        isa: Isa::detect(max_isa),
    };
    let bs = shape.block_size;
    // each row's first key and first block (0 and 0 without a window)
    let start_of = |seq: usize| starts.map_or(0, |starts| starts[seq] as usize);
    let first_block: Vec<usize> = (0..shape.num_seqs).map(|seq| start_of(seq) / bs).collect();
    // the blocks each row reads: its first (validated: `start < ctx`) through its last
    let block_counts: Vec<usize> = ctx_lens
        .iter()
        .zip(&first_block)
        .map(|(&c, &first)| (c as usize).div_ceil(bs) - first)
        .collect();
    let total_blocks: usize = block_counts.iter().sum();
    let total_keys: usize = (0..shape.num_seqs)
        .map(|seq| ctx_lens[seq] as usize - start_of(seq))
        .sum::<usize>()
        * shape.num_kv_heads;
    let threads = num_threads
        .clamp(1, total_blocks)
        .min(1 + total_keys / MIN_KEYS_PER_TASK);
    let pool = (threads > 1).then(|| crate::cpu_pool::global(threads));
    let threads = pool.map_or(1, |pool| threads.min(pool.max_tasks()));
    // One output slice per sequence: each whole sequence's goes to the task that computes it,
    // a split sequence's stays here until its parts are merged after the job.
    let item_len = shape.num_heads * shape.head_dim;
    let mut seq_outs: Vec<Option<&mut [f32]>> = out.chunks_exact_mut(item_len).map(Some).collect();
    let tasks: Vec<Mutex<Task<'_>>> = partition(&block_counts, threads)
        .into_iter()
        .map(|mut segments| {
            // `partition` counts each row's blocks from its first: shifted, the ranges index
            // its block table (so a window's leading blocks are never read)
            for segment in &mut segments {
                let first = first_block[segment.seq];
                segment.blocks = segment.blocks.start + first..segment.blocks.end + first;
            }
            let outs = segments
                .iter()
                .filter(|segment| segment.whole)
                .map(|segment| {
                    seq_outs[segment.seq]
                        .take()
                        .expect("one task per whole sequence")
                })
                .collect();
            Mutex::new(Task {
                segments,
                outs,
                partials: Vec::new(),
            })
        })
        .collect();
    let run_task = |t: usize| {
        let mut task = tasks[t].lock().unwrap_or_else(|e| e.into_inner());
        let Task {
            segments,
            outs,
            partials,
        } = &mut *task;
        kernel.run_segments(segments, outs, partials);
    };
    match pool {
        Some(pool) if tasks.len() > 1 => pool.run(tasks.len(), &run_task),
        _ => (0..tasks.len()).for_each(run_task),
    }
    let partials: Vec<Partial> = tasks
        .into_iter()
        .flat_map(|task| {
            task.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .partials
        })
        .collect();
    // Tasks hold consecutive runs of sequences, so the partials come ordered by sequence and a
    // split sequence's parts are neighbours.
    debug_assert!(partials.is_sorted_by_key(|p| p.seq));
    for parts in partials.chunk_by(|a, b| a.seq == b.seq) {
        let out = seq_outs[parts[0].seq]
            .take()
            .expect("a split sequence's output");
        merge(parts, shape.head_dim, out);
    }
    Ok(())
}

/// Blocks `blocks` of sequence `seq` (of its block table, once `run` has shifted `partition`'s
/// ranges by the row's first block); `whole` when they are all the blocks the row reads.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Segment {
    seq: usize,
    blocks: std::ops::Range<usize>,
    whole: bool,
}

/// One task's work: its segments in order, the outputs of its whole ones (in the same order),
/// and what it leaves for [`merge`]: the state of each split one.
struct Task<'o> {
    segments: Vec<Segment>,
    outs: Vec<&'o mut [f32]>,
    partials: Vec<Partial>,
}

/// Attention over part of one sequence's keys, per query head: the output not yet divided by
/// the softmax denominator, the running max and that denominator.
struct Partial {
    seq: usize,
    acc: Vec<f32>,
    running_max: Vec<f32>,
    denom: Vec<f32>,
}

/// Splits the sequences' blocks (`block_counts[s]` each, in order) into `tasks` runs of
/// consecutive blocks with at most `ceil(total / tasks)` each: a long sequence is cut between
/// tasks (split-KV), so one sequence at a long context still uses every thread and a mix of
/// lengths balances. Every block is in exactly one segment; a sequence is `whole` in one task or
/// cut into parts in consecutive tasks.
fn partition(block_counts: &[usize], tasks: usize) -> Vec<Vec<Segment>> {
    let total: usize = block_counts.iter().sum();
    let per_task = total.div_ceil(tasks.max(1)).max(1);
    let mut plan: Vec<Vec<Segment>> = vec![Vec::new(); total.div_ceil(per_task).max(1)];
    let mut start = 0; // the sequence's first block in the flattened order
    for (seq, &count) in block_counts.iter().enumerate() {
        debug_assert!(count > 0, "every sequence has a key (validated)");
        let (first_task, last_task) = (start / per_task, (start + count - 1) / per_task);
        for (t, segments) in plan
            .iter_mut()
            .enumerate()
            .take(last_task + 1)
            .skip(first_task)
        {
            let lo = start.max(t * per_task) - start;
            let hi = (start + count).min((t + 1) * per_task) - start;
            segments.push(Segment {
                seq,
                blocks: lo..hi,
                whole: first_task == last_task,
            });
        }
        start += count;
    }
    plan
}

/// Writes the attention of a split sequence into `out` (`[Hq, D]`) from its parts' states.
fn merge(parts: &[Partial], head_dim: usize, out: &mut [f32]) {
    for (qh, out_head) in out.chunks_exact_mut(head_dim).enumerate() {
        let max = parts
            .iter()
            .map(|p| p.running_max[qh])
            .fold(f32::NEG_INFINITY, f32::max);
        out_head.fill(0.0);
        let mut denom = 0.0;
        for part in parts {
            let weight = exp(part.running_max[qh] - max);
            denom += part.denom[qh] * weight;
            let acc = &part.acc[qh * head_dim..][..head_dim];
            out_head
                .iter_mut()
                .zip(acc)
                .for_each(|(o, a)| *o += a * weight);
        }
        let inv = 1.0 / denom;
        out_head.iter_mut().for_each(|o| *o *= inv);
    }
}

struct Kernel<'a, E> {
    shape: DecodeShape,
    q: &'a [f32],
    k_cache: &'a [E],
    v_cache: &'a [E],
    block_tables: &'a [i32],
    ctx_lens: &'a [i32],
    /// each row's first key (validated), all 0 when `None`
    starts: Option<&'a [i32]>,
    scale: f32,
    /// what this CPU has, at most what the caller allowed (`Isa::detect`)
    isa: Isa,
}

impl<'a, E: KvElement> Kernel<'a, E> {
    /// Computes `segments` in order: each whole one into the next of `outs`, each split one
    /// into a [`Partial`] pushed onto `partials`.
    fn run_segments(
        &self,
        segments: &[Segment],
        outs: &mut [&mut [f32]],
        partials: &mut Vec<Partial>,
    ) {
        let d = self.shape.head_dim;
        match self.isa {
            // SAFETY: `isa` was detected on this CPU, which therefore has AVX-512F (`Avx512`)
            // and AVX2, FMA and F16C (both); head_dim % 16 == 0 is the AVX-512 math's contract,
            // head_dim % 8 == 0 the AVX2 math's. (The kernel mostly waits on memory: AVX-512
            // measured 1.03-1.13x AVX2 on the Xeon, session 15, by doing its arithmetic in
            // fewer instructions between the loads.)
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if d.is_multiple_of(16) => unsafe {
                self.run_segments_avx512(segments, outs, partials)
            },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx2 if d.is_multiple_of(8) => unsafe {
                self.run_segments_avx2(segments, outs, partials)
            },
            _ => self.run_segments_impl::<portable::Math>(segments, outs, partials),
        }
    }

    /// # Safety
    /// On a CPU with AVX2, FMA and F16C, for `head_dim % 8 == 0`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_segments_avx2(
        &self,
        segments: &[Segment],
        outs: &mut [&mut [f32]],
        partials: &mut Vec<Partial>,
    ) {
        self.run_segments_impl::<avx2::Math>(segments, outs, partials);
    }

    /// # Safety
    /// On a CPU with AVX-512F, AVX2, FMA and F16C, for `head_dim % 16 == 0`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn run_segments_avx512(
        &self,
        segments: &[Segment],
        outs: &mut [&mut [f32]],
        partials: &mut Vec<Partial>,
    ) {
        self.run_segments_impl::<avx512::Math>(segments, outs, partials);
    }

    /// The loop over segments, chunks and blocks every instruction set shares; `M` does the
    /// block math (inlined into the `target_feature` entry that instantiates it).
    ///
    /// A segment goes in chunks of up to [`CHUNK_KEYS`] keys: every block's scores for all
    /// query heads (the K pass), one softmax per head over the whole chunk, then every block's
    /// values (the V pass). A softmax per block of 16 keys was a serial chain (max, scalar
    /// exp, correction) too short to overlap: a fifth of the kernel's time (`perf`, session 22).
    ///
    /// A window's start (`starts`) only moves where a row's first block begins: its `Rows`, its
    /// scores and its weights start at the start's key inside the block (always the first block
    /// of the segment's first chunk, as the segments begin at the row's first block), so the
    /// keys before it are neither read nor part of the chunk's softmax, and every chunk keeps at
    /// least one key (a finite running max). Segments cut inside a row merge as without one.
    #[inline(always)]
    fn run_segments_impl<M: BlockMath>(
        &self,
        segments: &[Segment],
        outs: &mut [&mut [f32]],
        partials: &mut Vec<Partial>,
    ) {
        let s = &self.shape;
        let (d, bs, hkv) = (s.head_dim, s.block_size, s.num_kv_heads);
        let dr = d + E::ROW_EXTRA; // a head row of the cache: its values, then its scale
        let group = s.num_heads / hkv;
        let block_len = bs * hkv * dr;
        let chunk_blocks = (CHUNK_KEYS / bs).max(1);
        let chunk_cap = chunk_blocks * bs;
        // scores[qh * chunk_cap + j]: query head qh against key j of the current chunk
        let mut scores = vec![0f32; s.num_heads * chunk_cap];
        let mut running_max = vec![0f32; s.num_heads];
        let mut denom = vec![0f32; s.num_heads];
        let mut correction = vec![0f32; s.num_heads];
        let ones = vec![1f32; s.num_heads];
        let subgroups = head_subgroups(hkv, group);
        let mut split_acc = vec![0f32; s.num_heads * d];
        // where query head qh's KV head starts inside a block row
        let kv_offset: Vec<usize> = (0..s.num_heads).map(|qh| (qh / group) * dr).collect();
        // the next block's K (or V) in one slice of whole 64-byte lines per run of heads, each
        // prefetched while that run computes
        let line = 64 / std::mem::size_of::<E>();
        let slice = block_len.div_ceil(subgroups.len()).next_multiple_of(line);
        let fetch_part = |next: Option<(&'a [E], usize)>, part: usize| -> &'a [E] {
            next.map_or(&[], |(cache, block)| {
                let start = (part * slice).min(block_len);
                let len = slice.min(block_len - start);
                &cache[block * block_len + start..][..len]
            })
        };
        let table_of = |seq: usize| &self.block_tables[seq * s.max_blocks_per_seq..];
        // Every (cache, block) the task reads, in order: per chunk, its K blocks then its V
        // blocks. While item `r` is computed, item `r + PREFETCH_AHEAD` is fetched into L2.
        let mut reads: Vec<(&'a [E], usize)> = Vec::new();
        for segment in segments {
            for chunk in table_of(segment.seq)[segment.blocks.clone()].chunks(chunk_blocks) {
                let blocks = chunk.iter().map(|&b| b as usize);
                reads.extend(blocks.clone().map(|b| (self.k_cache, b)));
                reads.extend(blocks.map(|b| (self.v_cache, b)));
            }
        }
        let mut read = 0; // the item being computed
        let mut outs = outs.iter_mut();
        for segment in segments {
            let seq = segment.seq;
            let q = &self.q[seq * s.num_heads * d..][..s.num_heads * d];
            let ctx = self.ctx_lens[seq] as usize;
            let start = self.starts.map_or(0, |starts| starts[seq] as usize);
            let table = &table_of(seq)[segment.blocks.clone()];
            let acc: &mut [f32] = if segment.whole {
                outs.next().expect("an output per whole segment")
            } else {
                &mut split_acc
            };
            acc.fill(0.0);
            running_max.fill(f32::NEG_INFINITY);
            denom.fill(0.0);
            // block `b` of `table` holds keys `skip_of(b)..keys_of(b)` of the row's window:
            // `skip_of` is 0 but in the window's first block (where the start is mid-block)
            let keys_of = |b: usize| (ctx - (segment.blocks.start + b) * bs).min(bs);
            let skip_of = |b: usize| start.saturating_sub((segment.blocks.start + b) * bs);
            for (c, chunk) in table.chunks(chunk_blocks).enumerate() {
                let first = c * chunk_blocks; // the chunk's first block, in `table`
                let chunk_keys: usize = (0..chunk.len()).map(|b| keys_of(first + b)).sum();
                // the chunk's scores are `skip..chunk_keys` of its rows of `scores`
                let skip = skip_of(first);
                debug_assert!(
                    skip < keys_of(first) && (1..chunk.len()).all(|b| skip_of(first + b) == 0)
                );
                let head_rows = |block: &'a [E], b: usize, qh: usize| {
                    let skip = skip_of(first + b);
                    Rows {
                        block,
                        offset: kv_offset[qh] + skip * hkv * dr,
                        stride: hkv * dr,
                        n: keys_of(first + b) - skip,
                        d,
                    }
                };
                // The K pass.
                for (b, &block) in chunk.iter().enumerate() {
                    let next = reads.get(read + PREFETCH_AHEAD).copied();
                    read += 1;
                    let k_block = &self.k_cache[block as usize * block_len..][..block_len];
                    for (part, &(h0, hn)) in subgroups.iter().enumerate() {
                        let fetch = fetch_part(next, part);
                        let rows = head_rows(k_block, b, h0);
                        let out = &mut scores[h0 * chunk_cap + b * bs + skip_of(first + b)..];
                        let q = &q[h0 * d..][..hn * d];
                        // SAFETY: `M` is the math of the entry this was inlined into
                        // (`run_segments`).
                        unsafe { M::scores_group(hn, q, &rows, self.scale, out, chunk_cap, fetch) };
                    }
                }
                for qh in 0..s.num_heads {
                    let row = &mut scores[qh * chunk_cap + skip..][..chunk_keys - skip];
                    // SAFETY: as above.
                    correction[qh] =
                        unsafe { M::softmax(row, &mut running_max[qh], &mut denom[qh]) };
                }
                // The V pass: the first block rescales the accumulated output once.
                for (b, &block) in chunk.iter().enumerate() {
                    let next = reads.get(read + PREFETCH_AHEAD).copied();
                    read += 1;
                    let v_block = &self.v_cache[block as usize * block_len..][..block_len];
                    for (part, &(h0, hn)) in subgroups.iter().enumerate() {
                        let fetch = fetch_part(next, part);
                        let rows = head_rows(v_block, b, h0);
                        let p = &scores[h0 * chunk_cap + b * bs + skip_of(first + b)..];
                        let scale_by = if b == 0 { &correction } else { &ones };
                        let (acc, scale_by) = (&mut acc[h0 * d..][..hn * d], &scale_by[h0..][..hn]);
                        // SAFETY: as above.
                        unsafe { M::accumulate_group(acc, p, chunk_cap, scale_by, &rows, fetch) };
                    }
                }
            }
            if segment.whole {
                for qh in 0..s.num_heads {
                    let inv = 1.0 / denom[qh];
                    acc[qh * d..][..d].iter_mut().for_each(|a| *a *= inv);
                }
            } else {
                partials.push(Partial {
                    seq,
                    acc: acc.to_vec(),
                    running_max: running_max.clone(),
                    denom: denom.clone(),
                });
            }
        }
    }
}

/// The query heads in runs `(first head, count)` of at most [`MAX_SHARED_HEADS`] that read the
/// same KV head, the runs of one KV head as even as can be (a group of 4 goes as 2 + 2, of 7 as
/// 3 + 2 + 2), in order: `num_kv_heads` groups of `group` consecutive query heads.
fn head_subgroups(num_kv_heads: usize, group: usize) -> Vec<(usize, usize)> {
    let runs = group.div_ceil(MAX_SHARED_HEADS);
    let mut out = Vec::with_capacity(num_kv_heads * runs);
    for kvh in 0..num_kv_heads {
        let mut first = kvh * group;
        for r in 0..runs {
            let count = group / runs + usize::from(r < group % runs);
            out.push((first, count));
            first += count;
        }
    }
    out
}

/// The most query heads whose scores and values one pass over a KV head's rows computes: each
/// key's (value's) vectors are loaded once for all of them, and their 4 x 3 accumulators (4
/// keys, or 4 vectors of dims, per head) are twelve independent FMA chains where one head alone
/// had eight, which two FMA units of 4-cycle latency only just keep busy. Three heads fill
/// AVX2's 16 registers. SmolLM2's 9 query heads over 3 KV heads, Zen 3, one thread, 2048 keys:
/// 1.34x the per-head math (session 22).
const MAX_SHARED_HEADS: usize = 3;

/// One block's math, per instruction set. The methods are `unsafe` because the SIMD ones may
/// only run where `Kernel::run_segments` sends them (a CPU with their features, a head_dim they
/// take); the portable ones are safe to call anywhere.
trait BlockMath {
    /// `out[j] = scale * s_j * (q . row j)` for `j < k.n`, `s_j` row j's
    /// [`KvElement::head_scale`] (1 for the unscaled types).
    unsafe fn scores<E: KvElement>(q: &[f32], k: &Rows<'_, E>, scale: f32, out: &mut [f32]);
    /// Folds one block's scores into one query head's running max / denominator: turns `row`
    /// into the block's softmax weights and returns the factor the accumulated output must be
    /// scaled by.
    unsafe fn softmax(row: &mut [f32], running_max: &mut f32, denom: &mut f32) -> f32;
    /// `acc = acc * correction + sum_j p[j] * s_j * row j` for `j < v.n` (`s_j` as in
    /// [`Self::scores`]).
    unsafe fn accumulate<E: KvElement>(
        acc: &mut [f32],
        p: &[f32],
        correction: f32,
        v: &Rows<'_, E>,
    );
    /// Asks the CPU to start loading `data` (a hint; nothing on the portable path).
    fn prefetch<E>(_data: &[E]) {}

    /// [`Self::scores`] for `heads` query heads that share `k`'s KV head: `q` is theirs
    /// (`[heads, D]`), head `h`'s scores go to `out[h * out_stride..][..k.n]`. Prefetches
    /// `fetch` meanwhile. Two or three heads go through [`Self::scores_shared`], other counts
    /// one head at a time.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_group<E: KvElement>(
        heads: usize,
        q: &[f32],
        k: &Rows<'_, E>,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
        fetch: &[E],
    ) {
        match heads {
            2 => Self::scores_shared::<E, 2>(q, k, scale, out, out_stride, fetch),
            3 => Self::scores_shared::<E, 3>(q, k, scale, out, out_stride, fetch),
            _ => Self::scores_each(heads, q, k, scale, out, out_stride, fetch),
        }
    }

    /// [`Self::scores_group`] for `H` heads that share each key's loads (the x86 math); one
    /// head at a time by default.
    #[inline(always)]
    unsafe fn scores_shared<E: KvElement, const H: usize>(
        q: &[f32],
        k: &Rows<'_, E>,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
        fetch: &[E],
    ) {
        Self::scores_each(H, q, k, scale, out, out_stride, fetch);
    }

    /// [`Self::scores_group`] one head at a time, `fetch` prefetched first.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_each<E: KvElement>(
        heads: usize,
        q: &[f32],
        k: &Rows<'_, E>,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
        fetch: &[E],
    ) {
        Self::prefetch(fetch);
        for h in 0..heads {
            let out = &mut out[h * out_stride..][..k.n];
            Self::scores(&q[h * k.d..][..k.d], k, scale, out);
        }
    }

    /// [`Self::accumulate`] for `heads` query heads that share `v`'s KV head: `acc` is theirs
    /// (`[heads, D]`), head `h`'s weights are `p[h * p_stride..][..v.n]`, its factor
    /// `correction[h]`. Prefetches `fetch` meanwhile. Two or three heads go through
    /// [`Self::accumulate_shared`], other counts one head at a time.
    #[inline(always)]
    unsafe fn accumulate_group<E: KvElement>(
        acc: &mut [f32],
        p: &[f32],
        p_stride: usize,
        correction: &[f32],
        v: &Rows<'_, E>,
        fetch: &[E],
    ) {
        match *correction {
            [a, b] => Self::accumulate_shared::<E, 2>(acc, p, p_stride, [a, b], v, fetch),
            [a, b, c] => Self::accumulate_shared::<E, 3>(acc, p, p_stride, [a, b, c], v, fetch),
            _ => Self::accumulate_each(acc, p, p_stride, correction, v, fetch),
        }
    }

    /// [`Self::accumulate_group`] for `H` heads that share each value's loads (the x86 math);
    /// one head at a time by default.
    #[inline(always)]
    unsafe fn accumulate_shared<E: KvElement, const H: usize>(
        acc: &mut [f32],
        p: &[f32],
        p_stride: usize,
        correction: [f32; H],
        v: &Rows<'_, E>,
        fetch: &[E],
    ) {
        Self::accumulate_each(acc, p, p_stride, &correction, v, fetch);
    }

    /// [`Self::accumulate_group`] one head at a time, `fetch` prefetched first.
    #[inline(always)]
    unsafe fn accumulate_each<E: KvElement>(
        acc: &mut [f32],
        p: &[f32],
        p_stride: usize,
        correction: &[f32],
        v: &Rows<'_, E>,
        fetch: &[E],
    ) {
        Self::prefetch(fetch);
        for (h, &factor) in correction.iter().enumerate() {
            let (acc, p) = (&mut acc[h * v.d..][..v.d], &p[h * p_stride..][..v.n]);
            Self::accumulate(acc, p, factor, v);
        }
    }
}

/// The `n` rows of one KV head inside a block: row `j` is `block[offset + j * stride..][..d]`,
/// its scale (a scaled type) right after it. Holds `offset + (n - 1) * stride + d + ROW_EXTRA
/// <= block.len()` (true for every head of a validated block: with head rows of `R = D +
/// ROW_EXTRA` elements, `offset <= (Hkv - 1) * R`, `stride = Hkv * R`, `n <= block_size`).
struct Rows<'a, E> {
    block: &'a [E],
    offset: usize,
    stride: usize,
    n: usize,
    d: usize,
}

impl<E> Rows<'_, E> {
    #[inline(always)]
    fn row(&self, j: usize) -> &[E] {
        &self.block[self.offset + j * self.stride..][..self.d]
    }
}

impl<E: KvElement> Rows<'_, E> {
    /// Row `j`'s [`KvElement::head_scale`] (1 for the unscaled types).
    #[inline(always)]
    fn scale(&self, j: usize) -> f32 {
        E::head_scale(
            &self.block[self.offset + j * self.stride..][..self.d + E::ROW_EXTRA],
            self.d,
        )
    }
}

/// [`BlockMath::softmax`] in plain Rust (the portable path, and the reference of the SIMD ones).
#[inline(always)]
fn softmax_update(row: &mut [f32], running_max: &mut f32, denom: &mut f32) -> f32 {
    let block_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let new_max = running_max.max(block_max);
    let correction = exp(*running_max - new_max);
    *running_max = new_max;
    row.iter_mut().for_each(|p| *p = exp(*p - new_max));
    *denom = *denom * correction + row.iter().sum::<f32>();
    correction
}

/// Plain-Rust block math (any CPU, any head_dim); the compiler vectorizes what it can.
mod portable {
    use super::Rows;
    use crate::cpu_kv::KvElement;

    pub(super) struct Math;

    // The math itself (no `target_feature` to keep it behind, unlike the AVX2 module's).
    impl super::BlockMath for Math {
        #[inline(always)]
        unsafe fn scores<E: KvElement>(q: &[f32], k: &Rows<'_, E>, scale: f32, out: &mut [f32]) {
            for (j, o) in out.iter_mut().enumerate().take(k.n) {
                *o = dot(q, k.row(j)) * (scale * k.scale(j));
            }
        }
        #[inline(always)]
        unsafe fn softmax(row: &mut [f32], running_max: &mut f32, denom: &mut f32) -> f32 {
            super::softmax_update(row, running_max, denom)
        }
        #[inline(always)]
        unsafe fn accumulate<E: KvElement>(
            acc: &mut [f32],
            p: &[f32],
            correction: f32,
            v: &Rows<'_, E>,
        ) {
            if correction != 1.0 {
                acc.iter_mut().for_each(|a| *a *= correction);
            }
            for (j, &w) in p.iter().enumerate().take(v.n) {
                let w = w * v.scale(j);
                for (a, x) in acc.iter_mut().zip(v.row(j)) {
                    *a += w * x.to_f32();
                }
            }
        }
    }

    /// Dot product with 8 independent accumulators (order differs from a serial sum).
    #[inline(always)]
    fn dot<E: KvElement>(a: &[f32], b: &[E]) -> f32 {
        let mut lanes = [0f32; 8];
        let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
        let tail: f32 = a8
            .remainder()
            .iter()
            .zip(b8.remainder())
            .map(|(x, y)| x * y.to_f32())
            .sum();
        for (x, y) in a8.zip(b8) {
            let (x, y): (&[f32; 8], &[E; 8]) = (x.try_into().unwrap(), y.try_into().unwrap());
            for l in 0..8 {
                lanes[l] += x[l] * y[l].to_f32();
            }
        }
        lanes.iter().sum::<f32>() + tail
    }
}

/// AVX2 + FMA block math for `head_dim % 8 == 0` ([`lanes`] at eight lanes), and the softmax,
/// prefetch and horizontal sums the AVX-512 math shares.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{lanes, Rows};
    use crate::cpu_exp::{avx2::exp8, exp};
    use crate::cpu_kv::KvElement;
    use std::arch::x86_64::*;

    pub(super) struct Math;

    // Each method is inlined into `run_segments_avx2` (compiled for AVX2 + FMA + F16C; no
    // `target_feature` on trait methods): the shared x86 math at eight lanes, this module's
    // softmax and prefetch.
    impl super::BlockMath for Math {
        #[inline(always)]
        unsafe fn scores<E: KvElement>(q: &[f32], k: &Rows<'_, E>, scale: f32, out: &mut [f32]) {
            lanes::block_scores::<lanes::Avx2, E>(q, k, scale, out);
        }
        #[inline(always)]
        unsafe fn softmax(row: &mut [f32], running_max: &mut f32, denom: &mut f32) -> f32 {
            softmax_update(row, running_max, denom)
        }
        #[inline(always)]
        unsafe fn accumulate<E: KvElement>(
            acc: &mut [f32],
            p: &[f32],
            correction: f32,
            v: &Rows<'_, E>,
        ) {
            lanes::block_accumulate::<lanes::Avx2, E>(acc, p, correction, v);
        }
        #[inline(always)]
        fn prefetch<E>(data: &[E]) {
            prefetch(data);
        }
        #[inline(always)]
        unsafe fn scores_shared<E: KvElement, const H: usize>(
            q: &[f32],
            k: &Rows<'_, E>,
            scale: f32,
            out: &mut [f32],
            out_stride: usize,
            fetch: &[E],
        ) {
            lanes::group_scores::<lanes::Avx2, E, H>(q, k, scale, out, out_stride, fetch);
        }
        #[inline(always)]
        unsafe fn accumulate_shared<E: KvElement, const H: usize>(
            acc: &mut [f32],
            p: &[f32],
            p_stride: usize,
            correction: [f32; H],
            v: &Rows<'_, E>,
            fetch: &[E],
        ) {
            lanes::group_accumulate::<lanes::Avx2, E, H>(acc, p, p_stride, correction, v, fetch);
        }
    }

    /// Asks the CPU to start loading every cache line of `data` into L2, not L1: the next
    /// block's K and V (24 KiB for SmolLM2) would evict the current block's from a 32–48 KiB L1
    /// while it is still being read (measured: T0 -> T1 made 30 layers' attention 1.07–1.10x
    /// faster on the AVX-512 Xeon; lookahead of 2 or 3 blocks changed nothing).
    #[inline(always)]
    pub(super) fn prefetch<E>(data: &[E]) {
        let (base, bytes) = (data.as_ptr().cast::<i8>(), std::mem::size_of_val(data));
        // one hint per 64-byte line, a plain pointer walk (a `chunks(16)` loop cost ~8
        // instructions per line: 15 % of the kernel's time with the data already in cache)
        let mut offset = 0;
        while offset < bytes {
            // SAFETY: a prefetch is only a hint; the address is inside `data`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.add(offset)) };
            offset += 64;
        }
    }

    /// [`super::BlockMath::softmax`] eight scores at a time (the same polynomial `exp`, rounding
    /// `n` half to even instead of away from zero: either keeps `|r| <= ln2 / 2`).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn softmax_update(
        row: &mut [f32],
        running_max: &mut f32,
        denom: &mut f32,
    ) -> f32 {
        let n = row.len();
        let full = n / 8 * 8;
        let p = row.as_mut_ptr();
        let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in (0..full).step_by(8) {
            vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p.add(c)));
        }
        let mut block_max = hmax(vmax);
        for &x in &row[full..] {
            block_max = block_max.max(x);
        }
        let new_max = running_max.max(block_max);
        let correction = exp(*running_max - new_max);
        *running_max = new_max;
        let (shift, mut vsum) = (_mm256_set1_ps(new_max), _mm256_setzero_ps());
        for c in (0..full).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(c)), shift));
            _mm256_storeu_ps(p.add(c), e);
            vsum = _mm256_add_ps(vsum, e);
        }
        let mut sum = hsum(vsum);
        for x in &mut row[full..] {
            *x = exp(*x - new_max);
            sum += *x;
        }
        *denom = *denom * correction + sum;
        correction
    }

    /// The largest of the eight lanes of `v`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        _mm_cvtss_f32(m)
    }

    /// The eight horizontal sums of `v[0..8]`, in order, as one vector.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn hsum8(v: &[__m256; 8]) -> __m256 {
        let t0 = _mm256_hadd_ps(v[0], v[1]);
        let t1 = _mm256_hadd_ps(v[2], v[3]);
        let t2 = _mm256_hadd_ps(v[4], v[5]);
        let t3 = _mm256_hadd_ps(v[6], v[7]);
        let u0 = _mm256_hadd_ps(t0, t1); // [s0..s3 of the low halves | s0..s3 of the high halves]
        let u1 = _mm256_hadd_ps(t2, t3); // the same for s4..s7
        let lo = _mm256_permute2f128_ps(u0, u1, 0x20);
        let hi = _mm256_permute2f128_ps(u0, u1, 0x31);
        _mm256_add_ps(lo, hi)
    }

    /// The four horizontal sums of `v[0..4]`, in order, as one vector.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn hsum4(v: &[__m256; 4]) -> __m128 {
        let t0 = _mm256_hadd_ps(v[0], v[1]);
        let t1 = _mm256_hadd_ps(v[2], v[3]);
        let u = _mm256_hadd_ps(t0, t1); // [s0..s3 of the low halves | s0..s3 of the high halves]
        _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1))
    }

    /// The sum of the eight lanes of `v`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

/// AVX-512 block math for `head_dim % 16 == 0`: [`lanes`] at sixteen lanes; the softmax and
/// the prefetch are the AVX2 module's.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{avx2, lanes, Rows};
    use crate::cpu_kv::KvElement;

    pub(super) struct Math;

    // Inlined into `run_segments_avx512` (compiled for AVX-512F, AVX2, FMA and F16C).
    impl super::BlockMath for Math {
        #[inline(always)]
        unsafe fn scores<E: KvElement>(q: &[f32], k: &Rows<'_, E>, scale: f32, out: &mut [f32]) {
            lanes::block_scores::<lanes::Avx512, E>(q, k, scale, out);
        }
        #[inline(always)]
        unsafe fn softmax(row: &mut [f32], running_max: &mut f32, denom: &mut f32) -> f32 {
            avx2::softmax_update(row, running_max, denom)
        }
        #[inline(always)]
        unsafe fn accumulate<E: KvElement>(
            acc: &mut [f32],
            p: &[f32],
            correction: f32,
            v: &Rows<'_, E>,
        ) {
            lanes::block_accumulate::<lanes::Avx512, E>(acc, p, correction, v);
        }
        #[inline(always)]
        fn prefetch<E>(data: &[E]) {
            avx2::prefetch(data);
        }
        #[inline(always)]
        unsafe fn scores_shared<E: KvElement, const H: usize>(
            q: &[f32],
            k: &Rows<'_, E>,
            scale: f32,
            out: &mut [f32],
            out_stride: usize,
            fetch: &[E],
        ) {
            lanes::group_scores::<lanes::Avx512, E, H>(q, k, scale, out, out_stride, fetch);
        }
        #[inline(always)]
        unsafe fn accumulate_shared<E: KvElement, const H: usize>(
            acc: &mut [f32],
            p: &[f32],
            p_stride: usize,
            correction: [f32; H],
            v: &Rows<'_, E>,
            fetch: &[E],
        ) {
            lanes::group_accumulate::<lanes::Avx512, E, H>(acc, p, p_stride, correction, v, fetch);
        }
    }
}

/// The x86 block math once for both vector widths: [`Lanes`] is one width's operations (AVX2:
/// 8 lanes, AVX-512: 16), each `#[inline(always)]` so that it compiles into the
/// `target_feature` entry (`run_segments_avx2` / `_avx512`) it ends up in, like the functions
/// generic over it. Safety: each is only reached from the entry of its width (`BlockMath`).
#[cfg(target_arch = "x86_64")]
mod lanes {
    use super::{avx2, Rows};
    use crate::cpu_kv::KvElement;
    use std::arch::x86_64::*;

    pub(super) trait Lanes {
        type V: Copy;
        /// f32 lanes per vector
        const N: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn splat(x: f32) -> Self::V;
        unsafe fn load(p: *const f32) -> Self::V;
        unsafe fn load_kv<E: KvElement>(p: *const E) -> Self::V;
        unsafe fn store(p: *mut f32, v: Self::V);
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
        unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
        /// The vector's lanes summed down to eight (for [`avx2::hsum8`]).
        unsafe fn fold8(v: Self::V) -> __m256;
    }

    pub(super) struct Avx2;
    pub(super) struct Avx512;

    impl Lanes for Avx2 {
        type V = __m256;
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_kv<E: KvElement>(p: *const E) -> __m256 {
            E::load8(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn fold8(v: __m256) -> __m256 {
            v
        }
    }

    impl Lanes for Avx512 {
        type V = __m512;
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_kv<E: KvElement>(p: *const E) -> __m512 {
            E::load16(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn fold8(v: __m512) -> __m256 {
            _mm256_add_ps(
                _mm512_castps512_ps256(v),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
            )
        }
    }

    /// `out[j] = scale * s_j * (q . row j)` for `j < k.n` (`s_j`: `BlockMath::scores`), eight
    /// keys at a time (one accumulator per key, reduced together by one horizontal-add tree),
    /// `L::N` dimensions per FMA.
    #[inline(always)]
    pub(super) unsafe fn block_scores<L: Lanes, E: KvElement>(
        q: &[f32],
        k: &Rows<'_, E>,
        scale: f32,
        out: &mut [f32],
    ) {
        let d = q.len();
        debug_assert!(d.is_multiple_of(L::N) && d == k.d && out.len() >= k.n);
        debug_assert!(
            k.n == 0 || k.offset + (k.n - 1) * k.stride + d + E::ROW_EXTRA <= k.block.len()
        );
        let base = k.block.as_ptr().add(k.offset);
        let mut j = 0;
        while j + 8 <= k.n {
            let mut acc = [L::zero(); 8];
            for c in (0..d).step_by(L::N) {
                let qv = L::load(q.as_ptr().add(c));
                for (jj, a) in acc.iter_mut().enumerate() {
                    *a = L::fma(qv, L::load_kv(base.add((j + jj) * k.stride + c)), *a);
                }
            }
            // a loop, not `acc.map(..)`: the closure would not inherit the caller's target
            // features, so `fold8`'s intrinsics would be called out of line (they were: 3x the
            // kernel's own time, `perf`, session 18)
            let mut folded = [_mm256_setzero_ps(); 8];
            for (f, &a) in folded.iter_mut().zip(&acc) {
                *f = L::fold8(a);
            }
            let sums = avx2::hsum8(&folded);
            let scales = key_scales::<E, 8>(base, j, k.stride, d, scale);
            _mm256_storeu_ps(
                out.as_mut_ptr().add(j),
                _mm256_mul_ps(sums, _mm256_loadu_ps(scales.as_ptr())),
            );
            j += 8;
        }
        for (jj, o) in out.iter_mut().enumerate().take(k.n).skip(j) {
            let mut acc = L::zero();
            for c in (0..d).step_by(L::N) {
                let kv = L::load_kv(base.add(jj * k.stride + c));
                acc = L::fma(L::load(q.as_ptr().add(c)), kv, acc);
            }
            *o = avx2::hsum(L::fold8(acc)) * (scale * E::head_scale_at(base.add(jj * k.stride), d));
        }
    }

    /// `scale` times the [`KvElement::head_scale`] of rows `j..j + K` (`base`'s rows, `stride`
    /// apart): what keys `j..j + K`'s dot products are multiplied by. Just `scale` for the
    /// unscaled types (the products by 1 fold away). Reading each row's scale here, right after
    /// the row, costs next to nothing; a separate pass over a chunk's rows before the V pass
    /// stalled on every V row's line (40 % of the int8 kernel's time, `perf`, session 47).
    #[inline(always)]
    unsafe fn key_scales<E: KvElement, const K: usize>(
        base: *const E,
        j: usize,
        stride: usize,
        d: usize,
        scale: f32,
    ) -> [f32; K] {
        let mut scales = [scale; K];
        if E::ROW_EXTRA > 0 {
            for (jj, s) in scales.iter_mut().enumerate() {
                *s *= E::head_scale_at(base.add((j + jj) * stride), d);
            }
        }
        scales
    }

    /// `acc = acc * correction + sum_j p[j] * s_j * row j` for `j < v.n`, in chunks of 8, 4 and
    /// 1 registers held across the keys.
    #[inline(always)]
    pub(super) unsafe fn block_accumulate<L: Lanes, E: KvElement>(
        acc: &mut [f32],
        p: &[f32],
        correction: f32,
        v: &Rows<'_, E>,
    ) {
        let d = acc.len();
        debug_assert!(d.is_multiple_of(L::N) && d == v.d && p.len() >= v.n);
        debug_assert!(
            v.n == 0 || v.offset + (v.n - 1) * v.stride + d + E::ROW_EXTRA <= v.block.len()
        );
        let mut c0 = 0;
        while c0 + 8 * L::N <= d {
            accumulate_chunk::<L, 8, E>(acc, c0, p, correction, v);
            c0 += 8 * L::N;
        }
        while c0 + 4 * L::N <= d {
            accumulate_chunk::<L, 4, E>(acc, c0, p, correction, v);
            c0 += 4 * L::N;
        }
        while c0 < d {
            accumulate_chunk::<L, 1, E>(acc, c0, p, correction, v);
            c0 += L::N;
        }
    }

    /// Dims `c0..c0 + W * L::N` of `block_accumulate`, held in W registers across the keys.
    #[inline(always)]
    unsafe fn accumulate_chunk<L: Lanes, const W: usize, E: KvElement>(
        acc: &mut [f32],
        c0: usize,
        p: &[f32],
        correction: f32,
        v: &Rows<'_, E>,
    ) {
        let out = acc.as_mut_ptr().add(c0);
        let corr = L::splat(correction);
        let mut a = [L::zero(); W];
        for (t, r) in a.iter_mut().enumerate() {
            *r = L::mul(L::load(out.add(L::N * t)), corr);
        }
        let rows = v.block.as_ptr().add(v.offset);
        for (j, &w) in p.iter().enumerate().take(v.n) {
            let first = rows.add(j * v.stride);
            let wv = L::splat(w * E::head_scale_at(first, v.d));
            let row = first.add(c0);
            for (t, r) in a.iter_mut().enumerate() {
                *r = L::fma(wv, L::load_kv(row.add(L::N * t)), *r);
            }
        }
        for (t, r) in a.iter().enumerate() {
            L::store(out.add(L::N * t), *r);
        }
    }

    /// Prefetches the lines of a slice into L2 a few at a time, spread over a loop's steps
    /// (a burst of a whole run's lines measured slower at DRAM-resident contexts).
    struct Spread {
        next: *const i8,
        end: *const i8,
        per_step: usize,
    }

    impl Spread {
        /// `data`'s lines over `steps` calls of [`Spread::step`].
        #[inline(always)]
        fn new<E>(data: &[E], steps: usize) -> Self {
            let (next, bytes) = (data.as_ptr().cast::<i8>(), std::mem::size_of_val(data));
            Spread {
                next,
                end: next.wrapping_add(bytes),
                per_step: bytes.div_ceil(64).div_ceil(steps.max(1)),
            }
        }

        /// The next `per_step` lines (fewer at the end).
        #[inline(always)]
        fn step(&mut self) {
            for _ in 0..self.per_step {
                if self.next >= self.end {
                    return;
                }
                // SAFETY: a prefetch is only a hint; the address is inside the slice.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(self.next) };
                self.next = self.next.wrapping_add(64);
            }
        }

        /// Whatever lines are left.
        #[inline(always)]
        fn finish(&mut self) {
            self.per_step = usize::MAX;
            self.step();
        }
    }

    /// `out[h * out_stride + j] = scale * s_j * (q[h] . row j)` for `H` query heads (`q`: `[H,
    /// D]`) and `j < k.n`: four keys at a time, each key vector loaded once for the `H` heads,
    /// whose `4 * H` accumulators are independent FMA chains.
    #[inline(always)]
    pub(super) unsafe fn group_scores<L: Lanes, E: KvElement, const H: usize>(
        q: &[f32],
        k: &Rows<'_, E>,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
        fetch: &[E],
    ) {
        let d = k.d;
        let mut fetch = Spread::new(fetch, k.n / 4 * (d / L::N));
        debug_assert!(d.is_multiple_of(L::N));
        // the raw writes below stay inside `out` (one compare per block and run of heads)
        assert!(q.len() == H * d && out.len() >= (H - 1) * out_stride + k.n);
        debug_assert!(
            k.n == 0 || k.offset + (k.n - 1) * k.stride + d + E::ROW_EXTRA <= k.block.len()
        );
        let (base, qp, op) = (k.block.as_ptr().add(k.offset), q.as_ptr(), out.as_mut_ptr());
        let mut j = 0;
        while j + 4 <= k.n {
            let mut acc = [[L::zero(); 4]; H];
            for c in (0..d).step_by(L::N) {
                fetch.step();
                for jj in 0..4 {
                    let kv = L::load_kv(base.add((j + jj) * k.stride + c));
                    for (h, a) in acc.iter_mut().enumerate() {
                        a[jj] = L::fma(L::load(qp.add(h * d + c)), kv, a[jj]);
                    }
                }
            }
            let scales = _mm_loadu_ps(key_scales::<E, 4>(base, j, k.stride, d, scale).as_ptr());
            for (h, a) in acc.iter().enumerate() {
                // a loop, not `map`: see `block_scores`
                let mut folded = [_mm256_setzero_ps(); 4];
                for (f, &v) in folded.iter_mut().zip(a) {
                    *f = L::fold8(v);
                }
                let sums = _mm_mul_ps(avx2::hsum4(&folded), scales);
                _mm_storeu_ps(op.add(h * out_stride + j), sums);
            }
            j += 4;
        }
        for jj in j..k.n {
            let row = base.add(jj * k.stride);
            let row_scale = scale * E::head_scale_at(row, d);
            for h in 0..H {
                let mut acc = L::zero();
                for c in (0..d).step_by(L::N) {
                    acc = L::fma(L::load(qp.add(h * d + c)), L::load_kv(row.add(c)), acc);
                }
                *op.add(h * out_stride + jj) = avx2::hsum(L::fold8(acc)) * row_scale;
            }
        }
        fetch.finish();
    }

    /// `acc[h] = acc[h] * correction[h] + sum_j p[h * p_stride + j] * s_j * row j` for `H`
    /// query heads (`acc`: `[H, D]`) and `j < v.n`, in chunks of 4 and 1 registers per head held
    /// across the keys: each value vector is loaded once for the `H` heads.
    #[inline(always)]
    pub(super) unsafe fn group_accumulate<L: Lanes, E: KvElement, const H: usize>(
        acc: &mut [f32],
        p: &[f32],
        p_stride: usize,
        correction: [f32; H],
        v: &Rows<'_, E>,
        fetch: &[E],
    ) {
        let d = v.d;
        let passes = d / (4 * L::N) + d % (4 * L::N) / L::N;
        let mut fetch = Spread::new(fetch, passes * v.n);
        debug_assert!(d.is_multiple_of(L::N));
        // the raw reads and writes below stay inside `acc` and `p`
        assert!(acc.len() == H * d && p.len() >= (H - 1) * p_stride + v.n);
        debug_assert!(
            v.n == 0 || v.offset + (v.n - 1) * v.stride + d + E::ROW_EXTRA <= v.block.len()
        );
        let mut c0 = 0;
        while c0 + 4 * L::N <= d {
            group_accumulate_chunk::<L, 4, E, H>(acc, c0, p, p_stride, correction, v, &mut fetch);
            c0 += 4 * L::N;
        }
        while c0 < d {
            group_accumulate_chunk::<L, 1, E, H>(acc, c0, p, p_stride, correction, v, &mut fetch);
            c0 += L::N;
        }
        fetch.finish();
    }

    /// Dims `c0..c0 + W * L::N` of `group_accumulate`, held in `W * H` registers.
    #[inline(always)]
    unsafe fn group_accumulate_chunk<L: Lanes, const W: usize, E: KvElement, const H: usize>(
        acc: &mut [f32],
        c0: usize,
        p: &[f32],
        p_stride: usize,
        correction: [f32; H],
        v: &Rows<'_, E>,
        fetch: &mut Spread,
    ) {
        let d = v.d;
        let out = acc.as_mut_ptr().add(c0);
        let mut a = [[L::zero(); W]; H];
        for (h, regs) in a.iter_mut().enumerate() {
            let factor = L::splat(correction[h]);
            for (t, r) in regs.iter_mut().enumerate() {
                *r = L::mul(L::load(out.add(h * d + L::N * t)), factor);
            }
        }
        let (rows, pp) = (v.block.as_ptr().add(v.offset), p.as_ptr());
        for j in 0..v.n {
            fetch.step();
            let first = rows.add(j * v.stride);
            let row_scale = E::head_scale_at(first, d);
            let row = first.add(c0);
            let mut w = [L::zero(); H];
            for (h, wv) in w.iter_mut().enumerate() {
                *wv = L::splat(*pp.add(h * p_stride + j) * row_scale);
            }
            for t in 0..W {
                let x = L::load_kv(row.add(L::N * t));
                for (regs, &wv) in a.iter_mut().zip(&w) {
                    regs[t] = L::fma(wv, x, regs[t]);
                }
            }
        }
        for (h, regs) in a.iter().enumerate() {
            for (t, r) in regs.iter().enumerate() {
                L::store(out.add(h * d + L::N * t), *r);
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

    /// Naive two-pass softmax attention, in f64, over the same layout: row `s` over keys
    /// `starts[s]..ctx[s]` (all of them without `starts`).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        s: &DecodeShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        bt: &[i32],
        ctx: &[i32],
        starts: Option<&[i32]>,
        scale: f32,
    ) -> Vec<f32> {
        let d = s.head_dim;
        let group = s.num_heads / s.num_kv_heads;
        let mut out = vec![0f32; q.len()];
        for seq in 0..s.num_seqs {
            for h in 0..s.num_heads {
                let kvh = h / group;
                let qv = &q[(seq * s.num_heads + h) * d..][..d];
                let slot = |t: usize| {
                    let block = bt[seq * s.max_blocks_per_seq + t / s.block_size] as usize;
                    ((block * s.block_size + t % s.block_size) * s.num_kv_heads + kvh) * d
                };
                let keys = starts.map_or(0, |st| st[seq] as usize)..ctx[seq] as usize;
                let logits: Vec<f64> = keys
                    .clone()
                    .map(|t| {
                        (0..d)
                            .map(|i| qv[i] as f64 * k[slot(t) + i] as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for i in 0..d {
                    let o: f64 = keys
                        .clone()
                        .zip(&w)
                        .map(|(t, w)| w * v[slot(t) + i] as f64)
                        .sum::<f64>()
                        / z;
                    out[(seq * s.num_heads + h) * d + i] = o as f32;
                }
            }
        }
        out
    }

    /// A window's first key for a row of `ctx` keys, of kind `kind % 6`: 0, mid-block, on a
    /// block boundary, the last key, anywhere, or the first of a `block_size + 3` key window.
    fn window_start(rng: &mut Lcg, kind: usize, ctx: usize, block_size: usize) -> i32 {
        let start = match kind % 6 {
            0 => 0,
            1 => {
                // inside a block, not at its first key (when the row has such a key)
                let mid: Vec<usize> = (1..ctx).filter(|t| t % block_size != 0).collect();
                if mid.is_empty() {
                    0
                } else {
                    mid[rng.below(mid.len())]
                }
            }
            2 => {
                // the first key of a block past the first (when the row has one)
                let boundaries = (ctx - 1) / block_size;
                if boundaries == 0 {
                    0
                } else {
                    (1 + rng.below(boundaries)) * block_size
                }
            }
            3 => ctx - 1,
            4 => rng.below(ctx),
            _ => ctx.saturating_sub(block_size + 3),
        };
        start as i32
    }

    /// Sets the K and V rows of every key a window leaves out (`0..starts[s]` of row `s`: the
    /// blocks before its first and the rows before the start inside it) to NaN, in every KV
    /// head: any read of them would reach the output. The rows' blocks must be their own.
    fn poison_outside_windows(
        s: &DecodeShape,
        (k, v): (&mut [f32], &mut [f32]),
        bt: &[i32],
        starts: &[i32],
    ) {
        let row = s.num_kv_heads * s.head_dim;
        for (seq, &start) in starts.iter().enumerate() {
            for t in 0..start as usize {
                let block = bt[seq * s.max_blocks_per_seq + t / s.block_size] as usize;
                let at = (block * s.block_size + t % s.block_size) * row;
                k[at..at + row].fill(f32::NAN);
                v[at..at + row].fill(f32::NAN);
            }
        }
    }

    /// Random inputs against [`reference`] on every instruction-set path, and the f16, FP8 and
    /// int8 caches against the f32 cache of their values. `windowed`: each row gets a window
    /// (`window_start`, kinds cycling over the rows), the keys outside it poisoned.
    #[allow(clippy::too_many_arguments)]
    fn case(
        seed: u64,
        num_seqs: usize,
        heads: (usize, usize),
        head_dim: usize,
        block_size: usize,
        threads: usize,
        windowed: bool,
    ) {
        let mut rng = Lcg(seed);
        let (num_heads, num_kv_heads) = heads;
        let num_blocks = 64;
        let max_blocks = 6;
        let shape = DecodeShape {
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            num_blocks,
            block_size,
            max_blocks_per_seq: max_blocks,
        };
        let cache_len = num_blocks * block_size * num_kv_heads * head_dim;
        let mut k: Vec<f32> = (0..cache_len).map(|_| rng.next_f32() * 3.0).collect();
        let mut v: Vec<f32> = (0..cache_len).map(|_| rng.next_f32()).collect();
        let q: Vec<f32> = (0..num_seqs * num_heads * head_dim)
            .map(|_| rng.next_f32())
            .collect();
        let ctx: Vec<i32> = (0..num_seqs)
            .map(|_| 1 + rng.below(max_blocks * block_size) as i32)
            .collect();
        // shuffled, distinct block ids (the tail of a row past the context stays -1: never read)
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let mut bt = vec![-1i32; num_seqs * max_blocks];
        let mut next = 0;
        for seq in 0..num_seqs {
            for b in 0..(ctx[seq] as usize).div_ceil(block_size) {
                bt[seq * max_blocks + b] = ids[next % num_blocks];
                next += 1;
            }
        }
        let starts: Option<Vec<i32>> = windowed.then(|| {
            let kind0 = rng.below(6);
            (0..num_seqs)
                .map(|seq| window_start(&mut rng, kind0 + seq, ctx[seq] as usize, block_size))
                .collect()
        });
        if let Some(starts) = &starts {
            assert!(next <= num_blocks, "each row's blocks its own");
            poison_outside_windows(&shape, (&mut k, &mut v), &bt, starts);
        }
        let starts = starts.as_deref();
        let scale = 1.0 / (head_dim as f32).sqrt();
        let want = reference(&shape, &q, &k, &v, &bt, &ctx, starts, scale);
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            let mut out = vec![f32::NAN; q.len()];
            run(
                &shape, &q, &k, &v, &bt, &ctx, starts, &mut out, scale, threads, isa,
            )
            .unwrap();
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 + 1e-4 * b.abs(),
                    "{isa:?} (ran {:?}) starts {starts:?} ctx {ctx:?} element {i}: {a} vs {b}",
                    Isa::detect(isa)
                );
            }
        }
        // An f16 or FP8 cache gives exactly what the f32 cache holding the same (rounded) values
        // gives: the kernel converts each element on load and computes in f32 alike.
        fn rounded_cache_reads_as_its_values<E: KvElement>(
            shape: &DecodeShape,
            (q, k, v): (&[f32], &[f32], &[f32]),
            (bt, ctx, starts): (&[i32], &[i32], Option<&[i32]>),
            scale: f32,
            threads: usize,
        ) {
            let (k_e, v_e): (Vec<E>, Vec<E>) = (
                k.iter().map(|&x| E::from_f32(x)).collect(),
                v.iter().map(|&x| E::from_f32(x)).collect(),
            );
            let (k_rounded, v_rounded): (Vec<f32>, Vec<f32>) = (
                k_e.iter().map(|x| x.to_f32()).collect(),
                v_e.iter().map(|x| x.to_f32()).collect(),
            );
            for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
                let mut want = vec![f32::NAN; q.len()];
                let (k, v) = (&k_rounded, &v_rounded);
                run(
                    shape, q, k, v, bt, ctx, starts, &mut want, scale, threads, isa,
                )
                .unwrap();
                let mut out = vec![f32::NAN; q.len()];
                run(
                    shape, q, &k_e, &v_e, bt, ctx, starts, &mut out, scale, threads, isa,
                )
                .unwrap();
                assert!(
                    out.iter().all(|x| x.is_finite()),
                    "{isa:?}: the {} cache",
                    E::NAME
                );
                assert_eq!(
                    out,
                    want,
                    "{isa:?}: the {} cache against its values in f32",
                    E::NAME
                );
            }
        }
        let inputs = (&q[..], &k[..], &v[..]);
        let rows = (&bt[..], &ctx[..], starts);
        rounded_cache_reads_as_its_values::<f16>(&shape, inputs, rows, scale, threads);
        rounded_cache_reads_as_its_values::<F8E4M3>(&shape, inputs, rows, scale, threads);
        // An int8 cache gives what the f32 cache of its values gives, up to rounding: its
        // scales multiply the scores and weights rather than each element.
        let (k_q, v_q) = (quantize_cache(&k, head_dim), quantize_cache(&v, head_dim));
        let (k_deq, v_deq) = (
            dequantize_cache(&k_q, head_dim),
            dequantize_cache(&v_q, head_dim),
        );
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
            let mut want = vec![f32::NAN; q.len()];
            run(
                &shape, &q, &k_deq, &v_deq, &bt, &ctx, starts, &mut want, scale, threads, isa,
            )
            .unwrap();
            let mut out = vec![f32::NAN; q.len()];
            run(
                &shape, &q, &k_q, &v_q, &bt, &ctx, starts, &mut out, scale, threads, isa,
            )
            .unwrap();
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 + 1e-5 * b.abs(),
                    "{isa:?}: the int8 cache element {i}: {a} vs {b} of its values in f32"
                );
            }
        }
    }

    /// (sequences, (query heads, KV heads), head_dim, block_size). Query heads per KV head 1, 2,
    /// 3, 4 (runs 2 + 2), 8 (3 + 3 + 2): every shared-load width. head_dim 12: portable only;
    /// 24 / 48: the AVX2 values' 8-dim tail chunks. Block sizes 8 / 32: softmax over one / four
    /// 8-score vectors, plus partial last blocks.
    const SHAPES: [(usize, (usize, usize), usize, usize); 10] = [
        (1, (1, 1), 8, 16),
        (3, (4, 4), 64, 16),
        (5, (8, 2), 64, 16),
        (7, (9, 3), 64, 16),
        (4, (8, 1), 128, 16),
        (6, (4, 2), 12, 16),
        (5, (9, 3), 64, 8),
        (5, (9, 3), 64, 32),
        (4, (6, 2), 48, 16),
        (4, (6, 3), 24, 32),
    ];

    #[test]
    fn matches_reference_across_shapes_and_threads() {
        let mut seed = 1;
        for &(num_seqs, heads, head_dim, block_size) in &SHAPES {
            for threads in [1, 2, 3, 8] {
                case(seed, num_seqs, heads, head_dim, block_size, threads, false);
                seed += 1;
            }
        }
    }

    #[test]
    fn windows_match_reference_across_shapes_and_threads() {
        let mut seed = 101;
        // SHAPES, plus many rows (each its own start kind) and blocks of 64 / 128 (a chunk of
        // two blocks / of one); the keys outside each window are NaN (`case`).
        let more = [
            (10, (9, 3), 64, 16),
            (10, (4, 2), 32, 8),
            (4, (4, 2), 32, 64),
            (3, (2, 1), 16, 128),
        ];
        for &(num_seqs, heads, head_dim, block_size) in SHAPES.iter().chain(&more) {
            for threads in [1, 2, 3, 8] {
                case(seed, num_seqs, heads, head_dim, block_size, threads, true);
                seed += 1;
            }
        }
    }

    #[test]
    fn window_start_kinds_are_what_they_say() {
        let mut rng = Lcg(5);
        for ctx in 1..100 {
            for bs in [8, 16] {
                let at = |kind| window_start(&mut Lcg(ctx as u64), kind, ctx, bs) as usize;
                assert_eq!(at(0), 0);
                assert!(ctx <= 1 || at(1) % bs != 0);
                assert!(at(2) % bs == 0 && (ctx <= bs || at(2) > 0));
                assert_eq!(at(3), ctx - 1);
                assert_eq!(at(5), ctx.saturating_sub(bs + 3));
                for kind in 0..6 {
                    assert!(window_start(&mut rng, kind, ctx, bs) < ctx as i32);
                }
            }
        }
    }

    #[test]
    fn no_window_is_bit_for_bit_all_zero_starts() {
        // random shapes (whole rows) and one long row cut between threads (split-KV)
        for (seed, num_seqs, ctx_max, bs, threads) in [
            (31, 5, 96, 16, 1),
            (32, 7, 300, 8, 3),
            (33, 3, 200, 32, 2),
            (34, 1, 5000, 16, 4),
            (35, 2, 4000, 16, 3),
        ] {
            let mut rng = Lcg(seed);
            let max_blocks = (ctx_max as usize).div_ceil(bs);
            let shape = DecodeShape {
                num_seqs,
                num_heads: 9,
                num_kv_heads: 3,
                head_dim: 64,
                num_blocks: num_seqs * max_blocks,
                block_size: bs,
                max_blocks_per_seq: max_blocks,
            };
            let cache_len = shape.num_blocks * bs * 3 * 64;
            let k = rng.vec(cache_len);
            let v = rng.vec(cache_len);
            let q = rng.vec(num_seqs * 9 * 64);
            let ctx: Vec<i32> = (0..num_seqs)
                .map(|_| ctx_max - rng.below(ctx_max as usize / 4) as i32)
                .collect();
            let bt: Vec<i32> = (0..(num_seqs * max_blocks) as i32).rev().collect();
            let zeros = vec![0i32; num_seqs];
            for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
                let mut none = vec![f32::NAN; q.len()];
                let mut zero = vec![f32::NAN; q.len()];
                run(
                    &shape, &q, &k, &v, &bt, &ctx, None, &mut none, 0.125, threads, isa,
                )
                .unwrap();
                let some = Some(&zeros[..]);
                run(
                    &shape, &q, &k, &v, &bt, &ctx, some, &mut zero, 0.125, threads, isa,
                )
                .unwrap();
                assert!(none.iter().all(|x| x.is_finite()));
                assert_eq!(
                    none.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    zero.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "seed {seed} {isa:?}"
                );
            }
        }
    }

    #[test]
    fn splits_work_over_threads_when_large() {
        // enough keys that several threads run (1 + total_keys / MIN_KEYS_PER_TASK > 1)
        let mut rng = Lcg(7);
        let shape = DecodeShape {
            num_seqs: 40,
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 16,
            num_blocks: 2000,
            block_size: 16,
            max_blocks_per_seq: 40,
        };
        let cache_len = shape.num_blocks * 16 * 2 * 16;
        let k: Vec<f32> = (0..cache_len).map(|_| rng.next_f32()).collect();
        let v: Vec<f32> = (0..cache_len).map(|_| rng.next_f32()).collect();
        let q: Vec<f32> = (0..40 * 8 * 16).map(|_| rng.next_f32()).collect();
        let ctx = vec![640i32; 40];
        let bt: Vec<i32> = (0..40 * 40).map(|i| i % 1999 + 1).collect();
        let mut one = vec![0f32; q.len()];
        let mut many = vec![0f32; q.len()];
        paged_decode_attention_f32(&shape, &q, &k, &v, &bt, &ctx, None, &mut one, 0.25, 1).unwrap();
        paged_decode_attention_f32(&shape, &q, &k, &v, &bt, &ctx, None, &mut many, 0.25, 4)
            .unwrap();
        // The tasks the call got: 4, or fewer where the process's pool was first made smaller
        // (the first call to reach `cpu_pool::global` sizes it: on a 2-core machine a test
        // asking 3 threads leaves 3 tasks, and 40 x 40 blocks in 3 tasks cut sequences).
        let tasks = crate::cpu_pool::global(4).max_tasks().min(4);
        if partition(&[40; 40], tasks)
            .iter()
            .flatten()
            .all(|g| g.whole)
        {
            assert_eq!(
                one, many,
                "no sequence is cut here (40 x 40 blocks in {tasks} tasks): the split must not \
                 change any result"
            );
        }
        let want = reference(&shape, &q, &k, &v, &bt, &ctx, None, 0.25);
        for (a, b) in many.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 + 1e-4 * b.abs());
        }
    }

    #[test]
    fn head_subgroups_cover_each_kv_heads_query_heads_in_even_runs() {
        assert_eq!(head_subgroups(2, 1), vec![(0, 1), (1, 1)]);
        assert_eq!(head_subgroups(3, 3), vec![(0, 3), (3, 3), (6, 3)]);
        assert_eq!(head_subgroups(1, 4), vec![(0, 2), (2, 2)]);
        assert_eq!(head_subgroups(1, 7), vec![(0, 3), (3, 2), (5, 2)]);
        for kv_heads in 1..5 {
            for group in 1..20 {
                let runs = head_subgroups(kv_heads, group);
                let mut next = 0;
                for &(first, count) in &runs {
                    assert_eq!(first, next, "{kv_heads} x {group}: {runs:?}");
                    assert!((1..=MAX_SHARED_HEADS).contains(&count));
                    assert_eq!(
                        first / group,
                        (first + count - 1) / group,
                        "one KV head per run"
                    );
                    next += count;
                }
                assert_eq!(next, kv_heads * group);
                assert_eq!(runs.len(), kv_heads * group.div_ceil(MAX_SHARED_HEADS));
            }
        }
    }

    #[test]
    fn partition_covers_every_block_once_in_balanced_runs() {
        let mut rng = Lcg(11);
        for _ in 0..500 {
            let counts: Vec<usize> = (0..1 + rng.below(12)).map(|_| 1 + rng.below(40)).collect();
            let tasks = 1 + rng.below(9);
            let total: usize = counts.iter().sum();
            let plan = partition(&counts, tasks);
            assert!(plan.len() <= tasks && plan.iter().all(|t| !t.is_empty()));
            let mut next = (0, 0); // (sequence, block) expected next, in order
            for segments in &plan {
                let blocks: usize = segments.iter().map(|g| g.blocks.len()).sum();
                assert!(
                    blocks <= total.div_ceil(tasks),
                    "{counts:?} / {tasks}: {plan:?}"
                );
                for g in segments {
                    if next.1 == counts[next.0] {
                        next = (next.0 + 1, 0);
                    }
                    assert_eq!(
                        (g.seq, g.blocks.start),
                        next,
                        "{counts:?} / {tasks}: {plan:?}"
                    );
                    assert!(!g.blocks.is_empty() && g.blocks.end <= counts[g.seq]);
                    let parts = plan.iter().flatten().filter(|h| h.seq == g.seq).count();
                    assert_eq!(g.whole, parts == 1, "{counts:?} / {tasks}: {plan:?}");
                    next.1 = g.blocks.end;
                }
            }
            assert_eq!(next, (counts.len() - 1, counts[counts.len() - 1]));
        }
    }

    #[test]
    fn sequences_split_between_threads_match_the_reference() {
        // one long sequence (split-KV: every thread takes part of it), then a mix whose cuts
        // fall inside sequences
        // (>= 2 * MIN_KEYS_PER_TASK (key, KV head) pairs each, so that at least two tasks run)
        for (seed, ctx) in [
            (21, vec![5000i32]),
            (22, vec![3000, 37, 5, 1900]),
            (23, vec![129, 4900]),
        ] {
            let (shape, q, k, v, bt) = long_rows(seed, &ctx);
            let bs = shape.block_size;
            let want = reference(&shape, &q, &k, &v, &bt, &ctx, None, 0.125);
            let counts: Vec<usize> = ctx.iter().map(|&c| (c as usize).div_ceil(bs)).collect();
            // the two tasks every call below gets at least already cut a sequence
            let plan = partition(&counts, 2);
            assert!(plan.iter().flatten().any(|g| !g.whole), "no cut: {plan:?}");
            for threads in [2, 3, 8] {
                for isa in [Isa::Avx2, Isa::Portable] {
                    let mut out = vec![f32::NAN; q.len()];
                    run(
                        &shape, &q, &k, &v, &bt, &ctx, None, &mut out, 0.125, threads, isa,
                    )
                    .unwrap();
                    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 + 1e-4 * b.abs(),
                            "{ctx:?} threads {threads} {isa:?} element {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// SmolLM2's heads over rows of contexts `ctx` (up to 5,120 keys), blocks of 16 in reverse
    /// order: the shape, q, K, V (K scaled up: sharper softmaxes) and block tables.
    #[allow(clippy::type_complexity)]
    fn long_rows(seed: u64, ctx: &[i32]) -> (DecodeShape, Vec<f32>, Vec<f32>, Vec<f32>, Vec<i32>) {
        let mut rng = Lcg(seed);
        let (bs, max_blocks) = (16, 320);
        let shape = DecodeShape {
            num_seqs: ctx.len(),
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            num_blocks: ctx.len() * max_blocks + 1,
            block_size: bs,
            max_blocks_per_seq: max_blocks,
        };
        let cache_len = shape.num_blocks * bs * 3 * 64;
        let k: Vec<f32> = (0..cache_len).map(|_| rng.next_f32() * 3.0).collect();
        let v: Vec<f32> = (0..cache_len).map(|_| rng.next_f32()).collect();
        let q: Vec<f32> = (0..ctx.len() * 9 * 64).map(|_| rng.next_f32()).collect();
        let bt: Vec<i32> = (0..ctx.len() * max_blocks)
            .map(|i| 1 + i as i32)
            .rev()
            .collect();
        (shape, q, k, v, bt)
    }

    #[test]
    fn windows_of_sequences_split_between_threads_match_the_reference() {
        // as above with windows: the cuts fall inside windows (parts of one row merged), the
        // first part of a cut row starts mid-block, and the keys outside are NaN
        for (seed, ctx, starts) in [
            (41, vec![5000i32], vec![1234i32]),
            (42, vec![5000], vec![4003]),
            (43, vec![5000], vec![4096]),
            (44, vec![3000, 37, 5, 1900], vec![17, 36, 0, 900]),
            (45, vec![129, 4900], vec![128, 333]),
            (46, vec![2500, 2600], vec![2499, 1]),
        ] {
            let (shape, q, mut k, mut v, bt) = long_rows(seed, &ctx);
            let bs = shape.block_size;
            let full = reference(&shape, &q, &k, &v, &bt, &ctx, None, 0.125);
            poison_outside_windows(&shape, (&mut k, &mut v), &bt, &starts);
            let want = reference(&shape, &q, &k, &v, &bt, &ctx, Some(&starts), 0.125);
            assert!(want.iter().zip(&full).any(|(a, b)| (a - b).abs() > 1e-3));
            let counts: Vec<usize> = ctx
                .iter()
                .zip(&starts)
                .map(|(&c, &st)| (c as usize).div_ceil(bs) - st as usize / bs)
                .collect();
            let plan = partition(&counts, 2);
            assert!(plan.iter().flatten().any(|g| !g.whole), "no cut: {plan:?}");
            for threads in [2, 3, 8] {
                for isa in [Isa::Avx512, Isa::Avx2, Isa::Portable] {
                    let mut out = vec![f32::NAN; q.len()];
                    let st = Some(&starts[..]);
                    run(
                        &shape, &q, &k, &v, &bt, &ctx, st, &mut out, 0.125, threads, isa,
                    )
                    .unwrap();
                    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 + 1e-4 * b.abs(),
                            "{ctx:?} {starts:?} threads {threads} {isa:?} element {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_out_of_range_inputs() {
        let shape = DecodeShape {
            num_seqs: 1,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            num_blocks: 2,
            block_size: 4,
            max_blocks_per_seq: 2,
        };
        let q = vec![0f32; 8];
        let cache = vec![0f32; 2 * 4 * 4];
        let mut out = vec![0f32; 8];
        let run = |bt: &[i32], ctx: &[i32], out: &mut [f32]| {
            paged_decode_attention_f32(&shape, &q, &cache, &cache, bt, ctx, None, out, 1.0, 1)
        };
        assert!(run(&[0, 2], &[5], &mut out)
            .unwrap_err()
            .0
            .contains("block id 2"));
        assert!(run(&[0, -1], &[5], &mut out)
            .unwrap_err()
            .0
            .contains("block id -1"));
        assert!(run(&[0, 1], &[9], &mut out)
            .unwrap_err()
            .0
            .contains("ctx_lens[0] = 9"));
        assert!(run(&[0, 1], &[0], &mut out)
            .unwrap_err()
            .0
            .contains("ctx_lens[0] = 0"));
        assert!(run(&[0], &[1], &mut out)
            .unwrap_err()
            .0
            .contains("block_tables has 1"));
        assert!(
            run(&[1, 9], &[4], &mut out).is_ok(),
            "ids past the context are never read"
        );
        let mut short = vec![0f32; 4];
        assert!(run(&[0, 1], &[1], &mut short)
            .unwrap_err()
            .0
            .contains("out has 4"));
        // windows: one start per row, inside its context (an error, never a panic)
        let windowed = |ctx: &[i32], starts: &[i32], out: &mut [f32]| {
            paged_decode_attention_f32(
                &shape,
                &q,
                &cache,
                &cache,
                &[0, 1],
                ctx,
                Some(starts),
                out,
                1.0,
                1,
            )
        };
        for (ctx, starts, msg) in [
            (5, &[][..], "starts has 0 elements, its shape needs 1"),
            (5, &[1, 2][..], "starts has 2 elements"),
            (5, &[-1][..], "starts[0] = -1 outside 0..5"),
            (5, &[5][..], "starts[0] = 5 outside 0..5"),
            (5, &[6][..], "starts[0] = 6"),
            (1, &[1][..], "starts[0] = 1 outside 0..1"),
            (8, &[i32::MAX][..], "starts[0] = 2147483647"),
            (8, &[i32::MIN][..], "starts[0] = -2147483648"),
        ] {
            let err = windowed(&[ctx], starts, &mut out).unwrap_err().0;
            assert!(err.contains(msg), "{starts:?}: {err}");
        }
        assert!(windowed(&[9], &[0], &mut out)
            .unwrap_err()
            .0
            .contains("ctx_lens[0] = 9"));
        for (ctx, start) in [(5, 4), (8, 7), (8, 4), (1, 0), (5, 0)] {
            assert!(
                windowed(&[ctx], &[start], &mut out).is_ok(),
                "{ctx} {start}"
            );
        }
        let bad_heads = DecodeShape {
            num_heads: 3,
            num_kv_heads: 2,
            ..shape
        };
        assert!(bad_heads
            .validate(&q, &cache, &cache, &[0, 1], &[1], &out)
            .is_err());
    }
}
