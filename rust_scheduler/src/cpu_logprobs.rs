//! Logprobs of a step's rows on the CPU: per row its log-normalizer, the chosen token's
//! logprob and the `n` most likely tokens with theirs, in two passes over the row where torch
//! wrote a whole `log_softmax` of every row and then ran `topk` over it.
//!
//! The values are `log_softmax`'s: `x - (max + ln(sum(exp(x - max))))`, the sum in float64 of
//! float32 exponentials (within float32 rounding of torch's).
//!
//! Invariants:
//! - The top tokens come in descending order of their logits, equal logits by lower index; a
//!   row with fewer than `n` values above -inf fills up with its -inf ones, then its NaN ones,
//!   by index, so every slot names a token (`n` is at most the vocabulary).
//! - A logit of -inf has logprob -inf; a row without a finite largest logit (+inf somewhere, or
//!   nothing above -inf) gets NaN logprobs (as torch's).
//! - Rows are split over the kernels' pool, a row per task at a time.

use crate::cpu_error::KernelInputError;
use crate::cpu_greedy::span_of;
use crate::cpu_isa::Isa;
use crate::cpu_pool::{for_each_item, SharedMut};
use crate::cpu_sampling::weights;
use std::cell::RefCell;

/// A thread's row of exponentials and its top-n buffer.
type Scratch = (Vec<f32>, Vec<(f32, u32)>);

