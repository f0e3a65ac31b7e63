//! Requests and sequences.
//!
//! A [`NewRequest`] is validated by [`NewRequest::validate`] before it is ever queued, so the
//! scheduler only sees requests that can fit. Inside the scheduler each request is a
//! [`RequestGroup`] of `n` [`Sequence`]s. Before its prompt is computed a group has a single
//! "carrier" sequence; the other sequence indices wait in the carrier's `unforked` list and are
//! forked from it (sharing its blocks) on the step that samples the first tokens.
//!
//! Sequence invariants (checked by `Scheduler::check_integrity`):
//! - `num_computed_tokens <= tokens.len()`, `prompt_len >= 1`, `prompt_len <= tokens.len()`;
//! - a waiting sequence holds no blocks and has `num_computed_tokens == 0`;
//! - `block_hashes[k]` is the chained hash of full block `k` of `tokens` (a prefix of all of them),
//!   salted with the request's salt and the sequence's `hash_epoch`.

use crate::config::SchedulerConfig;
use crate::error::SchedError;
use std::sync::Arc;

/// Why a sequence finished (`0` = still running in step outputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FinishReason {
    /// Not finished.
    Running = 0,
    /// EOS, a stop token id, or an abort with reason "stop" (stop string).
    Stop = 1,
    /// `max_tokens` or `max_model_len` reached.
    Length = 2,
    /// Aborted by the client.
    Abort = 3,
    /// Failed (e.g. preempted too often).
    Error = 4,
}

/// Per-request sampling parameters, copied into the step's sampling arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: i32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    /// 0 = off.
    pub presence_penalty: f32,
    /// 0 = off.
    pub frequency_penalty: f32,
    /// -1 = no seed.
    pub seed: i64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: -1,
        }
    }
}

/// A request as submitted through the intake.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// Caller-chosen id, unique among live requests.
    pub request_id: u64,
    /// Prompt token ids (non-empty, each in `[0, vocab_size)`).
    pub prompt: Vec<i32>,
    /// Most generated tokens per sequence (>= 1).
    pub max_tokens: usize,
    /// EOS / stop ids do not finish a sequence before it generated this many tokens.
    pub min_tokens: usize,
    /// EOS ids do not finish the sequence.
    pub ignore_eos: bool,
    /// Extra ids that finish the sequence (even with `ignore_eos`).
    pub stop_token_ids: Vec<i32>,
    /// Parallel samples (sequences sharing the prompt).
    pub n: usize,
    /// Lower = sooner (policy "priority").
    pub priority: i64,
    /// Mixed into the first block's hash so only requests with the same salt share cache.
    pub cache_salt: Option<String>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// The caller vouches that this request's tokens may be drafted by prompt lookup and
    /// checked in one step: each row's token is drawn from that row's own distribution, with
    /// no per-token state (penalties, masks, logprobs) kept outside the scheduler. Then
    /// keeping drafts while they equal the drawn tokens is exact speculative sampling for a
    /// one-token draft. Ignored when `n > 1`.
    pub speculate: bool,
}

impl NewRequest {
    /// A request with default options.
    pub fn new(request_id: u64, prompt: Vec<i32>, max_tokens: usize) -> Self {
        NewRequest {
            request_id,
            prompt,
            max_tokens,
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            n: 1,
            priority: 0,
            cache_salt: None,
            sampling: SamplingParams::default(),
            speculate: false,
        }
    }

