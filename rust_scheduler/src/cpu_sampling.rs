//! Random sampling's draw from a step's logits on the CPU: temperature, top-k, top-p and min-p,
//! then one token per row at the row's own uniform draw, in a few passes over the row where
//! torch sorted candidates (a top-p row of SmolLM2's 49,152 logits took ~1.3 ms there).
//!
//! The distribution is the torch sampler's (`Sampler._sample_random`): weights
//! `w = exp((x - max) / T)`; top-k keeps the `k` largest; top-p then keeps, in descending
//! order, each token whose predecessors' mass (renormalized over what top-k kept) is at most
//! `top_p`; min-p keeps the weights of at least `min_p` times the largest; the draw is the first
//! token, in index order, at which the kept weights' running sum reaches `(1 - u)` of their total.
//!
//! Invariants:
//! - A token of weight 0 is never drawn: logits of -inf (masks) and NaN weigh 0, and so does
//!   every logit more than 87 * T below the row's largest (e^-87 ~ 1.6e-38).
//! - The token of weight 1 (the first largest logit) always survives top-k, top-p and min-p.
//! - The descending order breaks ties to the lower index, so equal weights are cut
//!   deterministically.
//! - The top-k / top-p cut is found without sorting the row: a pass over seven nested levels
//!   picks the highest floor that holds the cut, a histogram of the weights above it (16
//!   buckets per power of two, down to 2^-24) locates the bucket the cut falls in, and only that
//!   bucket is sorted; a cut below 2^-24 sorts every weight above 0 (`cut_exact`, also the
//!   tests' reference).
//! - Rows with a temperature of 0 or below, or without a finite largest logit (+inf somewhere,
//!   or nothing above -inf), take the first largest value (`cpu_greedy`'s answer).
//! - Rows are split over the kernels' pool, a row per task at a time; each thread keeps its
//!   scratch (a row of weights) between calls.

use crate::cpu_error::KernelInputError;
use crate::cpu_greedy::span_of;
use crate::cpu_isa::Isa;
use crate::cpu_pool::{for_each_item, SharedMut};
use std::cell::RefCell;

/// One row's sampling parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSampling {
    /// softmax temperature; 0 or below: the row's argmax
    pub temperature: f32,
    /// keep the `top_k` largest weights (0, or the vocabulary or more: all)
    pub top_k: usize,
    /// nucleus mass in (0, 1]; 1: no cut
    pub top_p: f32,
    /// keep weights of at least `min_p` times the largest, in [0, 1]
    pub min_p: f32,
    /// the row's uniform draw in [0, 1)
    pub uniform: f64,
}

/// Values summed per chunk in the draw's first pass (the second scans one chunk).
const CHUNK: usize = 1024;
/// Histogram buckets per power of two of the weights (the top mantissa bits).
const BUCKET_BITS: u32 = 4;
/// The bucket key's shift: exponent and [`BUCKET_BITS`] of mantissa.
const KEY_SHIFT: u32 = 23 - BUCKET_BITS;
/// The key of weight 1.0 (bucket 0).
const TOP_KEY: u32 = 0x3F80_0000 >> KEY_SHIFT;
/// The smallest weight the histogram counts: 2^-24.
const FLOOR: f32 = 1.0 / 16_777_216.0;
/// Buckets from 1.0 down to [`FLOOR`].
const BUCKETS: usize = (24 << BUCKET_BITS) + 1;

/// Where top-k / top-p cut the descending order: a token is kept when its weight is above
/// `w`, or equal to it at an index of at most `idx`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Cut {
    w: f32,
    idx: u32,
}

impl Cut {
    /// Keeps every token.
    const NONE: Cut = Cut {
        w: 0.0,
        idx: i32::MAX as u32,
    };

    fn keeps(self, w: f32, i: usize) -> bool {
        w > self.w || (w == self.w && i as u32 <= self.idx)
    }

    /// The cut that keeps fewer tokens (earlier in the descending order).
    fn tighter(self, other: Cut) -> Cut {
        if other.w > self.w || (other.w == self.w && other.idx < self.idx) {
            other
        } else {
            self
        }
    }
}

/// A thread's reused buffers.
#[derive(Default)]
struct Scratch {
    /// the row's weights
    w: Vec<f32>,
    hist: Hist,
    /// the draw's chunk sums
    sums: Vec<f64>,
}

