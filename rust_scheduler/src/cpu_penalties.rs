//! The sampler's penalties on the CPU, in place on a step's logits: per row, work in proportion
//! to the tokens the row has seen, where torch built a `[rows, vocab]` count tensor and ran
//! several full-row passes over it (a 16-row step of SmolLM2's 49,152 logits with a repetition
//! penalty: ~10 ms).
//!
//! The arithmetic is the torch sampler's (`Sampler._apply_penalties`), value for value:
//! - repetition (`r != 1`), once per distinct token among the row's prompt and output tokens:
//!   `x / r` where `x > 0`, else `x * r`, clamped to the finite float32 range;
//! - then frequency `f` and presence `p`, per distinct token among the output tokens alone,
//!   seen `c` times: `x - f * c`, then `- p` (float32, in that order).
//!
//! Invariants:
//! - Only the logits of tokens in the row's lists change; every other value is untouched.
//! - A token id outside the vocabulary is an error before any logit is written.
//! - Each thread's scratch (a stamp and a count per vocabulary entry) is back to its resting
//!   state after every row: counts 0, stamps below the next row's.
//! - Rows are split over the kernels' pool only for calls of more than 32,768 tokens (a
//!   16-row step of 1,000-token histories takes ~0.1 ms on one thread).

use crate::cpu_error::KernelInputError;
use crate::cpu_pool::{for_each_item, SharedMut};
use std::cell::RefCell;

/// Below this many tokens per task, fewer tasks.
const MIN_TOKENS_PER_TASK: usize = 32 * 1024;

/// One row's penalties (`repetition` 1 and the others 0: none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowPenalties {
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
}

/// A row's token lists: `seen` (prompt and output: repetition) and `counted` (output alone:
/// frequency and presence), each a range of the call's flat token array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowTokens {
    pub seen: (usize, usize),
    pub counted: (usize, usize),
}