    /// Checks the request against the configuration: everything that could make it fail later
    /// or never fit is rejected here, before anything is queued or allocated.
    pub fn validate(&self, cfg: &SchedulerConfig) -> Result<(), SchedError> {
        let bad = |m: String| Err(SchedError::InvalidRequest(m));
        let id = self.request_id;
        if self.prompt.is_empty() {
            return bad(format!("request {id}: prompt_token_ids is empty"));
        }
        if let Some((i, &t)) = self
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t < 0 || t as usize >= cfg.vocab_size)
        {
            return bad(format!(
                "request {id}: prompt token id {t} at index {i} is outside [0, {})",
                cfg.vocab_size
            ));
        }
        if self.max_tokens == 0 {
            return bad(format!("request {id}: max_tokens must be >= 1"));
        }
        if self.min_tokens > self.max_tokens {
            return bad(format!(
                "request {id}: min_tokens ({}) must be <= max_tokens ({})",
                self.min_tokens, self.max_tokens
            ));
        }
        let total = self.prompt.len().saturating_add(self.max_tokens);
        if total > cfg.max_model_len {
            return bad(format!(
                "request {id}: prompt ({} tokens) + max_tokens ({}) = {total} exceeds max_model_len ({})",
                self.prompt.len(),
                self.max_tokens,
                cfg.max_model_len
            ));
        }
        // The last sampled token is never computed, so a sequence holds at most total-1 tokens.
        let need = cfg.blocks_for(total - 1);
        if need > cfg.usable_blocks() {
            return bad(format!(
                "request {id}: needs {need} KV blocks but the pool only has {}",
                cfg.usable_blocks()
            ));
        }
        if self.n == 0 || self.n > cfg.max_num_seqs {
            return bad(format!(
                "request {id}: n must be in [1, max_num_seqs={}], got {}",
                cfg.max_num_seqs, self.n
            ));
        }
        if let Some(&t) = self
            .stop_token_ids
            .iter()
            .find(|&&t| t < 0 || t as usize >= cfg.vocab_size)
        {
            return bad(format!(
                "request {id}: stop token id {t} is outside [0, {})",
                cfg.vocab_size
            ));
        }
        let s = &self.sampling;
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return bad(format!(
                "request {id}: temperature must be finite and >= 0, got {}",
                s.temperature
            ));
        }
        if s.top_k < 0 {
            return bad(format!(
                "request {id}: top_k must be >= 0 (0 = off), got {}",
                s.top_k
            ));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return bad(format!(
                "request {id}: top_p must be in (0, 1], got {}",
                s.top_p
            ));
        }
        if !(0.0..=1.0).contains(&s.min_p) {
            return bad(format!(
                "request {id}: min_p must be in [0, 1], got {}",
                s.min_p
            ));
        }
        if !(s.repetition_penalty.is_finite() && s.repetition_penalty > 0.0) {
            return bad(format!(
                "request {id}: repetition_penalty must be finite and > 0, got {}",
                s.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", s.presence_penalty),
            ("frequency_penalty", s.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("request {id}: {name} must be in [-2, 2], got {v}"));
            }
        }
        if s.seed < -1 {
            return bad(format!("request {id}: seed must be >= 0, got {}", s.seed));
        }
        Ok(())
    }
}

/// Per-request data shared by all its sequences.
#[derive(Debug)]
pub struct RequestShared {
    /// Request id.
    pub request_id: u64,
    /// Prompt length.
    pub prompt_len: usize,
    /// See [`NewRequest`].
    pub max_tokens: usize,
    /// See [`NewRequest`].
    pub min_tokens: usize,
    /// See [`NewRequest`].
    pub ignore_eos: bool,
    /// See [`NewRequest`].
    pub stop_token_ids: Vec<i32>,
    /// See [`NewRequest`].
    pub priority: i64,
    /// Arrival order (assigned at drain time).
    pub arrival: u64,
    /// 64-bit digest of the cache salt (0 = none), mixed into the first block hash.
    pub salt: u64,
    /// See [`NewRequest`].
    pub sampling: SamplingParams,
    /// See [`NewRequest`] (false when `n > 1`).
    pub speculate: bool,
}

/// Where a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    /// In the waiting set (holds no blocks).
    Waiting,
    /// In the running list (holds blocks for its computed tokens).
    Running,
}

/// One generated stream of a request.
#[derive(Debug)]
pub struct Sequence {
    /// Shared request data.
    pub req: Arc<RequestShared>,
    /// Which of the request's `n` sequences this is.
    pub seq_index: u32,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<i32>,
    /// Tokens whose K/V are in the cache (or scheduled this step, before `update`).
    pub num_computed_tokens: usize,
    /// Block table.
    pub blocks: Vec<u32>,
    /// Chained hashes of the full blocks of `tokens` computed so far (lazily extended).
    pub block_hashes: Vec<u128>,
    /// How often this sequence was preempted.
    pub num_preemptions: u32,
    /// Waiting or running.
    pub status: SeqStatus,
    /// Sequence indices still to be forked from this carrier (non-empty only before the
    /// request's first sample).
    pub unforked: Vec<u32>,
    /// Leading full blocks already offered to the prefix cache.
    pub num_registered: usize,
    /// The scheduler's cache epoch when this sequence was last admitted: its block hashes are
    /// salted with it (`prefix_cache::hash_salt`), so that KV computed in one epoch (before a
    /// weight update) never serves a sequence admitted in a later one.
    pub hash_epoch: u64,
    /// Speculative decoding: drafts refused outright in a row (the model disagreed with the
    /// first draft token), and decode steps left before this sequence drafts again.
    pub draft_misses: u8,
    pub draft_backoff: u8,
    /// Most drafts this sequence proposes next step (`num_speculative_tokens`, or less after
    /// drafts the model cut short when the draft length adapts).
    pub draft_len: u8,
}

impl Sequence {
    /// Total tokens (prompt + generated).
    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Generated tokens so far.
    #[inline]
    pub fn output_len(&self) -> usize {
        self.tokens.len() - self.req.prompt_len
    }

    /// Ordering key: lower is admitted sooner and preempted later.
    #[inline]
    pub fn key(&self, handle: u32) -> (i64, u64, u32, u32) {
        (self.req.priority, self.req.arrival, self.seq_index, handle)
    }
}

/// Bookkeeping for one live request: handles of its live sequences.
#[derive(Debug, Default)]
pub struct RequestGroup {
    /// Handles of the live sequences.
    pub seqs: Vec<u32>,
}