/// The cut's histogram: per bucket the weights' count and mass, and one bucket's tokens.
#[derive(Default)]
struct Hist {
    count: Vec<u32>,
    mass: Vec<f64>,
    bucket: Vec<(f32, u32)>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The token drawn for each of the rows of `logits` (`[rows, vocab]`, row-major) by its
/// [`RowSampling`] into `out` (`rows` long), over up to `num_threads` threads.
pub fn sample_rows_f32(
    logits: &[f32],
    vocab: usize,
    params: &[RowSampling],
    out: &mut [usize],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    let rows = out.len();
    if vocab == 0 || vocab > i32::MAX as usize {
        return Err(KernelInputError(format!(
            "a vocabulary of {vocab} tokens; expected 1 to 2^31 - 1"
        )));
    }
    if logits.len() != rows * vocab || params.len() != rows {
        return Err(KernelInputError(format!(
            "logits have {} values and {} rows of parameters; {rows} rows of {vocab} need {}",
            logits.len(),
            params.len(),
            rows * vocab
        )));
    }
    if let Some((r, p)) = params.iter().enumerate().find(|(_, p)| !valid(p)) {
        return Err(KernelInputError(format!(
            "row {r}: top_p {} (want (0, 1]), min_p {} (want [0, 1]), uniform {} (want [0, 1)), \
             temperature {} (want a number)",
            p.top_p, p.min_p, p.uniform, p.temperature
        )));
    }
    let isa = Isa::detect(Isa::Avx512);
    let out_ptr = SharedMut(out.as_mut_ptr());
    for_each_item(rows, num_threads, &|r| {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let token = SCRATCH.with(|s| sample_row(row, &params[r], isa, &mut s.borrow_mut()));
        // SAFETY: `for_each_item` calls each `r < rows` once, and `out` outlives the call.
        unsafe { out_ptr.get().add(r).write(token) };
    });
    Ok(())
}

fn valid(p: &RowSampling) -> bool {
    p.top_p > 0.0
        && p.top_p <= 1.0
        && (0.0..=1.0).contains(&p.min_p)
        && (0.0..1.0).contains(&p.uniform)
        && !p.temperature.is_nan()
}

/// One row's token.
fn sample_row(row: &[f32], p: &RowSampling, isa: Isa, s: &mut Scratch) -> usize {
    let span = span_of(row, isa);
    if p.temperature <= 0.0 || !span.best.is_finite() {
        return span.token;
    }
    // a temperature so small that its inverse overflows: every other weight underflows to 0
    let inv_t = (1.0 / p.temperature).min(f32::MAX);
    s.w.resize(row.len(), 0.0);
    let total = weights(row, span.best, inv_t, &mut s.w, isa);
    let cut = if p.top_k > 0 && p.top_k < row.len() || p.top_p < 1.0 {
        cut_of(&s.w, total, p.top_k, p.top_p, &mut s.hist, isa)
    } else {
        Cut::NONE
    };
    // the largest weight is exactly 1 (exp(0)), so min-p's bound is min_p itself
    draw(&s.w, cut, p.min_p, p.uniform, isa, &mut s.sums)
}

/// `w[i] = exp((row[i] - max) * inv_t)`, 0 where that exponent is below -87 or NaN; returns
/// the sum of `w`.
pub(crate) fn weights(row: &[f32], max: f32, inv_t: f32, w: &mut [f32], isa: Isa) -> f64 {
    match isa {
        // SAFETY: `isa` came from `Isa::detect` (or a test's narrower pick), so the CPU has
        // AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { simd::weights_avx512(row, max, inv_t, w) },
        // SAFETY: as above, AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::weights_avx2(row, max, inv_t, w) },
        _ => weights_portable(row, max, inv_t, w),
    }
}

/// The portable [`weights`]; also the SIMD paths' tails.
fn weights_portable(row: &[f32], max: f32, inv_t: f32, w: &mut [f32]) -> f64 {
    let mut total = 0.0f64;
    for (wi, &x) in w.iter_mut().zip(row) {
        *wi = weight((x - max) * inv_t);
        total += *wi as f64;
    }
    total
}

/// The weight of an exponent `s <= 0` (0 below -87 or for NaN).
#[inline(always)]
fn weight(s: f32) -> f32 {
    if s >= -87.0 {
        crate::cpu_exp::exp(s)
    } else {
        0.0
    }
}

/// Histogram bucket of a weight in [[`FLOOR`], 1].
#[inline(always)]
fn bucket(w: f32) -> usize {
    (TOP_KEY.saturating_sub(w.to_bits() >> KEY_SHIFT) as usize).min(BUCKETS - 1)
}

/// The descending order's ranking: larger weight first, then lower index.
fn descending(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The floors of [`level_stats`]: nested sets of the largest weights, the histogram counting
/// only the highest one that settles the cut.
const LEVELS: [f32; 7] = [
    1.0 / 8.0,
    1.0 / 64.0,
    1.0 / 512.0,
    1.0 / 4096.0,
    1.0 / 65536.0,
    1.0 / 1_048_576.0,
    FLOOR,
];

/// Bits just above every weight (1.0 is the largest).
const ABOVE_ONE: u32 = 0x3F80_0001;

/// The top-k / top-p cut of the weights `w` (summing to `total`), via the histogram.
fn cut_of(w: &[f32], total: f64, top_k: usize, top_p: f32, s: &mut Hist, isa: Isa) -> Cut {
    let k_on = top_k > 0 && top_k < w.len();
    // the highest level holding the cut: top-k's k tokens, or more than top-p's mass (with
    // top-k too, its k tokens: their sum renormalizes top-p)
    let levels = level_stats(w, isa);
    let settled = levels.iter().zip(LEVELS).find(|((count, mass), _)| {
        if k_on {
            *count as usize >= top_k
        } else {
            *mass > top_p as f64 * total
        }
    });
    let Some((_, floor)) = settled else {
        return cut_exact(w, total, top_k, top_p);
    };
    s.count.clear();
    s.count.resize(BUCKETS, 0);
    s.mass.clear();
    s.mass.resize(BUCKETS, 0.0);
    let (count, mass) = (&mut s.count, &mut s.mass);
    select(w, floor.to_bits(), ABOVE_ONE, isa, |_, x| {
        let b = bucket(x);
        count[b] += 1;
        mass[b] += x as f64;
    });
    let (mut cut, mut z, mut kb) = (Cut::NONE, total, BUCKETS - 1);
    // the bucket sorted last and how many of its tokens top-k keeps
    let mut sorted_b = usize::MAX;
    let mut k_in_bucket = usize::MAX;
    let (mut mass_before_kb, mut count_before) = (0.0f64, 0usize);
    if k_on {
        let found = (0..BUCKETS).find(|&b| {
            if count_before + s.count[b] as usize >= top_k {
                return true;
            }
            count_before += s.count[b] as usize;
            mass_before_kb += s.mass[b];
            false
        });
        let Some(b) = found else {
            return cut_exact(w, total, top_k, top_p);
        };
        kb = b;
        sort_bucket(w, b, &mut s.bucket, isa);
        sorted_b = b;
        k_in_bucket = top_k - count_before;
        let last = s.bucket[k_in_bucket - 1];
        cut = Cut {
            w: last.0,
            idx: last.1,
        };
        z = mass_before_kb
            + s.bucket[..k_in_bucket]
                .iter()
                .map(|t| t.0 as f64)
                .sum::<f64>();
    }
    if top_p < 1.0 {
        let target = top_p as f64 * z;
        let mut before = 0.0f64;
        let found = (0..=kb).find(|&b| {
            if before + s.mass[b] > target {
                return true;
            }
            before += s.mass[b];
            false
        });
        match found {
            Some(b) => {
                if b != sorted_b {
                    sort_bucket(w, b, &mut s.bucket, isa);
                }
                let limit = if b == kb && k_on {
                    k_in_bucket
                } else {
                    s.bucket.len()
                };
                // the bucket's first token is kept (`before <= target`); the walk stops at the
                // first whose predecessors' mass passes the target
                let mut last = s.bucket[0];
                let mut mass = before;
                for &t in &s.bucket[..limit] {
                    if mass > target {
                        break;
                    }
                    mass += t.0 as f64;
                    last = t;
                }
                cut = cut.tighter(Cut {
                    w: last.0,
                    idx: last.1,
                });
            }
            // top-k's cut comes first
            None if k_on => {}
            // the level's sums rounded otherwise than the buckets'
            None => return cut_exact(w, total, top_k, top_p),
        }
    }
    cut
}

/// The tokens of bucket `b` (weights at or above [`FLOOR`]), in descending order.
fn sort_bucket(w: &[f32], b: usize, out: &mut Vec<(f32, u32)>, isa: Isa) {
    out.clear();
    let key = TOP_KEY - b as u32;
    select(w, key << KEY_SHIFT, (key + 1) << KEY_SHIFT, isa, |i, x| {
        out.push((x, i as u32))
    });
    out.sort_unstable_by(descending);
}

/// Per [`LEVELS`] floor, how many weights of `w` are at or above it and their sum.
fn level_stats(w: &[f32], isa: Isa) -> [(u32, f64); LEVELS.len()] {
    match isa {
        // SAFETY: as in [`weights`].
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { simd::level_stats_avx512(w) },
        _ => level_stats_portable(w),
    }
}

/// The portable [`level_stats`]; also the SIMD path's tail.
fn level_stats_portable(w: &[f32]) -> [(u32, f64); LEVELS.len()] {
    let mut out = [(0u32, 0.0f64); LEVELS.len()];
    for &x in w {
        for (o, &floor) in out.iter_mut().zip(&LEVELS) {
            if x >= floor {
                o.0 += 1;
                o.1 += x as f64;
            }
        }
    }
    out
}

/// Calls `f(i, w[i])` for each index, in order, whose weight's bits lie in `[lo, hi)` (weights
/// are non-negative, so their bits order as they do).
fn select(w: &[f32], lo: u32, hi: u32, isa: Isa, mut f: impl FnMut(usize, f32)) {
    match isa {
        // SAFETY: as in [`weights`].
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { simd::select_avx512(w, lo, hi, &mut f) },
        // SAFETY: as in [`weights`].
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::select_avx2(w, lo, hi, &mut f) },
        _ => select_portable(w, 0, lo, hi, &mut f),
    }
}

/// The portable [`select`] of `w`, whose first element is index `first`.
fn select_portable(w: &[f32], first: usize, lo: u32, hi: u32, f: &mut impl FnMut(usize, f32)) {
    for (j, &x) in w.iter().enumerate() {
        if (lo..hi).contains(&x.to_bits()) {
            f(first + j, x);
        }
    }
}

/// The top-k / top-p cut by sorting every weight above 0: what [`cut_of`] gives, found the
/// plain way (its fallback, and the tests' reference).
fn cut_exact(w: &[f32], total: f64, top_k: usize, top_p: f32) -> Cut {
    let mut order: Vec<(f32, u32)> = w
        .iter()
        .enumerate()
        .filter(|&(_, &x)| x > 0.0)
        .map(|(i, &x)| (x, i as u32))
        .collect();
    order.sort_unstable_by(descending);
    if top_k > 0 && top_k < order.len() {
        order.truncate(top_k);
    }
    let z = if top_k > 0 && top_k < w.len() {
        order.iter().map(|t| t.0 as f64).sum()
    } else {
        total
    };
    let target = top_p as f64 * z;
    let mut mass = 0.0f64;
    let mut last = order[0];
    for &t in &order {
        if top_p < 1.0 && mass > target {
            break;
        }
        mass += t.0 as f64;
        last = t;
    }
    Cut {
        w: last.0,
        idx: last.1,
    }
}

/// The first index at which the running sum of the kept weights (kept by `cut`, and at least
/// `min_w`) reaches `(1 - u)` of their total.
fn draw(w: &[f32], cut: Cut, min_w: f32, u: f64, isa: Isa, sums: &mut Vec<f64>) -> usize {
    sums.clear();
    sums.resize(w.len().div_ceil(CHUNK), 0.0);
    for (c, sum) in sums.iter_mut().enumerate() {
        let part = &w[c * CHUNK..((c + 1) * CHUNK).min(w.len())];
        *sum = kept_sum(part, c * CHUNK, cut, min_w, isa);
    }
    let total: f64 = sums.iter().sum();
    let target = (1.0 - u) * total;
    let keeps = |x: f32, i: usize| x > 0.0 && x >= min_w && cut.keeps(x, i);
    let (mut acc, mut last) = (0.0f64, None);
    for (c, &sum) in sums.iter().enumerate() {
        let first = c * CHUNK;
        if acc + sum < target {
            acc += sum;
            if sum > 0.0 {
                last = Some(c);
            }
            continue;
        }
        for (j, &x) in w[first..(first + CHUNK).min(w.len())].iter().enumerate() {
            if keeps(x, first + j) {
                acc += x as f64;
                if acc >= target {
                    return first + j;
                }
            }
        }
        last = Some(c);
    }
    // the chunk sums and the running sum rounded differently: the last kept token
    let c = last.expect("the largest weight is always kept");
    let first = c * CHUNK;
    let part = &w[first..(first + CHUNK).min(w.len())];
    first
        + (0..part.len())
            .rev()
            .find(|&j| keeps(part[j], first + j))
            .expect("a chunk with a kept weight")
}

/// The sum of the weights of `part` (starting at index `first`) that `cut` and `min_w` keep.
fn kept_sum(part: &[f32], first: usize, cut: Cut, min_w: f32, isa: Isa) -> f64 {
    match isa {
        // SAFETY: as in [`weights`].
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { simd::kept_sum_avx512(part, first, cut, min_w) },
        // SAFETY: as in [`weights`].
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::kept_sum_avx2(part, first, cut, min_w) },
        _ => kept_sum_portable(part, first, cut, min_w),
    }
}