/// A thread's reused marks.
#[derive(Default)]
struct Scratch {
    /// per vocabulary entry, the last row stamp that penalized it for repetition
    stamp: Vec<u32>,
    /// the row's next stamp
    next: u32,
    /// per vocabulary entry, its count among the row's counted tokens (0 between rows)
    count: Vec<u32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Applies each row's [`RowPenalties`] to its row of `logits` (`[rows, vocab]`, row-major) in
/// place, the rows' tokens read from `tokens` at their [`RowTokens`] ranges, over up to
/// `num_threads` threads.
pub fn apply_penalties_f32(
    logits: &mut [f32],
    vocab: usize,
    penalties: &[RowPenalties],
    rows: &[RowTokens],
    tokens: &[i64],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    apply(
        logits,
        vocab,
        penalties,
        rows,
        tokens,
        num_threads,
        MIN_TOKENS_PER_TASK,
    )
}

/// [`apply_penalties_f32`], splitting rows over threads from `min_tokens_per_task` tokens a task.
fn apply(
    logits: &mut [f32],
    vocab: usize,
    penalties: &[RowPenalties],
    rows: &[RowTokens],
    tokens: &[i64],
    num_threads: usize,
    min_tokens_per_task: usize,
) -> Result<(), KernelInputError> {
    let n = rows.len();
    if vocab == 0 || logits.len() != n * vocab || penalties.len() != n {
        return Err(KernelInputError(format!(
            "logits have {} values, {} rows of penalties and {n} of tokens; {n} rows of {vocab} \
             need {}",
            logits.len(),
            penalties.len(),
            n * vocab
        )));
    }
    for (r, row) in rows.iter().enumerate() {
        for (name, (a, b)) in [("seen", row.seen), ("counted", row.counted)] {
            if a > b || b > tokens.len() {
                return Err(KernelInputError(format!(
                    "row {r}: {name} tokens {a}..{b} of {}",
                    tokens.len()
                )));
            }
            if let Some(t) = tokens[a..b].iter().find(|&&t| t < 0 || t as usize >= vocab) {
                return Err(KernelInputError(format!(
                    "row {r}: token id {t} is outside the vocabulary of {vocab}"
                )));
            }
        }
    }
    // a row's tokens take ~5 ns each: below this many per task, waking a worker costs more
    let total: usize = rows
        .iter()
        .map(|r| r.seen.1 - r.seen.0 + r.counted.1 - r.counted.0)
        .sum();
    let threads = num_threads.min(total.div_ceil(min_tokens_per_task));
    let logits_ptr = SharedMut(logits.as_mut_ptr());
    for_each_item(n, threads, &|r| {
        // SAFETY: `for_each_item` calls each `r < n` once, so the calls' rows are disjoint
        // parts of `logits`, which outlives the call.
        let row = unsafe { std::slice::from_raw_parts_mut(logits_ptr.get().add(r * vocab), vocab) };
        let seen = &tokens[rows[r].seen.0..rows[r].seen.1];
        let counted = &tokens[rows[r].counted.0..rows[r].counted.1];
        SCRATCH.with(|s| penalize_row(row, &penalties[r], seen, counted, &mut s.borrow_mut()));
    });
    Ok(())
}

/// One row's penalties (token ids already checked against the row's length).
fn penalize_row(row: &mut [f32], p: &RowPenalties, seen: &[i64], counted: &[i64], s: &mut Scratch) {
    if s.stamp.len() < row.len() {
        s.stamp.resize(row.len(), 0);
        s.count.resize(row.len(), 0);
    }
    if p.repetition != 1.0 {
        if s.next == u32::MAX {
            s.stamp.fill(0);
            s.next = 0;
        }
        s.next += 1;
        let stamp = s.next;
        for &t in seen {
            let t = t as usize;
            if s.stamp[t] != stamp {
                s.stamp[t] = stamp;
                let x = row[t];
                let y = if x > 0.0 {
                    x / p.repetition
                } else {
                    x * p.repetition
                };
                row[t] = y.clamp(-f32::MAX, f32::MAX);
            }
        }
    }
    if p.frequency != 0.0 || p.presence != 0.0 {
        for &t in counted {
            s.count[t as usize] += 1;
        }
        for &t in counted {
            let t = t as usize;
            let c = s.count[t];
            if c > 0 {
                s.count[t] = 0;
                row[t] = row[t] - p.frequency * c as f32 - p.presence;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    /// The torch sampler's arithmetic over the whole row, as it computes it: a count per
    /// vocabulary entry, then every value through each formula.
    fn reference(row: &[f32], p: &RowPenalties, seen: &[i64], counted: &[i64]) -> Vec<f32> {
        let v = row.len();
        let mut out = row.to_vec();
        if p.repetition != 1.0 {
            let mut hit = vec![false; v];
            for &t in seen {
                hit[t as usize] = true;
            }
            for (x, &h) in out.iter_mut().zip(&hit) {
                let y = if *x > 0.0 {
                    *x / p.repetition
                } else {
                    *x * p.repetition
                };
                if h {
                    *x = y.clamp(-f32::MAX, f32::MAX);
                }
            }
        }
        if p.frequency != 0.0 || p.presence != 0.0 {
            let mut counts = vec![0f32; v];
            for &t in counted {
                counts[t as usize] += 1.0;
            }
            for (x, &c) in out.iter_mut().zip(&counts) {
                *x -= p.frequency * c;
                *x -= p.presence * if c > 0.0 { 1.0 } else { 0.0 };
            }
        }
        out
    }

    fn pen(repetition: f32, frequency: f32, presence: f32) -> RowPenalties {
        RowPenalties {
            repetition,
            frequency,
            presence,
        }
    }

    #[test]
    fn each_row_gets_the_torch_samplers_values_bit_for_bit() {
        let mut rng = Lcg(17);
        let vocab = 3000;
        for threads in [1, 2, 3] {
            let rows = 9;
            let mut logits: Vec<f32> = (0..rows * vocab).map(|_| rng.next_f32() * 30.0).collect();
            logits[5] = 3.0e38; // a large logit and a tiny penalty: clamped, not inf
            logits[vocab + 7] = f32::NEG_INFINITY;
            let settings = [
                pen(1.1, 0.0, 0.0),
                pen(1.0, 0.5, 0.0),
                pen(1.0, 0.0, 0.8),
                pen(1.3, 0.2, 0.4),
                pen(1.0, 0.0, 0.0),
                pen(1e-38, 0.0, 0.0),
                pen(0.7, -0.5, -1.0),
                pen(2.0, 1.5, 0.0),
                pen(1.05, 0.0, 0.3),
            ];
            let mut tokens = vec![];
            let mut spans = vec![];
            for r in 0..rows {
                // prompt tokens with repeats, then output tokens with repeats (some shared)
                let a = tokens.len();
                let prompt: Vec<i64> = (0..r * 37).map(|_| rng.below(vocab) as i64).collect();
                let output: Vec<i64> = (0..r * 11)
                    .map(|i| {
                        if i % 3 == 0 && !prompt.is_empty() {
                            prompt[i % prompt.len()]
                        } else {
                            rng.below(50) as i64
                        }
                    })
                    .collect();
                let mut all = prompt.clone();
                all.extend(&output);
                all.push(5);
                all.push(7);
                tokens.extend(&all);
                let b = tokens.len();
                tokens.extend(&output);
                spans.push(RowTokens {
                    seen: (a, b),
                    counted: (b, tokens.len()),
                });
            }
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    let s = spans[r];
                    reference(
                        &logits[r * vocab..(r + 1) * vocab],
                        &settings[r],
                        &tokens[s.seen.0..s.seen.1],
                        &tokens[s.counted.0..s.counted.1],
                    )
                })
                .collect();
            // every thread count really splits the rows (one token a task)
            apply(&mut logits, vocab, &settings, &spans, &tokens, threads, 1).unwrap();
            for (i, (g, w)) in logits.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "threads {threads}, value {i}");
            }
        }
    }

