//! Paged decode attention on the CPU (float32): one query token per sequence, its context's K/V
//! read in place through the block table — no gather copy, no padding to the longest context.
//!
//! Layout (all row-major, as the Python side's torch tensors):
//! `q` / `out` `[S, Hq, D]`, `k_cache` / `v_cache` `[num_blocks, block_size, Hkv, D]`,
//! `block_tables` `[S, max_blocks]`, `ctx_lens` `[S]` (keys each query attends: all of them, so
//! causality holds because the query is the last token).
//!
//! Invariants checked by [`DecodeShape::validate`] before any read, so no index below can leave
//! its slice: `Hq % Hkv == 0`; slice lengths equal their shapes; `1 <= ctx_lens[s] <=
//! max_blocks * block_size`; every block id a sequence uses is in `0..num_blocks`.
//! Work item = one sequence: it owns its `Hq * D` outputs (threads write disjoint slices) and
//! reads each of its blocks once, all KV heads together (`[block_size, Hkv, D]` is contiguous).
//! Softmax is the online (running max) form per block of keys, in f32, like flash-decoding.

use crate::cpu_error::KernelInputError;
use std::sync::Mutex;

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

impl DecodeShape {
    /// Checks every invariant of the module header against the given buffers.
    pub fn validate(
        &self,
        q: &[f32],
        k_cache: &[f32],
        v_cache: &[f32],
        block_tables: &[i32],
        ctx_lens: &[i32],
        out: &[f32],
    ) -> Result<(), KernelInputError> {
        let s = *self;
        if s.num_kv_heads == 0 || s.head_dim == 0 || s.block_size == 0 {
            return bad("num_kv_heads, head_dim and block_size must be positive".into());
        }
        if !s.num_heads.is_multiple_of(s.num_kv_heads) || s.num_heads == 0 {
            return bad(format!(
                "num_heads {} is not a positive multiple of num_kv_heads {}",
                s.num_heads, s.num_kv_heads
            ));
        }
        let q_len = s.num_seqs * s.num_heads * s.head_dim;
        let cache_len = s.num_blocks * s.block_size * s.num_kv_heads * s.head_dim;
        for (name, len, want) in [
            ("q", q.len(), q_len),
            ("out", out.len(), q_len),
            ("k_cache", k_cache.len(), cache_len),
            ("v_cache", v_cache.len(), cache_len),
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
            let used = (ctx as usize).div_ceil(s.block_size);
            let row = &block_tables[seq * s.max_blocks_per_seq..][..used];
            if let Some(&b) = row.iter().find(|&&b| b < 0 || b as usize >= s.num_blocks) {
                return bad(format!(
                    "block id {b} of sequence {seq} outside 0..{}",
                    s.num_blocks
                ));
            }
        }
        Ok(())
    }
}

/// Runs decode attention, splitting the sequences over up to `num_threads`
/// threads of the kernels' pool (`cpu_pool`) (contiguous ranges balanced by context length). Errors instead of reading out of
/// bounds; see the module header for the layout.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_f32(
    shape: &DecodeShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_tables: &[i32],
    ctx_lens: &[i32],
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
        out,
        scale,
        num_threads,
        true,
    )
}

