//! Greedy sampling's read of a step's logits on the CPU: per row, the index of its largest value
//! and whether every value in it is finite, in one pass over the row (where torch took two: a
//! finite check, then `argmax`).
//!
//! Invariants:
//! - A row whose values are all finite gets the index `torch.argmax` gives: the first of its
//!   largest values (ties to the lowest index; `-0.0` and `0.0` are equal).
//! - A row holding a NaN or an infinity gets `finite = false` and an unspecified index: the
//!   caller must not sample from it (the engine's general path fails its request).
//! - The SIMD paths give the portable path's answer for every input (tested on ties, signed
//!   zeros, NaN and infinities at every position of a vector).
//! - The vocabulary is split over the kernels' pool in contiguous spans, task `t` taking span
//!   `t` of every row (the split of the LM head's output features: `cpu_amx_linear` gives task
//!   `t` the `t`-th run of feature tiles, so each task reads the logits its own core wrote);
//!   the spans' answers merge in span order, the lower index winning a tie.

use crate::cpu_error::KernelInputError;
use crate::cpu_isa::Isa;

/// Below this many logits per task, fewer tasks (waking a worker costs more).
const MIN_VALUES_PER_TASK: usize = 32 * 1024;

/// One row's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GreedyRow {
    /// the index of the row's first largest value (unspecified when `!finite`)
    pub token: usize,
    /// every value of the row is finite
    pub finite: bool,
}

/// A span of a row: its largest value, that value's first index in the span, and whether every
/// value in it is finite (`best` -inf and `token` 0 for a span without a value above -inf).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    pub(crate) best: f32,
    pub(crate) token: usize,
    pub(crate) finite: bool,
}

/// [`GreedyRow`] of each of the `rows` rows of `logits` (`[rows, vocab]`, row-major) into
/// `out` (`rows` long), over up to `num_threads` threads.
pub fn greedy_rows_f32(
    logits: &[f32],
    vocab: usize,
    out: &mut [GreedyRow],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    let isa = Isa::detect(Isa::Avx512);
    let rows = out.len();
    if vocab == 0 {
        return Err(KernelInputError("the vocabulary is empty".into()));
    }
    if logits.len() != rows * vocab {
        return Err(KernelInputError(format!(
            "logits have {} values; {rows} rows of {vocab} need {}",
            logits.len(),
            rows * vocab
        )));
    }
    let wanted = num_threads
        .min((rows * vocab).div_ceil(MIN_VALUES_PER_TASK))
        .max(1);
    let pool = (wanted > 1).then(|| crate::cpu_pool::global(wanted));
    let tasks = pool.map_or(1, |p| wanted.min(p.max_tasks()));
    // span t: columns t * per.. of every row, in whole 16-feature tiles (the LM head's split)
    let per = vocab.div_ceil(16).div_ceil(tasks) * 16;
    let empty = Span {
        best: f32::NEG_INFINITY,
        token: 0,
        finite: true,
    };
    let mut spans = vec![empty; tasks * rows];
    let spans_ptr = crate::cpu_pool::SharedMut(spans.as_mut_ptr());
    let job = |t: usize| {
        let (c0, c1) = ((t * per).min(vocab), ((t + 1) * per).min(vocab));
        for r in 0..rows {
            let mut span = span_of(&logits[r * vocab + c0..r * vocab + c1], isa);
            span.token += c0;
            // SAFETY: `t < tasks` and `r < rows`, so the element is inside `spans`, which
            // outlives the job (`run` returns after every task); each task index runs once
            // and writes only its own row of `spans`.
            unsafe { spans_ptr.get().add(t * rows + r).write(span) };
        }
    };
    match pool {
        Some(pool) if tasks > 1 => pool.run(tasks, &job),
        _ => job(0),
    }
    for (r, o) in out.iter_mut().enumerate() {
        let (mut best, mut token, mut finite) = (f32::NEG_INFINITY, 0, true);
        for t in 0..tasks {
            let span = spans[t * rows + r];
            finite &= span.finite;
            if span.best > best {
                (best, token) = (span.best, span.token);
            }
        }
        *o = GreedyRow { token, finite };
    }
    Ok(())
}

/// One span's [`Span`] on the widest path `isa` allows (also `cpu_sampling`'s row maximum).
pub(crate) fn span_of(values: &[f32], isa: Isa) -> Span {
    match isa {
        // SAFETY: `isa` came from `Isa::detect` (or a test's narrower pick of it), so the CPU
        // has AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { simd::span_avx512(values) },
        // SAFETY: as above, AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::span_avx2(values) },
        _ => span_portable(values),
    }
}