thread_local! {
    static SCRATCH: RefCell<Scratch> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Per row `r` of `logits` (`[rows, vocab]`, row-major): `chosen[r]` = the logprob of token
/// `tokens[r]`, and `top_ids[r * n..][..n]` / `top_values[r * n..][..n]` the `n` most likely
/// tokens and their logprobs, over up to `num_threads` threads.
#[allow(clippy::too_many_arguments)]
pub fn logprobs_rows_f32(
    logits: &[f32],
    vocab: usize,
    tokens: &[usize],
    n: usize,
    chosen: &mut [f32],
    top_ids: &mut [i64],
    top_values: &mut [f32],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    let rows = tokens.len();
    if vocab == 0
        || logits.len() != rows * vocab
        || chosen.len() != rows
        || top_ids.len() != rows * n
        || top_values.len() != rows * n
    {
        return Err(KernelInputError(format!(
            "logits have {} values, chosen {}, top ids {} and top values {}; {rows} rows of \
             {vocab} with {n} top tokens need {}, {rows}, {} and {}",
            logits.len(),
            chosen.len(),
            top_ids.len(),
            top_values.len(),
            rows * vocab,
            rows * n,
            rows * n
        )));
    }
    if n > vocab {
        return Err(KernelInputError(format!(
            "{n} top tokens of a vocabulary of {vocab}"
        )));
    }
    if let Some((r, t)) = tokens.iter().enumerate().find(|(_, &t)| t >= vocab) {
        return Err(KernelInputError(format!(
            "row {r}: token {t} is outside the vocabulary of {vocab}"
        )));
    }
    let isa = Isa::detect(Isa::Avx512);
    let (chosen_ptr, ids_ptr, values_ptr) = (
        SharedMut(chosen.as_mut_ptr()),
        SharedMut(top_ids.as_mut_ptr()),
        SharedMut(top_values.as_mut_ptr()),
    );
    for_each_item(rows, num_threads, &|r| {
        let row = &logits[r * vocab..(r + 1) * vocab];
        SCRATCH.with(|s| {
            let (w, top) = &mut *s.borrow_mut();
            let lse = log_normalizer(row, isa, w);
            top_n(row, n, isa, top);
            // SAFETY: `for_each_item` calls each `r < rows` once, so the calls write disjoint
            // elements (`r`, and `r * n..(r + 1) * n`) of buffers that outlive the call.
            unsafe {
                chosen_ptr.get().add(r).write(row[tokens[r]] - lse);
                for (j, &(x, i)) in top.iter().enumerate() {
                    ids_ptr.get().add(r * n + j).write(i as i64);
                    values_ptr.get().add(r * n + j).write(x - lse);
                }
            }
        })
    });
    Ok(())
}

/// `max + ln(sum(exp(x - max)))` of the row (NaN without a finite largest value).
fn log_normalizer(row: &[f32], isa: Isa, w: &mut Vec<f32>) -> f32 {
    let max = span_of(row, isa).best;
    if !max.is_finite() {
        return f32::NAN;
    }
    w.resize(row.len(), 0.0);
    let sum = weights(row, max, 1.0, w, isa);
    (max as f64 + sum.ln()) as f32
}

/// The `n` largest values of `row` with their indices into `top`, descending (equal values by
/// lower index); a row with fewer than `n` values above -inf fills up with its -inf values,
/// then its NaN ones, by index.
fn top_n(row: &[f32], n: usize, isa: Isa, top: &mut Vec<(f32, u32)>) {
    top.clear();
    if n == 0 {
        return;
    }
    let mut keep = |x: f32, i: usize, top: &mut Vec<(f32, u32)>| -> f32 {
        // called in index order for values above the threshold: insert after equal ones
        let at = top.partition_point(|&(y, _)| y >= x);
        if top.len() == n {
            top.pop();
        }
        top.insert(at, (x, i as u32));
        if top.len() == n {
            top[n - 1].0
        } else {
            NEG_INF
        }
    };
    match isa {
        // SAFETY: `isa` came from `Isa::detect` (or a test's narrower pick), so the CPU has
        // AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => unsafe { simd::scan_avx512(row, top, &mut keep) },
        // SAFETY: as above, AVX2.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { simd::scan_avx2(row, top, &mut keep) },
        _ => {
            scan_portable(row, 0, NEG_INF, top, &mut keep);
        }
    }
    for wanted in [|x: f32| x == NEG_INF, |x: f32| x.is_nan()] {
        for (i, &x) in row.iter().enumerate() {
            if top.len() == n {
                return;
            }
            if wanted(x) {
                top.push((x, i as u32));
            }
        }
    }
}

const NEG_INF: f32 = f32::NEG_INFINITY;

/// The portable scan of `part` (starting at index `first`): each value above `thr` goes to
/// `keep`, which returns the new threshold (-inf and NaN never pass).
fn scan_portable(
    part: &[f32],
    first: usize,
    mut thr: f32,
    top: &mut Vec<(f32, u32)>,
    keep: &mut impl FnMut(f32, usize, &mut Vec<(f32, u32)>) -> f32,
) -> f32 {
    for (j, &x) in part.iter().enumerate() {
        if x > thr {
            thr = keep(x, first + j, top);
        }
    }
    thr
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{scan_portable, NEG_INF};
    use std::arch::x86_64::*;

    /// [`super::top_n`]'s scan sixteen lanes at a time: a vector without a value above the
    /// threshold costs one compare.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scan_avx512(
        row: &[f32],
        top: &mut Vec<(f32, u32)>,
        keep: &mut impl FnMut(f32, usize, &mut Vec<(f32, u32)>) -> f32,
    ) {
        let full = row.len() / 16 * 16;
        let mut thr = NEG_INF;
        let mut i = 0;
        while i < full {
            let x = _mm512_loadu_ps(row.as_ptr().add(i));
            let mut m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(thr));
            while m != 0 {
                let j = i + m.trailing_zeros() as usize;
                let v = *row.get_unchecked(j);
                if v > thr {
                    thr = keep(v, j, top);
                }
                m &= m - 1;
            }
            i += 16;
        }
        scan_portable(&row[full..], full, thr, top, keep);
    }

    /// [`scan_avx512`] at eight lanes.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn scan_avx2(
        row: &[f32],
        top: &mut Vec<(f32, u32)>,
        keep: &mut impl FnMut(f32, usize, &mut Vec<(f32, u32)>) -> f32,
    ) {
        let full = row.len() / 8 * 8;
        let mut thr = NEG_INF;
        let mut i = 0;
        while i < full {
            let x = _mm256_loadu_ps(row.as_ptr().add(i));
            let above = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(thr));
            let mut m = _mm256_movemask_ps(above) as u32;
            while m != 0 {
                let j = i + m.trailing_zeros() as usize;
                let v = *row.get_unchecked(j);
                if v > thr {
                    thr = keep(v, j, top);
                }
                m &= m - 1;
            }
            i += 8;
        }
        scan_portable(&row[full..], full, thr, top, keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    /// The reference top-n: a stable sort of the values above -inf (descending), then the -inf
    /// ones and the NaN ones by index.
    fn reference_top(row: &[f32], n: usize) -> Vec<(f32, u32)> {
        let mut order: Vec<(f32, u32)> = row
            .iter()
            .enumerate()
            .filter(|(_, &x)| x > NEG_INF)
            .map(|(i, &x)| (x, i as u32))
            .collect();
        order.sort_by(|a, b| b.0.total_cmp(&a.0));
        for wanted in [|x: f32| x == NEG_INF, |x: f32| x.is_nan()] {
            order.extend(
                row.iter()
                    .enumerate()
                    .filter(|(_, &x)| wanted(x))
                    .map(|(i, &x)| (x, i as u32)),
            );
        }
        order.truncate(n);
        order
    }

    fn same(a: &[(f32, u32)], b: &[(f32, u32)]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.1 == y.1 && x.0.to_bits() == y.0.to_bits())
    }

    #[test]
    fn the_top_tokens_are_a_stable_sorts_on_every_path() {
        let mut rng = Lcg(31);
        let mut top = Vec::new();
        for len in [1, 5, 16, 17, 40, 1000, 4099] {
            for kind in 0..4 {
                let row: Vec<f32> = (0..len)
                    .map(|i| match kind {
                        0 => rng.next_f32() * 10.0,
                        // a handful of values: ties everywhere
                        1 => [-1.0, 0.5, 2.0, 2.0][rng.below(4)],
                        // mostly masked: fewer than n values above -inf
                        2 if i % 9 != 0 => NEG_INF,
                        3 if i % 7 == 3 => f32::NAN,
                        _ => rng.next_f32(),
                    })
                    .collect();
                for n in [1, 2, 5, 20] {
                    if n > len {
                        continue;
                    }
                    let want = reference_top(&row, n);
                    for isa in Isa::every_path() {
                        top_n(&row, n, isa, &mut top);
                        assert!(same(&top, &want), "{isa:?} len {len} kind {kind} n {n}");
                    }
                }
            }
        }
    }

    #[test]
    fn logprobs_are_log_softmax_in_float64_within_rounding() {
        let mut rng = Lcg(5);
        let (rows, vocab, n) = (6, 3000, 5);
        let mut logits: Vec<f32> = (0..rows * vocab).map(|_| rng.next_f32() * 12.0).collect();
        logits[vocab + 3] = NEG_INF; // a masked token: logprob -inf
        logits[2 * vocab + 10] = 30.0; // a peaked row
        let tokens: Vec<usize> = vec![0, 3, 10, 2999, 1500, 7];
        for threads in [1, 2] {
            let (mut chosen, mut ids, mut values) =
                (vec![0f32; rows], vec![0i64; rows * n], vec![0f32; rows * n]);
            logprobs_rows_f32(
                &logits,
                vocab,
                &tokens,
                n,
                &mut chosen,
                &mut ids,
                &mut values,
                threads,
            )
            .unwrap();
            for r in 0..rows {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let max = row.iter().copied().fold(NEG_INF, f32::max) as f64;
                let lse = max
                    + row
                        .iter()
                        .map(|&x| (x as f64 - max).exp())
                        .sum::<f64>()
                        .ln();
                // within a few float32 roundings of the larger of x and the normalizer
                let close = |got: f32, x: f32| {
                    let want = x as f64 - lse;
                    (got as f64 - want).abs() <= 2.5e-7 * (x.abs() as f64).max(lse.abs()).max(1.0)
                };
                let x = row[tokens[r]];
                if x == NEG_INF {
                    assert_eq!(chosen[r], NEG_INF);
                } else {
                    assert!(close(chosen[r], x), "row {r}: {} vs {x}", chosen[r]);
                }
                let want = reference_top(row, n);
                for j in 0..n {
                    assert_eq!(ids[r * n + j], want[j].1 as i64, "row {r} slot {j}");
                    assert!(close(values[r * n + j], want[j].0), "row {r} slot {j}");
                }
            }
        }
    }

    #[test]
    fn a_row_without_a_finite_maximum_gets_nan_and_bad_inputs_are_errors() {
        let logits = [0.0f32, f32::INFINITY, 1.0, 2.0];
        let (mut c, mut ids, mut v) = (vec![0f32; 1], vec![0i64; 2], vec![0f32; 2]);
        logprobs_rows_f32(&logits, 4, &[0], 2, &mut c, &mut ids, &mut v, 1).unwrap();
        assert!(c[0].is_nan() && v.iter().all(|x| x.is_nan()));
        assert_eq!(ids, vec![1, 3]);
        let e = |vocab, tokens: &[usize], n, c: &mut [f32], ids: &mut [i64], v: &mut [f32]| {
            logprobs_rows_f32(&logits, vocab, tokens, n, c, ids, v, 1).is_err()
        };
        assert!(e(4, &[4], 0, &mut [0.0], &mut [], &mut []));
        assert!(e(4, &[0], 5, &mut [0.0], &mut [0; 5], &mut [0.0; 5]));
        assert!(e(3, &[0], 0, &mut [0.0], &mut [], &mut []));
        assert!(e(4, &[0], 1, &mut [0.0], &mut [0; 2], &mut [0.0]));
        assert!(e(0, &[], 0, &mut [], &mut [], &mut []));
    }
}