/// [`paged_decode_attention_f32`] with the SIMD path allowed or not (tests compare both).
#[allow(clippy::too_many_arguments)]
fn run(
    shape: &DecodeShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_tables: &[i32],
    ctx_lens: &[i32],
    out: &mut [f32],
    scale: f32,
    num_threads: usize,
    allow_simd: bool,
) -> Result<(), KernelInputError> {
    shape.validate(q, k_cache, v_cache, block_tables, ctx_lens, out)?;
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
        scale,
        allow_simd,
    };
    let item_len = shape.num_heads * shape.head_dim;
    let num_items = shape.num_seqs;
    let total_keys: usize =
        ctx_lens.iter().map(|&c| c as usize).sum::<usize>() * shape.num_kv_heads;
    // Below ~2k (key, KV head) pairs waking a worker costs more than its share of the work.
    let threads = num_threads.clamp(1, num_items).min(1 + total_keys / 2048);
    let pool = (threads > 1).then(|| crate::cpu_pool::global(threads));
    let threads = pool.map_or(1, |pool| threads.min(pool.max_tasks()));
    let Some(pool) = pool.filter(|_| threads > 1) else {
        kernel.run_items(0, out);
        return Ok(());
    };
    // Split the sequences into `threads` contiguous ranges with about equal key counts.
    let per_thread = total_keys.div_ceil(threads);
    let mut bounds = vec![0usize];
    let mut acc = 0usize;
    for (item, &ctx) in ctx_lens.iter().enumerate() {
        acc += ctx as usize * shape.num_kv_heads;
        if acc >= per_thread * bounds.len() && bounds.len() < threads && item + 1 < num_items {
            bounds.push(item + 1);
        }
    }
    bounds.push(num_items);
    // One disjoint output range per task; each task takes its own (the lock is uncontended).
    let mut rest: &mut [f32] = out;
    let mut chunks = Vec::with_capacity(bounds.len() - 1);
    for w in bounds.windows(2) {
        let (head, tail) = rest.split_at_mut((w[1] - w[0]) * item_len);
        chunks.push(Mutex::new(Some((w[0], head))));
        rest = tail;
    }
    pool.run(chunks.len(), &|t| {
        let taken = chunks[t].lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((start, chunk)) = taken {
            kernel.run_items(start, chunk);
        }
    });
    Ok(())
}

struct Kernel<'a> {
    shape: DecodeShape,
    q: &'a [f32],
    k_cache: &'a [f32],
    v_cache: &'a [f32],
    block_tables: &'a [i32],
    ctx_lens: &'a [i32],
    scale: f32,
    allow_simd: bool,
}

impl Kernel<'_> {
    /// Sequences `first_item..` whose outputs are the consecutive `Hq * D` runs of `out`.
    fn run_items(&self, first_item: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if self.allow_simd
                && self.shape.head_dim.is_multiple_of(8)
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU supports the features the function is compiled for.
                unsafe { self.run_items_avx2(first_item, out) };
                return;
            }
        }
        self.run_items_impl::<false>(first_item, out);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_items_avx2(&self, first_item: usize, out: &mut [f32]) {
        self.run_items_impl::<true>(first_item, out);
    }

    /// The loop over sequences and blocks; `AVX2` picks the block math (x86_64 with AVX2 + FMA
    /// and `head_dim % 8 == 0` only, checked by `run_items`).
    #[inline(always)]
    fn run_items_impl<const AVX2: bool>(&self, first_item: usize, out: &mut [f32]) {
        let s = &self.shape;
        let (d, bs, hkv) = (s.head_dim, s.block_size, s.num_kv_heads);
        let group = s.num_heads / hkv;
        let block_len = bs * hkv * d;
        // scores[qh * bs + j]: query head qh against key j of the current block
        let mut scores = vec![0f32; s.num_heads * bs];
        let mut running_max = vec![0f32; s.num_heads];
        let mut denom = vec![0f32; s.num_heads];
        for (i, out_seq) in out.chunks_exact_mut(s.num_heads * d).enumerate() {
            let seq = first_item + i;
            let q = &self.q[seq * s.num_heads * d..][..s.num_heads * d];
            let ctx = self.ctx_lens[seq] as usize;
            let table = &self.block_tables[seq * s.max_blocks_per_seq..][..ctx.div_ceil(bs)];
            out_seq.fill(0.0);
            running_max.fill(f32::NEG_INFINITY);
            denom.fill(0.0);
            for (b, &block) in table.iter().enumerate() {
                let n = (ctx - b * bs).min(bs);
                // one block's keys and values for all KV heads: [bs, Hkv, D], contiguous
                let k_block = &self.k_cache[block as usize * block_len..][..block_len];
                let v_block = &self.v_cache[block as usize * block_len..][..block_len];
                #[cfg(target_arch = "x86_64")]
                if AVX2 {
                    if let Some(&next) = table.get(b + 1) {
                        // the next block is somewhere else in memory: start fetching it now
                        let at = next as usize * block_len;
                        avx2::prefetch(&self.k_cache[at..][..block_len]);
                        avx2::prefetch(&self.v_cache[at..][..block_len]);
                    }
                }
                for qh in 0..s.num_heads {
                    let rows = Rows {
                        block: k_block,
                        offset: (qh / group) * d,
                        stride: hkv * d,
                        n,
                        d,
                    };
                    let (q_head, row) = (&q[qh * d..][..d], &mut scores[qh * bs..][..n]);
                    if AVX2 {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: only reached from `run_items_avx2`, i.e. on an AVX2+FMA CPU.
                        unsafe {
                            avx2::block_scores(q_head, &rows, self.scale, row)
                        };
                    } else {
                        portable::block_scores(q_head, &rows, self.scale, row);
                    }
                }
                for qh in 0..s.num_heads {
                    let row = &mut scores[qh * bs..][..n];
                    let correction = softmax_update(row, &mut running_max[qh], &mut denom[qh]);
                    let rows = Rows {
                        block: v_block,
                        offset: (qh / group) * d,
                        stride: hkv * d,
                        n,
                        d,
                    };
                    let acc = &mut out_seq[qh * d..][..d];
                    if AVX2 {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: as above.
                        unsafe {
                            avx2::block_accumulate(acc, row, correction, &rows)
                        };
                    } else {
                        portable::block_accumulate(acc, row, correction, &rows);
                    }
                }
            }
            for qh in 0..s.num_heads {
                let inv = 1.0 / denom[qh];
                out_seq[qh * d..][..d].iter_mut().for_each(|a| *a *= inv);
            }
        }
    }
}