/// The reference: a plain loop (`>` keeps the first of equal values; NaN compares false).
fn span_portable(values: &[f32]) -> Span {
    let (mut best, mut token, mut finite) = (f32::NEG_INFINITY, 0, true);
    for (i, &x) in values.iter().enumerate() {
        finite &= x.is_finite();
        if x > best {
            (best, token) = (x, i);
        }
    }
    Span {
        best,
        token,
        finite,
    }
}

/// The span's answer from per-lane maxima `maxv` at per-lane indices `idx` (each lane's first
/// largest value) and the portable tail at `tail_start`: the largest value, the lowest index
/// among its equals.
fn merge_lanes(maxv: &[f32], idx: &[u32], tail: &[f32], tail_start: usize) -> (f32, usize) {
    let (mut best, mut token) = (f32::NEG_INFINITY, 0);
    for (&m, &i) in maxv.iter().zip(idx) {
        if m > best || (m == best && (i as usize) < token) {
            (best, token) = (m, i as usize);
        }
    }
    for (k, &x) in tail.iter().enumerate() {
        if x > best {
            (best, token) = (x, tail_start + k);
        }
    }
    (best, token)
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{merge_lanes, Span};
    use std::arch::x86_64::*;

    /// Sixteen lanes: per lane, the largest value so far and its index (replaced only by a
    /// strictly larger one); `x * 0` summed into `bad`, which turns NaN at any NaN or infinity.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn span_avx512(row: &[f32]) -> Span {
        let n = row.len();
        let full = n / 16 * 16;
        if full > u32::MAX as usize {
            return super::span_portable(row);
        }
        let p = row.as_ptr();
        let (mut maxv, mut idx) = (_mm512_set1_ps(f32::NEG_INFINITY), _mm512_setzero_si512());
        let (mut cur, step) = (
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(16),
        );
        let (zero, mut bad) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i < full {
            let x = _mm512_loadu_ps(p.add(i));
            bad = _mm512_fmadd_ps(x, zero, bad);
            let more = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, maxv);
            maxv = _mm512_mask_mov_ps(maxv, more, x);
            idx = _mm512_mask_mov_epi32(idx, more, cur);
            cur = _mm512_add_epi32(cur, step);
            i += 16;
        }
        let (mut m, mut ix, mut b) = ([0f32; 16], [0u32; 16], [0f32; 16]);
        _mm512_storeu_ps(m.as_mut_ptr(), maxv);
        _mm512_storeu_si512(ix.as_mut_ptr().cast(), idx);
        _mm512_storeu_ps(b.as_mut_ptr(), bad);
        finish(&m, &ix, &b, row, full)
    }

    /// [`span_avx512`] at eight lanes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn span_avx2(row: &[f32]) -> Span {
        let n = row.len();
        let full = n / 8 * 8;
        if full > u32::MAX as usize {
            return super::span_portable(row);
        }
        let p = row.as_ptr();
        let (mut maxv, mut idx) = (_mm256_set1_ps(f32::NEG_INFINITY), _mm256_setzero_si256());
        let (mut cur, step) = (
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(8),
        );
        let (zero, mut bad) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < full {
            let x = _mm256_loadu_ps(p.add(i));
            bad = _mm256_fmadd_ps(x, zero, bad);
            let more = _mm256_cmp_ps::<_CMP_GT_OQ>(x, maxv);
            maxv = _mm256_blendv_ps(maxv, x, more);
            idx = _mm256_castps_si256(_mm256_blendv_ps(
                _mm256_castsi256_ps(idx),
                _mm256_castsi256_ps(cur),
                more,
            ));
            cur = _mm256_add_epi32(cur, step);
            i += 8;
        }
        let (mut m, mut ix, mut b) = ([0f32; 8], [0u32; 8], [0f32; 8]);
        _mm256_storeu_ps(m.as_mut_ptr(), maxv);
        _mm256_storeu_si256(ix.as_mut_ptr().cast(), idx);
        _mm256_storeu_ps(b.as_mut_ptr(), bad);
        finish(&m, &ix, &b, row, full)
    }

    /// The lanes merged with the tail `row[full..]` (portable), and the finite flag.
    fn finish(m: &[f32], ix: &[u32], bad: &[f32], row: &[f32], full: usize) -> Span {
        let tail = &row[full..];
        let (best, token) = merge_lanes(m, ix, tail, full);
        let finite = bad.iter().all(|b| *b == 0.0) && tail.iter().all(|x| x.is_finite());
        Span {
            best,
            token,
            finite,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    fn check_row(row: &[f32]) {
        let want = span_portable(row);
        if want.finite {
            // the reference itself against the definition: the first index of the maximum
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(want.token, row.iter().position(|&x| x == max).unwrap());
        } else {
            assert!(row.iter().any(|x| !x.is_finite()));
        }
        for isa in Isa::every_path() {
            let got = span_of(row, isa);
            assert_eq!(got.finite, want.finite, "{isa:?} {row:?}");
            if want.finite {
                assert_eq!(
                    (got.token, got.best),
                    (want.token, want.best),
                    "{isa:?} {row:?}"
                );
            }
        }
    }

    #[test]
    fn every_path_finds_the_first_maximum_and_flags_non_finite_rows() {
        let mut rng = Lcg(11);
        for len in [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100, 1000, 4099] {
            // random values; then a few values from a tiny set (many ties), signed zeros
            let row: Vec<f32> = (0..len).map(|_| rng.next_f32() * 20.0 - 10.0).collect();
            check_row(&row);
            let row: Vec<f32> = (0..len)
                .map(|_| [-1.0, 0.0, -0.0, 2.0][rng.below(4)])
                .collect();
            check_row(&row);
            let row = vec![-3.5f32; len];
            check_row(&row);
            // the maximum at every position, and ties of it at two positions
            for at in 0..len.min(40) {
                let mut row: Vec<f32> = (0..len).map(|_| rng.next_f32()).collect();
                row[at] = 5.0;
                check_row(&row);
                let tie = rng.below(len);
                row[tie] = 5.0;
                check_row(&row);
            }
            // NaN / +-inf / the largest and smallest finite values at each position
            for bad in [
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::MAX,
                f32::MIN,
            ] {
                for at in (0..len).step_by(len.div_ceil(20).max(1)) {
                    let mut row: Vec<f32> = (0..len).map(|_| rng.next_f32()).collect();
                    row[at] = bad;
                    check_row(&row);
                }
            }
        }
    }

    #[test]
    fn rows_over_threads_match_row_by_row() {
        let mut rng = Lcg(5);
        for (rows, vocab) in [(1, 49152), (3, 1000), (16, 49152), (40, 5000), (5, 1)] {
            let mut logits: Vec<f32> = (0..rows * vocab).map(|_| rng.next_f32()).collect();
            if rows > 2 {
                logits[2 * vocab + vocab / 2] = f32::NAN; // row 2 is not finite
            }
            for threads in [1, 2, 4] {
                let mut out = vec![
                    GreedyRow {
                        token: usize::MAX,
                        finite: false
                    };
                    rows
                ];
                greedy_rows_f32(&logits, vocab, &mut out, threads).unwrap();
                for (r, got) in out.iter().enumerate() {
                    let want = span_portable(&logits[r * vocab..][..vocab]);
                    assert_eq!(got.finite, want.finite, "row {r}");
                    assert_eq!(got.finite, !(rows > 2 && r == 2));
                    if want.finite {
                        assert_eq!(got.token, want.token, "row {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn ties_across_the_threads_spans_go_to_the_lower_index() {
        // two tasks split 49,152 columns at 24,576: maxima on both sides of the split
        let vocab = 49152;
        for (a, b) in [(100, 30000), (24575, 24576), (0, 49151), (24576, 49151)] {
            let mut row = vec![0.5f32; vocab];
            row[a] = 9.0;
            row[b] = 9.0;
            for threads in [1, 2, 3] {
                let mut out = [GreedyRow {
                    token: usize::MAX,
                    finite: false,
                }];
                greedy_rows_f32(&row, vocab, &mut out, threads).unwrap();
                assert_eq!(
                    out[0],
                    GreedyRow {
                        token: a,
                        finite: true
                    },
                    "{a} {b} {threads}"
                );
            }
            // a larger value in the upper span wins over the lower span's
            row[b] = 9.5;
            let mut out = [GreedyRow {
                token: 0,
                finite: false,
            }];
            greedy_rows_f32(&row, vocab, &mut out, 2).unwrap();
            assert_eq!(out[0].token, b);
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut out = vec![
            GreedyRow {
                token: 0,
                finite: true
            };
            2
        ];
        assert!(greedy_rows_f32(&[0.0; 7], 4, &mut out, 1).is_err());
        assert!(greedy_rows_f32(&[], 0, &mut out, 1).is_err());
        assert!(greedy_rows_f32(&[], 4, &mut [], 1).is_ok());
    }
}
