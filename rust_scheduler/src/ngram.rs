//! Prompt-lookup (n-gram) drafting for speculative decoding.
//!
//! A sequence's next tokens often repeat text it already holds (code being edited, a passage
//! being quoted or summarised, JSON keys). [`propose`] finds the most recent earlier occurrence
//! of the sequence's last `n` tokens (trying `n = max_n` down to `min_n`) and drafts the tokens
//! that followed it. The model then checks every draft in one forward (see `update.rs`), so a
//! draft costs a row of compute and never changes what a greedy sequence outputs.
//!
//! Invariants: the draft is a copy of tokens the sequence already holds (so every id is valid);
//! it has at most `k` tokens; it is empty when no n-gram of length >= `min_n` recurs.

/// Appends to `out` at most `k` draft tokens for the sequence `tokens`; returns how many.
/// The search looks at the last `window` tokens only (bounding its cost on long contexts).
pub fn propose(
    tokens: &[i32],
    min_n: usize,
    max_n: usize,
    k: usize,
    window: usize,
    out: &mut Vec<i32>,
) -> usize {
    let len = tokens.len();
    if k == 0 || min_n == 0 || len < min_n + 1 {
        return 0;
    }
    let lo = len.saturating_sub(window);
    for n in (min_n..=max_n.min(len - 1)).rev() {
        let suffix = &tokens[len - n..];
        // Most recent match first: a start `i` whose n-gram ends before the suffix starts
        // overlapping it is allowed (`i + n <= len - 1` leaves at least one token to draft).
        let mut i = len - n;
        while i > lo {
            i -= 1;
            if tokens[i..i + n] == *suffix {
                let from = i + n;
                let take = k.min(len - from);
                out.extend_from_slice(&tokens[from..from + take]);
                return take;
            }
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::propose;

    fn draft(tokens: &[i32], min_n: usize, max_n: usize, k: usize) -> Vec<i32> {
        let mut out = Vec::new();
        let n = propose(tokens, min_n, max_n, k, usize::MAX, &mut out);
        assert_eq!(n, out.len());
        out
    }

    #[test]
    fn drafts_what_followed_the_last_occurrence() {
        // "1 2 3 4 5 ... 1 2 3" -> 4 5 follows the earlier "1 2 3"
        assert_eq!(draft(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2, 3, 2), vec![4, 5]);
        // the most recent occurrence wins
        assert_eq!(draft(&[7, 8, 1, 7, 8, 2, 7, 8], 2, 2, 1), vec![2]);
        // longer n-grams are tried first: "5 7 8" recurs followed by 3, "7 8" last by 2
        assert_eq!(draft(&[5, 7, 8, 3, 7, 8, 2, 5, 7, 8], 2, 3, 1), vec![3]);
    }

    #[test]
    fn the_draft_is_capped_by_k_and_by_what_exists() {
        assert_eq!(draft(&[1, 2, 3, 1, 2], 2, 2, 10), vec![3, 1, 2]);
        assert_eq!(draft(&[1, 2, 3, 1, 2], 2, 2, 1), vec![3]);
        // a run of one token: overlapping matches draft the run forward
        assert_eq!(draft(&[4, 4, 4, 4], 2, 3, 3), vec![4]);
    }

    #[test]
    fn no_draft_without_a_recurring_ngram() {
        assert!(draft(&[1, 2, 3, 4, 5], 2, 4, 3).is_empty());
        assert!(draft(&[1, 2, 1, 3], 2, 4, 3).is_empty()); // "1 3" never occurred before
        assert_eq!(draft(&[1, 2, 1, 3, 1], 1, 4, 3), vec![3, 1]); // a 1-gram does
        assert!(draft(&[1], 1, 4, 3).is_empty());
        assert!(draft(&[1, 2, 1, 2], 2, 2, 0).is_empty());
    }

    #[test]
    fn the_window_bounds_the_search() {
        let mut t = vec![1, 2, 3];
        t.extend(100..110);
        t.extend([1, 2]);
        let mut out = Vec::new();
        assert_eq!(propose(&t, 2, 2, 1, usize::MAX, &mut out), 1);
        assert_eq!(out, vec![3]);
        out.clear();
        assert_eq!(propose(&t, 2, 2, 1, 8, &mut out), 0);
    }

    #[test]
    fn matches_a_brute_force_definition() {
        // every draft token continues an earlier occurrence of the chosen suffix
        let mut state = 12345u64;
        for _ in 0..500 {
            let len = 1 + (state % 40) as usize;
            let mut t = Vec::with_capacity(len);
            for _ in 0..len {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                t.push(((state >> 33) % 4) as i32);
            }
            let d = draft(&t, 1, 3, 4);
            // brute force: the longest n in 1..=3 with an earlier occurrence, most recent one
            let mut want = Vec::new();
            'outer: for n in (1..=3usize.min(len.saturating_sub(1))).rev() {
                for i in (0..len - n).rev() {
                    if t[i..i + n] == t[len - n..] {
                        want = t[i + n..(i + n + 4).min(len)].to_vec();
                        break 'outer;
                    }
                }
            }
            assert_eq!(d, want, "tokens {t:?}");
        }
    }
}