/// The `n` rows of one KV head inside a block: row `j` is `block[offset + j * stride..][..d]`.
/// Holds `offset + (n - 1) * stride + d <= block.len()` (true for every head of a validated
/// block: `offset <= (Hkv - 1) * D`, `stride = Hkv * D`, `n <= block_size`).
struct Rows<'a> {
    block: &'a [f32],
    offset: usize,
    stride: usize,
    n: usize,
    d: usize,
}

impl Rows<'_> {
    #[inline(always)]
    fn row(&self, j: usize) -> &[f32] {
        &self.block[self.offset + j * self.stride..][..self.d]
    }
}

/// Folds one block's scores into the running max / denominator of one query head: turns `row`
/// into the block's softmax weights and returns the factor the accumulated output must be
/// scaled by.
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

    /// `out[j] = scale * (q . row j)`.
    #[inline(always)]
    pub(super) fn block_scores(q: &[f32], k: &Rows<'_>, scale: f32, out: &mut [f32]) {
        for (j, o) in out.iter_mut().enumerate().take(k.n) {
            *o = dot(q, k.row(j)) * scale;
        }
    }

    /// `acc = acc * correction + sum_j p[j] * row j`.
    #[inline(always)]
    pub(super) fn block_accumulate(acc: &mut [f32], p: &[f32], correction: f32, v: &Rows<'_>) {
        if correction != 1.0 {
            acc.iter_mut().for_each(|a| *a *= correction);
        }
        for (j, &w) in p.iter().enumerate().take(v.n) {
            for (a, x) in acc.iter_mut().zip(v.row(j)) {
                *a += w * x;
            }
        }
    }

    /// Dot product with 8 independent accumulators (order differs from a serial sum).
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut lanes = [0f32; 8];
        let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
        let tail: f32 = a8
            .remainder()
            .iter()
            .zip(b8.remainder())
            .map(|(x, y)| x * y)
            .sum();
        for (x, y) in a8.zip(b8) {
            let (x, y): (&[f32; 8], &[f32; 8]) = (x.try_into().unwrap(), y.try_into().unwrap());
            for l in 0..8 {
                lanes[l] += x[l] * y[l];
            }
        }
        lanes.iter().sum::<f32>() + tail
    }
}

