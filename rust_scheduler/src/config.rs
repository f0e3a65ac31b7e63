//! Scheduler configuration, validated once at construction.
//!
//! Invariants of a validated [`SchedulerConfig`]:
//! - `num_blocks >= 2` (block 0 is the reserved null block, at least one usable block);
//! - every size, budget and capacity is `>= 1`; `num_blocks * block_size` fits in `i32`
//!   (slot ids are int32 in the step arrays);
//! - every EOS id lies in `[0, vocab_size)`;
//! - `num_speculative_tokens <= 16` and below `max_num_batched_tokens`; the n-gram lengths
//!   satisfy `1 <= speculative_ngram_min <= speculative_ngram_max <= 16`.

use crate::error::SchedError;

/// Order in which waiting requests are admitted and running ones are preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served; the newest running sequence is preempted first.
    Fcfs,
    /// Lower `priority` value first (ties by arrival); the lowest-priority (highest value),
    /// newest running sequence is preempted first.
    Priority,
}

impl Policy {
    /// Parses `"fcfs"` or `"priority"`.
    pub fn parse(s: &str) -> Result<Self, SchedError> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            other => Err(SchedError::InvalidConfig(format!(
                "policy must be \"fcfs\" or \"priority\", got {other:?}"
            ))),
        }
    }
}

/// Most draft tokens per sequence and step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;
/// Longest n-gram prompt lookup may match.
pub const MAX_SPECULATIVE_NGRAM: usize = 16;

/// Static configuration of a [`crate::scheduler::Scheduler`].
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Total KV blocks, including the reserved null block 0.
    pub num_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (the token budget).
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) a request may reach.
    pub max_model_len: usize,
    /// Token ids must lie in `[0, vocab_size)`.
    pub vocab_size: usize,
    /// Ids that finish a sequence (unless `ignore_eos`).
    pub eos_token_ids: Vec<i32>,
    /// Reuse computed full blocks across requests.
    pub enable_prefix_caching: bool,
    /// Admission / preemption order.
    pub policy: Policy,
    /// A sequence preempted more than this many times fails with an error.
    pub max_preemptions: u32,
    /// Capacity of the bounded intake queue (submits + aborts).
    pub intake_capacity: usize,
    /// Cap on prompt tokens one sequence computes per step (0 = only the step budget caps it).
    pub long_prefill_token_threshold: usize,
    /// Draft tokens proposed by prompt lookup for each eligible decode (0 = no speculation).
    pub num_speculative_tokens: usize,
    /// Shortest n-gram the prompt-lookup search matches.
    pub speculative_ngram_min: usize,
    /// Longest n-gram the prompt-lookup search matches (tried first).
    pub speculative_ngram_max: usize,
    /// Drafts are proposed only while at most this many sequences run (0 = at any load):
    /// a larger step is bound by compute, and rejected drafts would only cost.
    pub speculative_max_running: usize,
    /// Drafts fill a step only up to this many tokens in all (0 = the step budget): on the
    /// CPU a step of at most 8 rows (read from the GGUF blocks) costs little more per row.
    pub speculative_max_step_tokens: usize,
    /// Each sequence's draft length follows its acceptance: after drafts the model cut short
    /// at `a` accepted tokens it drafts at most `a + 1` next time, after drafts accepted in
    /// full `num_speculative_tokens` again (false: always `num_speculative_tokens`).
    pub speculative_adaptive: bool,
    /// While sequences run, waiting ones join only once at least this many of them (all that
    /// wait, if fewer) find free slots, so that one refill step's prefill serves several
    /// requests (1 = join as soon as one slot frees: plain continuous batching).
    pub admission_batch: usize,
    /// ... or once admission has been held back this many steps in a row (bounds the wait).
    pub admission_max_wait_steps: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            num_blocks: 1024,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 8192,
            vocab_size: 32000,
            eos_token_ids: Vec::new(),
            enable_prefix_caching: true,
            policy: Policy::Fcfs,
            max_preemptions: 8,
            intake_capacity: 4096,
            long_prefill_token_threshold: 0,
            num_speculative_tokens: 0,
            speculative_ngram_min: 2,
            speculative_ngram_max: 4,
            speculative_max_running: 0,
            speculative_max_step_tokens: 0,
            speculative_adaptive: false,
            admission_batch: 1,
            admission_max_wait_steps: 8,
        }
    }
}

impl SchedulerConfig {
    /// Checks every field; returns a message naming the first bad one.
    pub fn validate(&self) -> Result<(), SchedError> {
        let bad = |m: String| Err(SchedError::InvalidConfig(m));
        if self.num_blocks < 2 {
            return bad(format!(
                "num_blocks must be >= 2 (block 0 is reserved), got {}",
                self.num_blocks
            ));
        }
        for (name, v) in [
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("vocab_size", self.vocab_size),
            ("intake_capacity", self.intake_capacity),
        ] {
            if v == 0 {
                return bad(format!("{name} must be >= 1"));
            }
        }
        // Caps keep every up-front allocation small (no input can exhaust memory here).
        for (name, v, cap) in [
            ("num_blocks", self.num_blocks, 1usize << 22),
            ("max_num_seqs", self.max_num_seqs, 1 << 16),
            ("intake_capacity", self.intake_capacity, 1 << 20),
        ] {
            if v > cap {
                return bad(format!("{name} must be <= {cap}, got {v}"));
            }
        }
        let slots = self.num_blocks.checked_mul(self.block_size);
        if slots.is_none_or(|s| s > i32::MAX as usize) {
            return bad("num_blocks * block_size must fit in int32".to_string());
        }
        if self.max_model_len > i32::MAX as usize || self.vocab_size > i32::MAX as usize {
            return bad("max_model_len and vocab_size must fit in int32".to_string());
        }
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS
            || self.num_speculative_tokens >= self.max_num_batched_tokens
        {
            return bad(format!(
                "num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS} and below \
                 max_num_batched_tokens ({}), got {}",
                self.max_num_batched_tokens, self.num_speculative_tokens
            ));
        }
        if self.speculative_ngram_min == 0
            || self.speculative_ngram_max < self.speculative_ngram_min
            || self.speculative_ngram_max > MAX_SPECULATIVE_NGRAM
        {
            return bad(format!(
                "speculative n-gram lengths must satisfy 1 <= min <= max <= \
                 {MAX_SPECULATIVE_NGRAM}, got min {} and max {}",
                self.speculative_ngram_min, self.speculative_ngram_max
            ));
        }
        if self.admission_batch == 0 || self.admission_batch > self.max_num_seqs {
            return bad(format!(
                "admission_batch must be in [1, max_num_seqs ({})], got {}",
                self.max_num_seqs, self.admission_batch
            ));
        }
        if self.admission_max_wait_steps > 1 << 20 {
            return bad(format!(
                "admission_max_wait_steps must be <= {}, got {}",
                1 << 20,
                self.admission_max_wait_steps
            ));
        }
        for &e in &self.eos_token_ids {
            if e < 0 || e as usize >= self.vocab_size {
                return bad(format!(
                    "eos token id {e} is outside [0, {})",
                    self.vocab_size
                ));
            }
        }
        Ok(())
    }

    /// Blocks needed to hold `num_tokens` tokens.
    #[inline]
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Usable blocks (all but the null block).
    #[inline]
    pub fn usable_blocks(&self) -> usize {
        self.num_blocks - 1
    }
}