/// The portable [`kept_sum`]; also the SIMD paths' tails.
fn kept_sum_portable(part: &[f32], first: usize, cut: Cut, min_w: f32) -> f64 {
    part.iter()
        .enumerate()
        .filter(|&(j, &x)| x >= min_w && cut.keeps(x, first + j))
        .map(|(_, &x)| x as f64)
        .sum()
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{
        kept_sum_portable, level_stats_portable, select_portable, weights_portable, Cut, LEVELS,
    };
    use crate::cpu_exp::{avx2::exp8, avx512::exp16};
    use std::arch::x86_64::*;

    /// Vectors summed in float32 lanes before their sum joins the float64 total.
    const LANE_RUN: usize = 64;

    /// [`super::weights`] sixteen lanes at a time.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weights_avx512(row: &[f32], max: f32, inv_t: f32, w: &mut [f32]) -> f64 {
        let n = row.len().min(w.len());
        let full = n / 16 * 16;
        let (m, it, floor) = (
            _mm512_set1_ps(max),
            _mm512_set1_ps(inv_t),
            _mm512_set1_ps(-87.0),
        );
        let (mut total, mut i) = (0.0f64, 0);
        while i < full {
            let end = (i + 16 * LANE_RUN).min(full);
            let mut acc = _mm512_setzero_ps();
            while i < end {
                let s = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row.as_ptr().add(i)), m), it);
                let live = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(s, floor);
                let e = _mm512_maskz_mov_ps(live, exp16(s));
                _mm512_storeu_ps(w.as_mut_ptr().add(i), e);
                acc = _mm512_add_ps(acc, e);
                i += 16;
            }
            total += _mm512_reduce_add_ps(acc) as f64;
        }
        total + weights_portable(&row[full..n], max, inv_t, &mut w[full..n])
    }

    /// [`super::weights`] eight lanes at a time.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weights_avx2(row: &[f32], max: f32, inv_t: f32, w: &mut [f32]) -> f64 {
        let n = row.len().min(w.len());
        let full = n / 8 * 8;
        let (m, it, floor) = (
            _mm256_set1_ps(max),
            _mm256_set1_ps(inv_t),
            _mm256_set1_ps(-87.0),
        );
        let (mut total, mut i) = (0.0f64, 0);
        while i < full {
            let end = (i + 8 * LANE_RUN).min(full);
            let mut acc = _mm256_setzero_ps();
            while i < end {
                let s = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row.as_ptr().add(i)), m), it);
                let live = _mm256_cmp_ps::<_CMP_GE_OQ>(s, floor);
                let e = _mm256_and_ps(live, exp8(s));
                _mm256_storeu_ps(w.as_mut_ptr().add(i), e);
                acc = _mm256_add_ps(acc, e);
                i += 8;
            }
            total += hsum8(acc) as f64;
        }
        total + weights_portable(&row[full..n], max, inv_t, &mut w[full..n])
    }

    #[target_feature(enable = "avx2")]
    unsafe fn hsum8(v: __m256) -> f32 {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        lanes.iter().sum()
    }

    /// [`super::level_stats`] sixteen lanes at a time.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn level_stats_avx512(w: &[f32]) -> [(u32, f64); LEVELS.len()] {
        let full = w.len() / 16 * 16;
        let floors = LEVELS.map(|f| _mm512_set1_ps(f));
        let mut out = [(0u32, 0.0f64); LEVELS.len()];
        let mut i = 0;
        while i < full {
            let end = (i + 16 * LANE_RUN).min(full);
            let mut acc = [_mm512_setzero_ps(); LEVELS.len()];
            while i < end {
                let x = _mm512_loadu_ps(w.as_ptr().add(i));
                // the levels are nested: below one floor, below every later one's... above
                if _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, floors[LEVELS.len() - 1]) != 0 {
                    for (j, a) in acc.iter_mut().enumerate() {
                        let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, floors[j]);
                        *a = _mm512_mask_add_ps(*a, m, *a, x);
                        out[j].0 += m.count_ones();
                    }
                }
                i += 16;
            }
            for (o, a) in out.iter_mut().zip(acc) {
                o.1 += _mm512_reduce_add_ps(a) as f64;
            }
        }
        for (o, t) in out.iter_mut().zip(level_stats_portable(&w[full..])) {
            o.0 += t.0;
            o.1 += t.1;
        }
        out
    }

    /// [`super::select`] sixteen lanes at a time: a vector without a selected weight costs
    /// two compares.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn select_avx512(
        w: &[f32],
        lo: u32,
        hi: u32,
        f: &mut impl FnMut(usize, f32),
    ) {
        let full = w.len() / 16 * 16;
        let (lo_v, hi_v) = (_mm512_set1_epi32(lo as i32), _mm512_set1_epi32(hi as i32));
        let mut i = 0;
        while i < full {
            let bits = _mm512_loadu_si512(w.as_ptr().add(i).cast());
            let mut m = _mm512_cmpge_epu32_mask(bits, lo_v) & _mm512_cmplt_epu32_mask(bits, hi_v);
            while m != 0 {
                let j = i + m.trailing_zeros() as usize;
                f(j, *w.get_unchecked(j));
                m &= m - 1;
            }
            i += 16;
        }
        select_portable(&w[full..], full, lo, hi, f);
    }

    /// [`super::select`] eight lanes at a time (the bits of non-negative floats are below
    /// 2^31, so signed compares order them).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn select_avx2(w: &[f32], lo: u32, hi: u32, f: &mut impl FnMut(usize, f32)) {
        let full = w.len() / 8 * 8;
        let (below, above) = (
            _mm256_set1_epi32(lo as i32 - 1),
            _mm256_set1_epi32(hi.min(i32::MAX as u32) as i32),
        );
        let mut i = 0;
        while i < full {
            let bits = _mm256_loadu_si256(w.as_ptr().add(i).cast());
            let inside = _mm256_and_si256(
                _mm256_cmpgt_epi32(bits, below),
                _mm256_cmpgt_epi32(above, bits),
            );
            let mut m = _mm256_movemask_ps(_mm256_castsi256_ps(inside)) as u32;
            while m != 0 {
                let j = i + m.trailing_zeros() as usize;
                f(j, *w.get_unchecked(j));
                m &= m - 1;
            }
            i += 8;
        }
        select_portable(&w[full..], full, lo, hi, f);
    }

    /// [`super::kept_sum`] sixteen lanes at a time.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn kept_sum_avx512(part: &[f32], first: usize, cut: Cut, min_w: f32) -> f64 {
        let full = part.len() / 16 * 16;
        let (cw, ci, mw) = (
            _mm512_set1_ps(cut.w),
            _mm512_set1_epi32(cut.idx as i32),
            _mm512_set1_ps(min_w),
        );
        let mut idx = _mm512_add_epi32(
            _mm512_set1_epi32(first as i32),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        );
        let step = _mm512_set1_epi32(16);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < full {
            let x = _mm512_loadu_ps(part.as_ptr().add(i));
            let above = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, cw);
            let tie = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, cw) & _mm512_cmple_epi32_mask(idx, ci);
            let keep = (above | tie) & _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, mw);
            acc = _mm512_mask_add_ps(acc, keep, acc, x);
            idx = _mm512_add_epi32(idx, step);
            i += 16;
        }
        _mm512_reduce_add_ps(acc) as f64
            + kept_sum_portable(&part[full..], first + full, cut, min_w)
    }

    /// [`super::kept_sum`] eight lanes at a time.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn kept_sum_avx2(part: &[f32], first: usize, cut: Cut, min_w: f32) -> f64 {
        let full = part.len() / 8 * 8;
        let (cw, ci, mw) = (
            _mm256_set1_ps(cut.w),
            _mm256_set1_epi32(cut.idx as i32),
            _mm256_set1_ps(min_w),
        );
        let mut idx = _mm256_add_epi32(
            _mm256_set1_epi32(first as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        let step = _mm256_set1_epi32(8);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < full {
            let x = _mm256_loadu_ps(part.as_ptr().add(i));
            let above = _mm256_cmp_ps::<_CMP_GT_OQ>(x, cw);
            // idx <= ci, as not (idx > ci): indices are below 2^31, so the signed compare holds
            let after = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, ci));
            let tie = _mm256_andnot_ps(after, _mm256_cmp_ps::<_CMP_EQ_OQ>(x, cw));
            let keep = _mm256_and_ps(_mm256_or_ps(above, tie), _mm256_cmp_ps::<_CMP_GE_OQ>(x, mw));
            acc = _mm256_add_ps(acc, _mm256_and_ps(keep, x));
            idx = _mm256_add_epi32(idx, step);
            i += 8;
        }
        hsum8(acc) as f64 + kept_sum_portable(&part[full..], first + full, cut, min_w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, uniform: f64) -> RowSampling {
        RowSampling {
            temperature,
            top_k,
            top_p,
            min_p,
            uniform,
        }
    }

    /// The reference distribution of a row, in float64 from the definition: each token's
    /// probability (0 where dropped).
    fn reference_probs(row: &[f32], p: &RowSampling) -> Vec<f64> {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = row
            .iter()
            .map(|&x| {
                let s = (x as f64 - max) / p.temperature as f64;
                if s >= -87.0 {
                    s.exp()
                } else {
                    0.0
                }
            })
            .collect();
        let mut order: Vec<usize> = (0..row.len()).filter(|&i| w[i] > 0.0).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
        if p.top_k > 0 && p.top_k < order.len() {
            order.truncate(p.top_k);
        }
        let z: f64 = order.iter().map(|&i| w[i]).sum();
        let mut kept = vec![0.0; row.len()];
        let mut mass = 0.0;
        for &i in &order {
            if mass > p.top_p as f64 * z {
                break;
            }
            mass += w[i];
            if w[i] >= p.min_p as f64 {
                kept[i] = w[i];
            }
        }
        let total: f64 = kept.iter().sum();
        kept.iter().map(|k| k / total).collect()
    }

    /// Whether the row's exact cut and the kernel's may disagree: a token whose predecessors'
    /// mass lies within rounding of the top-p target.
    fn near_a_boundary(row: &[f32], p: &RowSampling) -> bool {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut w: Vec<f64> = row
            .iter()
            .map(|&x| ((x as f64 - max) / p.temperature as f64).exp())
            .collect();
        w.sort_by(|a, b| b.total_cmp(a));
        if p.top_k > 0 && p.top_k < w.len() {
            w.truncate(p.top_k);
        }
        let z: f64 = w.iter().sum();
        let mut mass = 0.0;
        let near_min = p.min_p > 0.0 && w.iter().any(|&x| (x - p.min_p as f64).abs() < 1e-5);
        near_min
            || p.top_p < 1.0
                && w.iter().any(|&x| {
                    let close = (mass - p.top_p as f64 * z).abs() < 1e-5 * z;
                    mass += x;
                    close
                })
    }

    fn sample_one(row: &[f32], p: RowSampling, isa: Isa) -> usize {
        let mut s = Scratch::default();
        sample_row(row, &p, isa, &mut s)
    }

    #[test]
    fn weights_are_exp_and_zero_for_masked_logits_on_every_path() {
        let mut rng = Lcg(12);
        for len in [1, 7, 8, 16, 17, 100, 1029] {
            let mut row: Vec<f32> = (0..len).map(|_| rng.next_f32() * 50.0).collect();
            for (i, x) in row.iter_mut().enumerate() {
                match i % 5 {
                    1 => *x = f32::NEG_INFINITY,
                    3 if i % 3 == 0 => *x = f32::NAN,
                    _ => {}
                }
            }
            let max = span_of(&row, Isa::Portable).best;
            for isa in Isa::every_path() {
                let mut w = vec![f32::NAN; len];
                let total = weights(&row, max, 1.0 / 0.7f32, &mut w, isa);
                let mut sum = 0.0f64;
                for (i, (&x, &wi)) in row.iter().zip(&w).enumerate() {
                    let s = ((x - max) * (1.0 / 0.7f32)) as f64;
                    let want = if s >= -87.0 { s.exp() } else { 0.0 };
                    assert!(
                        (wi as f64 - want).abs() <= 1e-6 * want,
                        "{isa:?} {i}: {wi} {want}"
                    );
                    if !x.is_finite() {
                        assert_eq!(wi, 0.0, "{isa:?} {i}");
                    }
                    sum += wi as f64;
                }
                assert!((total - sum).abs() < 1e-6 * sum, "{isa:?}");
                let cut = Cut { w: w[0], idx: 0 };
                let want = kept_sum_portable(&w, 0, cut, 0.01);
                let got = kept_sum(&w, 0, cut, 0.01, isa);
                assert!((got - want).abs() <= 1e-6 * want, "{isa:?}");
                // the level sums and the selections: the portable loops' answers
                let want = level_stats_portable(&w);
                for (g, t) in level_stats(&w, isa).iter().zip(want) {
                    assert_eq!(g.0, t.0, "{isa:?}");
                    assert!((g.1 - t.1).abs() <= 1e-6 * t.1, "{isa:?}");
                }
                for (lo, hi) in [(FLOOR, 1.0f32), (0.001, 0.5), (0.25, 0.2578125)] {
                    let (lo, hi) = (lo.to_bits(), hi.to_bits() + 1);
                    let (mut want, mut got) = (vec![], vec![]);
                    select_portable(&w, 0, lo, hi, &mut |i, x| want.push((i, x)));
                    select(&w, lo, hi, isa, |i, x| got.push((i, x)));
                    assert_eq!(got, want, "{isa:?}");
                }
            }
        }
    }

    #[test]
    fn the_kept_set_is_the_definitions_on_every_path() {
        let mut rng = Lcg(3);
        let (mut checked, mut cases) = (0, 0);
        for len in [1, 2, 15, 16, 17, 100, 1000, 3000] {
            for scale in [0.1f32, 2.0, 8.0, 30.0] {
                let row: Vec<f32> = (0..len).map(|_| rng.next_f32() * scale).collect();
                for (t, k, tp, mp) in [
                    (1.0, 0, 1.0, 0.0),
                    (0.7, 0, 0.9, 0.0),
                    (1.0, 5, 1.0, 0.0),
                    (1.3, 40, 0.95, 0.0),
                    (0.5, 0, 1.0, 0.1),
                    (1.0, 3, 0.5, 0.05),
                    (2.0, 0, 0.999, 0.0),
                    (1.0, 0, 0.01, 0.0),
                ] {
                    let mut p = params(t, k, tp, mp, 0.0);
                    cases += 1;
                    if near_a_boundary(&row, &p) {
                        continue;
                    }
                    checked += 1;
                    let probs = reference_probs(&row, &p);
                    // u sweeps the distribution: every kept token, and only those, is drawn
                    let mut seen = vec![false; len];
                    for step in 0..400 {
                        p.uniform = step as f64 / 400.0;
                        for isa in Isa::every_path() {
                            let tok = sample_one(&row, p, isa);
                            assert!(probs[tok] > 0.0, "{isa:?} len {len} {p:?} drew {tok}");
                            seen[tok] = true;
                        }
                    }
                    for (i, &pr) in probs.iter().enumerate() {
                        if pr > 1.0 / 300.0 {
                            assert!(seen[i], "len {len} scale {scale} {p:?}: {i} ({pr}) never");
                        }
                    }
                }
            }
        }
        assert!(
            checked * 10 >= cases * 8,
            "only {checked} of {cases} rows away from a boundary"
        );
    }

    #[test]
    fn the_draw_inverts_the_cumulative_distribution() {
        // the token at u is the first in index order whose cumulative probability passes 1 - u
        let mut rng = Lcg(8);
        let row: Vec<f32> = (0..500).map(|_| rng.next_f32() * 4.0).collect();
        for p in [
            params(1.0, 0, 1.0, 0.0, 0.0),
            params(0.8, 20, 0.9, 0.0, 0.0),
            params(1.2, 0, 0.8, 0.02, 0.0),
        ] {
            let probs = reference_probs(&row, &p);
            for step in 0..997 {
                let u = step as f64 / 997.0;
                let target = 1.0 - u;
                let mut acc = 0.0;
                let want = (0..row.len())
                    .find(|&i| {
                        acc += probs[i];
                        acc >= target
                    })
                    .unwrap_or(row.len() - 1);
                // away from the boundaries, where float32 weights may round either way
                let before: f64 = probs[..want].iter().sum();
                if (before - target).abs() < 1e-5 || (acc - target).abs() < 1e-5 {
                    continue;
                }
                for isa in Isa::every_path() {
                    let got = sample_one(&row, RowSampling { uniform: u, ..p }, isa);
                    assert_eq!(got, want, "{isa:?} {p:?} u {u}");
                }
            }
        }
    }

    #[test]
    fn the_histogram_cut_is_the_exact_cut() {
        let mut rng = Lcg(21);
        let mut s = Hist::default();
        for len in [7, 64, 1000, 49152] {
            for scale in [0.5f32, 3.0, 12.0] {
                // random rows, and rows of many equal values (ties across the cut)
                for tied in [false, true] {
                    let row: Vec<f32> = (0..len)
                        .map(|_| {
                            let x = rng.next_f32() * scale;
                            if tied {
                                (x * 4.0).round() / 4.0
                            } else {
                                x
                            }
                        })
                        .collect();
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut w = vec![0.0; len];
                    let total = weights_portable(&row, max, 1.0, &mut w);
                    for (k, tp) in [(0, 0.9), (10, 1.0), (100, 0.95), (0, 0.3), (3, 0.2)] {
                        if k >= len && tp == 1.0 {
                            continue;
                        }
                        let p = params(1.0, k, tp, 0.0, 0.0);
                        if near_a_boundary(&row, &p) {
                            continue;
                        }
                        let want = cut_exact(&w, total, k, tp);
                        for isa in Isa::every_path() {
                            assert_eq!(
                                cut_of(&w, total, k, tp, &mut s, isa),
                                want,
                                "{isa:?} len {len} scale {scale} tied {tied} k {k} p {tp}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn masked_tokens_are_never_drawn() {
        let mut rng = Lcg(4);
        for len in [5, 16, 33, 2000] {
            let mut row: Vec<f32> = (0..len).map(|_| rng.next_f32()).collect();
            // every other token masked, and NaN in a few places: weight 0
            for (i, x) in row.iter_mut().enumerate() {
                if i % 2 == 1 {
                    *x = f32::NEG_INFINITY;
                } else if i % 7 == 4 {
                    *x = f32::NAN;
                }
            }
            for isa in Isa::every_path() {
                for step in 0..200 {
                    for p in [
                        params(5.0, 0, 1.0, 0.0, step as f64 / 200.0),
                        params(5.0, len, 0.99, 0.0, step as f64 / 200.0),
                    ] {
                        let tok = sample_one(&row, p, isa);
                        assert!(row[tok].is_finite(), "{isa:?} drew {tok} ({})", row[tok]);
                    }
                }
            }
        }
    }

    #[test]
    fn greedy_rows_and_rows_without_a_finite_maximum_take_the_argmax() {
        let row = [0.5f32, 3.0, -1.0, 3.0, 2.0];
        for isa in Isa::every_path() {
            assert_eq!(sample_one(&row, params(0.0, 0, 1.0, 0.0, 0.3), isa), 1);
            assert_eq!(sample_one(&row, params(-1.0, 0, 1.0, 0.0, 0.3), isa), 1);
            let inf = [0.0f32, f32::INFINITY, 1.0, f32::INFINITY];
            assert_eq!(sample_one(&inf, params(1.0, 0, 0.9, 0.0, 0.5), isa), 1);
            let none = [f32::NEG_INFINITY; 4];
            assert_eq!(sample_one(&none, params(1.0, 0, 1.0, 0.0, 0.5), isa), 0);
        }
    }

    #[test]
    fn a_tiny_temperature_draws_the_argmax() {
        let mut rng = Lcg(6);
        let row: Vec<f32> = (0..1000).map(|_| rng.next_f32() * 8.0).collect();
        let want = span_of(&row, Isa::Portable).token;
        for t in [1e-6f32, 1e-30, 1e-38, 1e-44] {
            for isa in Isa::every_path() {
                for u in [0.0, 0.5, 0.999_999] {
                    assert_eq!(sample_one(&row, params(t, 0, 0.9, 0.0, u), isa), want);
                }
            }
        }
    }

    #[test]
    fn rows_over_threads_match_row_by_row() {
        let mut rng = Lcg(9);
        for (rows, vocab) in [(1, 49152), (7, 1000), (16, 4096)] {
            let logits: Vec<f32> = (0..rows * vocab).map(|_| rng.next_f32() * 6.0).collect();
            let ps: Vec<RowSampling> = (0..rows)
                .map(|r| {
                    let u = (r as f64 * 0.37) % 1.0;
                    params(0.5 + r as f32 * 0.1, r % 3 * 20, 0.9, 0.0, u)
                })
                .collect();
            let mut want = vec![0; rows];
            sample_rows_f32(&logits, vocab, &ps, &mut want, 1).unwrap();
            for r in 0..rows {
                let row = &logits[r * vocab..(r + 1) * vocab];
                assert_eq!(want[r], sample_one(row, ps[r], Isa::detect(Isa::Avx512)));
            }
            for threads in [2, 3] {
                let mut got = vec![0; rows];
                sample_rows_f32(&logits, vocab, &ps, &mut got, threads).unwrap();
                assert_eq!(got, want, "{rows} rows, {threads} threads");
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let logits = vec![0.0f32; 8];
        let ok = params(1.0, 0, 1.0, 0.0, 0.5);
        let mut out = vec![0; 2];
        assert!(sample_rows_f32(&logits, 4, &[ok, ok], &mut out, 1).is_ok());
        assert!(sample_rows_f32(&logits, 3, &[ok, ok], &mut out, 1).is_err());
        assert!(sample_rows_f32(&logits, 4, &[ok], &mut out, 1).is_err());
        assert!(sample_rows_f32(&logits, 0, &[], &mut [], 1).is_err());
        for bad in [
            params(1.0, 0, 0.0, 0.0, 0.5),
            params(1.0, 0, 1.5, 0.0, 0.5),
            params(1.0, 0, f32::NAN, 0.0, 0.5),
            params(1.0, 0, 1.0, -0.1, 0.5),
            params(1.0, 0, 1.0, 0.0, 1.0),
            params(1.0, 0, 1.0, 0.0, -0.5),
            params(f32::NAN, 0, 1.0, 0.0, 0.5),
        ] {
            assert!(
                sample_rows_f32(&logits, 4, &[ok, bad], &mut out, 1).is_err(),
                "{bad:?}"
            );
        }
    }
}