    #[test]
    fn the_scratch_rests_between_rows_and_calls() {
        // the same row twice in one call, then again in another: the same answer each time
        let vocab = 64;
        let row: Vec<f32> = (0..vocab).map(|i| i as f32 - 30.0).collect();
        let toks: Vec<i64> = vec![3, 3, 40, 40, 40, 63];
        let spans = vec![
            RowTokens {
                seen: (0, 6),
                counted: (0, 6),
            };
            2
        ];
        let p = [pen(1.2, 0.3, 0.1); 2];
        let want = reference(&row, &p[0], &toks, &toks);
        for _ in 0..3 {
            let mut logits = [row.clone(), row.clone()].concat();
            apply_penalties_f32(&mut logits, vocab, &p, &spans, &toks, 1).unwrap();
            assert_eq!(&logits[..vocab], &want[..]);
            assert_eq!(&logits[vocab..], &want[..]);
        }
    }

    #[test]
    fn bad_inputs_are_errors_and_write_nothing() {
        let mut logits = vec![1.0f32; 8];
        let p = [pen(1.5, 0.0, 0.0); 2];
        let ok = RowTokens {
            seen: (0, 2),
            counted: (0, 0),
        };
        let cases: Vec<(Vec<RowTokens>, Vec<i64>)> = vec![
            (vec![ok, ok], vec![0, 4]), // 4 is outside a vocabulary of 4
            (vec![ok, ok], vec![-1, 0]),
            (
                vec![
                    ok,
                    RowTokens {
                        seen: (1, 3),
                        counted: (0, 0),
                    },
                ],
                vec![0, 1],
            ),
            (vec![ok], vec![0, 1]),
        ];
        for (spans, toks) in cases {
            assert!(apply_penalties_f32(&mut logits, 4, &p, &spans, &toks, 1).is_err());
            assert!(logits.iter().all(|&x| x == 1.0));
        }
        assert!(apply_penalties_f32(&mut logits, 3, &p, &[ok, ok], &[0, 1], 1).is_err());
    }
}
