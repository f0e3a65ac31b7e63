//! ferrobatch's Rust core: lock-free intake, paged KV block pool with prefix caching, and the
//! continuous-batching scheduler that emits each step as flat arrays.
//!
//! Layering: `config`/`request` (data) -> `queue`/`intake` (any thread) -> `block_pool`/
//! `prefix_cache` (KV memory) -> `scheduler` (+ `integrity`) -> `batch` (step arrays) -> `py`
//! (the scheduler's pyo3 bindings, behind the `python` feature).
//! Beside the scheduler, the CPU kernels the Python model runner calls on every layer:
//! `cpu_attention` (paged decode attention) and `cpu_prefill_attention` (causal prompt chunks
//! over the paged cache, long ones through Intel AMX in `cpu_amx_prefill`; bindings
//! `py_attention`; the cache holds f32, f16, FP8 E4M3 or scaled int8: `cpu_kv`, `cpu_kv_fp8`,
//! `cpu_kv_q8`), `cpu_linear` (linear layers
//! over panel-packed weights; `cpu_quant_linear` from GGUF blocks, `cpu_amx_linear` from their
//! AMX tiles (`cpu_tile_rows` the same tiles' steps of a few rows, without tile instructions), `cpu_quant_panels` from the blocks laid out as panels (CPUs without AMX); `cpu_amx_tiles` holds the AMX instructions both AMX kernels use) and `cpu_elementwise` (RMSNorm,
//! RoPE, SiLU-and-mul) (bindings
//! `py_linear`). The first two
//! split their work over `cpu_pool`, the kernels' persistent thread pool, pick their SIMD
//! path with `cpu_isa`, and report bad input as `cpu_error::KernelInputError`; `cpu_exp` is
//! the polynomial exp of the softmax and SiLU. `cpu_decoder` chains them through every
//! decoder layer of a step in one call (binding `py_decoder`), adding LoRA adapters' updates
//! after its linear layers with `cpu_lora`; `cpu_greedy` reads a plain greedy step's logits
//! (each row's argmax and finite flag; binding `py_greedy`), `cpu_sampling` draws a sampled
//! step's tokens (temperature, top-k, top-p, min-p), `cpu_penalties` applies the repetition,
//! frequency and presence penalties before it and `cpu_logprobs` gives the logprobs a request
//! asked for (bindings `py_sampling`).
//! And `guided` (structured outputs: a regex's DFA walked over the vocabulary's byte trie to
//! find the tokens allowed next; binding `py_guided`), used by the Python sampler.
//! And `ngram` (prompt-lookup drafts: `scheduler` schedules them for speculative decoding,
//! `update` keeps the ones the model agrees with).

// Off x86-64 the SIMD paths compile out and the portable ones serve alone: what only the SIMD
// paths use (AMX macros, prefetch hints, tile constants) is then unused, by design.
#![cfg_attr(not(target_arch = "x86_64"), allow(unused))]

pub mod batch;
pub mod block_pool;
pub mod config;
pub mod cpu_amx_linear;
#[cfg(target_arch = "x86_64")]
mod cpu_amx_prefill;
mod cpu_amx_tiles;
pub mod cpu_attention;
pub mod cpu_decoder;
pub mod cpu_elementwise;
pub mod cpu_error;
mod cpu_exp;
pub mod cpu_greedy;
mod cpu_half_amx;
pub mod cpu_half_panels;
mod cpu_isa;
pub mod cpu_kv;
pub mod cpu_kv_fp8;
pub mod cpu_kv_q8;
pub mod cpu_linear;
pub mod cpu_logprobs;
pub mod cpu_lora;
pub mod cpu_penalties;
pub mod cpu_pool;
pub mod cpu_prefill_attention;
mod cpu_q4_1_one_row;
pub mod cpu_quant_linear;
pub mod cpu_quant_panels;
pub mod cpu_sampling;
pub mod cpu_step_timing;
pub mod cpu_tile_rows;
pub mod error;
pub mod gguf_blocks;
pub mod guided;
pub mod intake;
mod integrity;
mod load_parallel;
pub mod ngram;
pub mod prefix_cache;
pub mod queue;
pub mod request;
pub mod scheduler;
#[cfg(test)]
mod test_rng;
mod update;

#[cfg(feature = "python")]
mod py;
#[cfg(feature = "python")]
mod py_attention;
#[cfg(feature = "python")]
mod py_decoder;
#[cfg(feature = "python")]
mod py_gguf_blocks;
#[cfg(feature = "python")]
mod py_greedy;
#[cfg(feature = "python")]
mod py_guided;
#[cfg(feature = "python")]
mod py_linear;
#[cfg(feature = "python")]
mod py_sampling;

pub use batch::{StepBatch, StepOutput};
pub use config::{Policy, SchedulerConfig};
pub use error::{IntegrityError, SchedError};
pub use intake::Intake;
pub use request::{FinishReason, NewRequest, SamplingParams};
pub use scheduler::{Scheduler, Stats};