/// AVX2 + FMA block math for `head_dim % 8 == 0`: eight keys' dot products at a time, reduced
/// together with one horizontal-add tree; values accumulated in registers 64 dims at a time.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Rows;
    use std::arch::x86_64::*;

    /// `out[j] = scale * (q . row j)` for `j < k.n`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_scores(q: &[f32], k: &Rows<'_>, scale: f32, out: &mut [f32]) {
        let d = q.len();
        debug_assert!(d.is_multiple_of(8) && d == k.d && out.len() >= k.n);
        debug_assert!(k.n == 0 || k.offset + (k.n - 1) * k.stride + d <= k.block.len());
        let scale_v = _mm256_set1_ps(scale);
        let base = k.block.as_ptr().add(k.offset);
        let mut j = 0;
        while j + 8 <= k.n {
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(q.as_ptr().add(c));
                for (jj, a) in acc.iter_mut().enumerate() {
                    let kv = _mm256_loadu_ps(base.add((j + jj) * k.stride + c));
                    *a = _mm256_fmadd_ps(qv, kv, *a);
                }
            }
            _mm256_storeu_ps(out.as_mut_ptr().add(j), _mm256_mul_ps(hsum8(&acc), scale_v));
            j += 8;
        }
        for (jj, o) in out.iter_mut().enumerate().take(k.n).skip(j) {
            let mut acc = _mm256_setzero_ps();
            for c in (0..d).step_by(8) {
                let kv = _mm256_loadu_ps(base.add(jj * k.stride + c));
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(c)), kv, acc);
            }
            *o = hsum(acc) * scale;
        }
    }

    /// `acc = acc * correction + sum_j p[j] * row j` for `j < v.n`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_accumulate(
        acc: &mut [f32],
        p: &[f32],
        correction: f32,
        v: &Rows<'_>,
    ) {
        let d = acc.len();
        debug_assert!(d.is_multiple_of(8) && d == v.d && p.len() >= v.n);
        debug_assert!(v.n == 0 || v.offset + (v.n - 1) * v.stride + d <= v.block.len());
        let mut c0 = 0;
        while c0 + 64 <= d {
            accumulate_chunk::<8>(acc, c0, p, correction, v);
            c0 += 64;
        }
        while c0 < d {
            accumulate_chunk::<1>(acc, c0, p, correction, v);
            c0 += 8;
        }
    }

    /// Dims `c0..c0 + 8 * W` of `block_accumulate`, held in W registers across the keys.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn accumulate_chunk<const W: usize>(
        acc: &mut [f32],
        c0: usize,
        p: &[f32],
        correction: f32,
        v: &Rows<'_>,
    ) {
        let out = acc.as_mut_ptr().add(c0);
        let corr = _mm256_set1_ps(correction);
        let mut a = [_mm256_setzero_ps(); W];
        for (t, r) in a.iter_mut().enumerate() {
            *r = _mm256_mul_ps(_mm256_loadu_ps(out.add(8 * t)), corr);
        }
        let base = v.block.as_ptr().add(v.offset + c0);
        for (j, &w) in p.iter().enumerate().take(v.n) {
            let wv = _mm256_set1_ps(w);
            let row = base.add(j * v.stride);
            for (t, r) in a.iter_mut().enumerate() {
                *r = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * t)), *r);
            }
        }
        for (t, r) in a.iter().enumerate() {
            _mm256_storeu_ps(out.add(8 * t), *r);
        }
    }

    /// Asks the CPU to start loading every cache line of `data` into L2, not L1: the next
    /// block's K and V (24 KiB for SmolLM2) would evict the current block's from a 32–48 KiB L1
    /// while it is still being read (measured: T0 -> T1 made 30 layers' attention 1.07–1.10x
    /// faster on the AVX-512 Xeon; lookahead of 2 or 3 blocks changed nothing).
    #[inline(always)]
    pub(super) fn prefetch(data: &[f32]) {
        for line in data.chunks(16) {
            // SAFETY: a prefetch is only a hint; the address is inside `data`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
        }
    }

    /// The eight horizontal sums of `v[0..8]`, in order, as one vector.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum8(v: &[__m256; 8]) -> __m256 {
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

    /// The sum of the eight lanes of `v`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}

/// `e^x` for `x <= 0` (softmax weights; -inf gives 0) in branch-free arithmetic that
/// vectorizes: `2^n * e^r` with `|r| <= ln2 / 2` and a degree-7 Taylor polynomial (relative
/// error < 1e-8 before rounding, i.e. within f32 rounding of `f32::exp`).
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0); // e^-87 ~ 1.6e-38: still a normal float; below that the weight is ~0
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    /// Naive two-pass softmax attention, in f64, over the same layout.
    fn reference(
        s: &DecodeShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        bt: &[i32],
        ctx: &[i32],
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
                let n = ctx[seq] as usize;
                let logits: Vec<f64> = (0..n)
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
                    let o: f64 = (0..n).map(|t| w[t] * v[slot(t) + i] as f64).sum::<f64>() / z;
                    out[(seq * s.num_heads + h) * d + i] = o as f32;
                }
            }
        }
        out
    }

    fn case(seed: u64, num_seqs: usize, heads: (usize, usize), head_dim: usize, threads: usize) {
        let mut rng = Lcg(seed);
        let (num_heads, num_kv_heads) = heads;
        let block_size = 16;
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
        let k: Vec<f32> = (0..cache_len).map(|_| rng.next_f32() * 3.0).collect();
        let v: Vec<f32> = (0..cache_len).map(|_| rng.next_f32()).collect();
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
        let scale = 1.0 / (head_dim as f32).sqrt();
        let want = reference(&shape, &q, &k, &v, &bt, &ctx, scale);
        for simd in [true, false] {
            let mut out = vec![f32::NAN; q.len()];
            run(
                &shape, &q, &k, &v, &bt, &ctx, &mut out, scale, threads, simd,
            )
            .unwrap();
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 + 1e-4 * b.abs(),
                    "simd {simd} element {i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn matches_reference_across_shapes_and_threads() {
        let mut seed = 1;
        for &(num_seqs, heads, head_dim) in &[
            (1, (1, 1), 8),
            (3, (4, 4), 64),
            (5, (8, 2), 64),
            (7, (9, 3), 64),
            (4, (8, 1), 128),
            (6, (4, 2), 12),
        ] {
            for threads in [1, 2, 3, 8] {
                case(seed, num_seqs, heads, head_dim, threads);
                seed += 1;
            }
        }
    }

    #[test]
    fn exp_matches_std_over_the_softmax_range() {
        let mut worst = 0f32;
        for i in 0..=200_000 {
            let x = -100.0 * i as f32 / 200_000.0;
            let (got, want) = (exp(x), x.exp());
            if want > 1e-37 {
                worst = worst.max((got - want).abs() / want);
            } else {
                assert!(got < 1e-36, "exp({x}) = {got}");
            }
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), exp(-87.0));
    }

    #[test]
    fn splits_work_over_threads_when_large() {
        // enough keys that several threads run (1 + total_keys / 2048 > 1)
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
        paged_decode_attention_f32(&shape, &q, &k, &v, &bt, &ctx, &mut one, 0.25, 1).unwrap();
        paged_decode_attention_f32(&shape, &q, &k, &v, &bt, &ctx, &mut many, 0.25, 4).unwrap();
        assert_eq!(
            one, many,
            "the split must not change any result (items are independent)"
        );
        let want = reference(&shape, &q, &k, &v, &bt, &ctx, 0.25);
        for (a, b) in many.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 + 1e-4 * b.abs());
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
            paged_decode_attention_f32(&shape, &q, &cache, &cache, bt, ctx, out, 1.0, 1)
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
