//! PyO3 bindings of the scheduler: `Scheduler` (step side, `&mut`), `Intake` (submit/abort from
//! any thread), `StepBatch` / `StepOutput` (numpy arrays), `QueueFullError`. (The CPU kernels'
//! bindings live in `py_attention.rs` and `py_linear.rs`.)
//!
//! Rules: every user error becomes `ValueError` (or `QueueFullError`); broken invariants become
//! `RuntimeError`; nothing reachable from Python input panics. `schedule()`, `update()` and
//! `wait_for_work()` run with the GIL released. Step arrays are built from the scheduler's
//! reused buffers with one memcpy per array; no per-request Python objects.

use crate::batch::StepBatch as CoreBatch;
use crate::config::{Policy, SchedulerConfig};
use crate::error::SchedError;
use crate::intake::Intake as CoreIntake;
use crate::request::{FinishReason, NewRequest, SamplingParams};
use crate::scheduler::Scheduler as CoreScheduler;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::time::Duration;

pyo3::create_exception!(
    _scheduler,
    QueueFullError,
    PyRuntimeError,
    "The bounded intake queue is full; retry later (HTTP 429)."
);

fn to_py(e: SchedError) -> PyErr {
    match e {
        SchedError::QueueFull(_) => QueueFullError::new_err(e.to_string()),
        other => PyValueError::new_err(other.to_string()),
    }
}

fn int_arg(obj: &Bound<'_, PyAny>, name: &str, lo: i64, hi: i64) -> PyResult<i64> {
    let v: i64 = obj
        .extract()
        .map_err(|_| PyValueError::new_err(format!("{name} must be an int in [{lo}, {hi}]")))?;
    if v < lo || v > hi {
        return Err(PyValueError::new_err(format!(
            "{name} must be in [{lo}, {hi}], got {v}"
        )));
    }
    Ok(v)
}

fn range(v: i64, name: &str, lo: i64, hi: i64) -> PyResult<i64> {
    if v < lo || v > hi {
        return Err(PyValueError::new_err(format!(
            "{name} must be in [{lo}, {hi}], got {v}"
        )));
    }
    Ok(v)
}

fn size_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    Ok(int_arg(obj, name, 0, i32::MAX as i64)? as usize)
}

fn request_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    obj.extract::<u64>()
        .map_err(|_| PyValueError::new_err("request_id must be an int in [0, 2**64)"))
}

/// Token ids from a list / tuple / 1-D numpy int array, range-checked into i32.
fn token_ids(obj: &Bound<'_, PyAny>, name: &str, vocab: usize, out: &mut Vec<i32>) -> PyResult<()> {
    out.clear();
    let bad = |i: usize, t: i64| {
        PyValueError::new_err(format!(
            "{name}: token id {t} at index {i} is outside [0, {vocab})"
        ))
    };
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        for (i, &t) in a.as_array().iter().enumerate() {
            if t < 0 || t as usize >= vocab {
                return Err(bad(i, t as i64));
            }
            out.push(t);
        }
        return Ok(());
    }
    let v: Vec<i64> = if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        a.as_array().to_vec()
    } else if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyValueError::new_err(format!(
            "{name} must be a sequence of ints, not str"
        )));
    } else {
        obj.extract::<Vec<i64>>().map_err(|_| {
            PyValueError::new_err(format!(
                "{name} must be a list or 1-D int32/int64 array of ints"
            ))
        })?
    };
    for (i, &t) in v.iter().enumerate() {
        if t < 0 || t >= vocab as i64 {
            return Err(bad(i, t));
        }
        out.push(t as i32);
    }
    Ok(())
}

/// Thread-safe handle for submitting and aborting requests (usable from any thread).
#[pyclass(name = "Intake", module = "ferrobatch._scheduler", frozen)]
pub struct PyIntake {
    inner: CoreIntake,
}

#[pymethods]
impl PyIntake {
    /// Validate and enqueue a request. Raises ValueError (bad input / can never fit / duplicate
    /// live id) or QueueFullError. Never blocks.
    #[pyo3(signature = (request_id, prompt_token_ids, *, max_tokens, min_tokens=None, ignore_eos=false,
        stop_token_ids=None, n=None, priority=None, cache_salt=None, temperature=1.0, top_k=None, top_p=1.0,
        min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None,
        speculate=false))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        request_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        min_tokens: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        n: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<String>,
        temperature: f64,
        top_k: Option<&Bound<'_, PyAny>>,
        top_p: f64,
        min_p: f64,
        repetition_penalty: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        seed: Option<&Bound<'_, PyAny>>,
        speculate: bool,
    ) -> PyResult<()> {
        let cfg = self.inner.config();
        let id = request_id_arg(request_id)?;
        let mut prompt = Vec::new();
        token_ids(
            prompt_token_ids,
            "prompt_token_ids",
            cfg.vocab_size,
            &mut prompt,
        )?;
        let max_tokens = int_arg(max_tokens, "max_tokens", 1, i32::MAX as i64)? as usize;
        let mut r = NewRequest::new(id, prompt, max_tokens);
        if let Some(m) = min_tokens {
            r.min_tokens = size_arg(m, "min_tokens")?;
        }
        r.ignore_eos = ignore_eos;
        if let Some(s) = stop_token_ids {
            token_ids(s, "stop_token_ids", cfg.vocab_size, &mut r.stop_token_ids)?;
        }
        if let Some(n) = n {
            r.n = int_arg(n, "n", 1, cfg.max_num_seqs as i64)? as usize;
        }
        if let Some(p) = priority {
            r.priority = int_arg(p, "priority", i64::MIN, i64::MAX)?;
        }
        r.cache_salt = cache_salt;
        r.speculate = speculate;
        let top_k = match top_k {
            None => 0,
            Some(k) => int_arg(k, "top_k", -1, i32::MAX as i64)?.max(0) as i32,
        };
        let seed = match seed {
            None => -1,
            Some(s) => int_arg(s, "seed", 0, i64::MAX)?,
        };
        r.sampling = SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            min_p: min_p as f32,
            repetition_penalty: repetition_penalty as f32,
            presence_penalty: presence_penalty as f32,
            frequency_penalty: frequency_penalty as f32,
            seed,
        };
        self.inner.submit(r).map_err(to_py)
    }

    /// Abort one sequence (`seq_index >= 0`) or all (`-1`) of a request; `reason` is "abort",
    /// "stop" (reported as finish reason 1) or "error" (4). Unknown ids are ignored.
    #[pyo3(signature = (request_id, seq_index=-1, reason="abort"))]
    fn abort(&self, request_id: &Bound<'_, PyAny>, seq_index: i64, reason: &str) -> PyResult<()> {
        let id = request_id_arg(request_id)?;
        let reason = match reason {
            "abort" => FinishReason::Abort,
            "stop" => FinishReason::Stop,
            "error" => FinishReason::Error,
            r => {
                return Err(PyValueError::new_err(format!(
                    "reason must be \"abort\", \"stop\" or \"error\", got {r:?}"
                )))
            }
        };
        let seq = match seq_index {
            -1 => None,
            k if (0..=u32::MAX as i64).contains(&k) => Some(k as u32),
            k => {
                return Err(PyValueError::new_err(format!(
                    "seq_index must be -1 or >= 0, got {k}"
                )))
            }
        };
        self.inner.abort(id, seq, reason).map_err(to_py)
    }

    /// Block (GIL released) until a command is queued, `notify()` is called or the timeout
    /// passes (`None` = no timeout). Returns True if a command is queued.
    #[pyo3(signature = (timeout_s=None))]
    fn wait_for_work(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<bool> {
        let timeout = match timeout_s {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t.min(1e9))),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout_s must be finite and >= 0, got {t}"
                )))
            }
        };
        let intake = self.inner.clone();
        Ok(py.detach(move || intake.wait_for_work(timeout)))
    }

    /// Wake any waiter (used at shutdown).
    fn notify(&self) {
        self.inner.notify()
    }

    /// Commands queued and not yet drained.
    fn __len__(&self) -> usize {
        self.inner.queue_len()
    }
}

macro_rules! arr {
    ($py:expr, $v:expr) => {
        PyArray1::from_slice($py, &$v).unbind()
    };
}

/// One step's arrays (see the README contract table).
#[pyclass(name = "StepBatch", module = "ferrobatch._scheduler", frozen, get_all)]
pub struct PyStepBatch {
    input_ids: Py<PyArray1<i32>>,
    positions: Py<PyArray1<i32>>,
    slot_mapping: Py<PyArray1<i32>>,
    query_start_loc: Py<PyArray1<i32>>,
    seq_lens: Py<PyArray1<i32>>,
    block_tables: Py<PyAny>,
    block_copies: Py<PyAny>,
    seq_req_ids: Py<PyArray1<u64>>,
    seq_indices: Py<PyArray1<i32>>,
    logits_indices: Py<PyArray1<i32>>,
    sample_req_ids: Py<PyArray1<u64>>,
    sample_seq_indices: Py<PyArray1<i32>>,
    sample_output_lens: Py<PyArray1<i32>>,
    temperature: Py<PyArray1<f32>>,
    top_k: Py<PyArray1<i32>>,
    top_p: Py<PyArray1<f32>>,
    min_p: Py<PyArray1<f32>>,
    repetition_penalty: Py<PyArray1<f32>>,
    presence_penalty: Py<PyArray1<f32>>,
    frequency_penalty: Py<PyArray1<f32>>,
    seed: Py<PyArray1<i64>>,
    suppress_eos: Py<PyArray1<u8>>,
    num_tokens: usize,
    num_seqs: usize,
    num_samples: usize,
    num_prefill_tokens: usize,
    num_decode_tokens: usize,
    num_draft_tokens: usize,
    max_blocks_per_seq: usize,
}

impl PyStepBatch {
    fn build(py: Python<'_>, b: &CoreBatch) -> PyResult<Self> {
        let (nb, m) = (b.num_seqs(), b.max_blocks_per_seq);
        Ok(PyStepBatch {
            input_ids: arr!(py, b.input_ids),
            positions: arr!(py, b.positions),
            slot_mapping: arr!(py, b.slot_mapping),
            query_start_loc: arr!(py, b.query_start_loc),
            seq_lens: arr!(py, b.seq_lens),
            block_tables: PyArray1::from_slice(py, &b.block_tables)
                .reshape([nb, m])?
                .into_any()
                .unbind(),
            block_copies: PyArray1::from_slice(py, &b.block_copies)
                .reshape([b.num_copies(), 2])?
                .into_any()
                .unbind(),
            seq_req_ids: arr!(py, b.seq_req_ids),
            seq_indices: arr!(py, b.seq_indices),
            logits_indices: arr!(py, b.logits_indices),
            sample_req_ids: arr!(py, b.sample_req_ids),
            sample_seq_indices: arr!(py, b.sample_seq_indices),
            sample_output_lens: arr!(py, b.sample_output_lens),
            temperature: arr!(py, b.temperature),
            top_k: arr!(py, b.top_k),
            top_p: arr!(py, b.top_p),
            min_p: arr!(py, b.min_p),
            repetition_penalty: arr!(py, b.repetition_penalty),
            presence_penalty: arr!(py, b.presence_penalty),
            frequency_penalty: arr!(py, b.frequency_penalty),
            seed: arr!(py, b.seed),
            suppress_eos: arr!(py, b.suppress_eos),
            num_tokens: b.num_tokens(),
            num_seqs: nb,
            num_samples: b.num_samples(),
            num_prefill_tokens: b.num_prefill_tokens,
            num_decode_tokens: b.num_decode_tokens,
            num_draft_tokens: b.num_draft_tokens,
            max_blocks_per_seq: m,
        })
    }
}

#[pymethods]
impl PyStepBatch {
    fn __repr__(&self) -> String {
        format!(
            "StepBatch(num_tokens={}, num_seqs={}, num_samples={}, prefill={}, decode={}, draft={})",
            self.num_tokens,
            self.num_seqs,
            self.num_samples,
            self.num_prefill_tokens,
            self.num_decode_tokens,
            self.num_draft_tokens
        )
    }
}

/// Events of one `update()`.
#[pyclass(name = "StepOutput", module = "ferrobatch._scheduler", frozen, get_all)]
pub struct PyStepOutput {
    req_ids: Py<PyArray1<u64>>,
    seq_indices: Py<PyArray1<i32>>,
    token_ids: Py<PyArray1<i32>>,
    finish_reasons: Py<PyArray1<u8>>,
    error_messages: Py<PyDict>,
    num_events: usize,
}

#[pymethods]
impl PyStepOutput {
    fn __len__(&self) -> usize {
        self.num_events
    }

    fn __repr__(&self) -> String {
        format!("StepOutput(num_events={})", self.num_events)
    }
}

/// The step-side scheduler. Not for concurrent use: one engine thread calls
/// `schedule()` / `update()`; other threads use `intake()`.
#[pyclass(name = "Scheduler", module = "ferrobatch._scheduler")]
pub struct PyScheduler {
    inner: CoreScheduler,
    sampled: Vec<i32>,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (num_blocks, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192,
        *, vocab_size, eos_token_ids=None, enable_prefix_caching=true, policy="fcfs", max_preemptions=8,
        intake_capacity=4096, long_prefill_token_threshold=0, num_speculative_tokens=0,
        speculative_ngram_min=2, speculative_ngram_max=4, speculative_max_running=0,
        speculative_max_step_tokens=0, speculative_adaptive=false, admission_batch=1,
        admission_max_wait_steps=8))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        block_size: i64,
        max_num_seqs: i64,
        max_num_batched_tokens: i64,
        max_model_len: i64,
        vocab_size: i64,
        eos_token_ids: Option<Vec<i64>>,
        enable_prefix_caching: bool,
        policy: &str,
        max_preemptions: i64,
        intake_capacity: i64,
        long_prefill_token_threshold: i64,
        num_speculative_tokens: i64,
        speculative_ngram_min: i64,
        speculative_ngram_max: i64,
        speculative_max_running: i64,
        speculative_max_step_tokens: i64,
        speculative_adaptive: bool,
        admission_batch: i64,
        admission_max_wait_steps: i64,
    ) -> PyResult<Self> {
        let mut eos = Vec::new();
        for e in eos_token_ids.unwrap_or_default() {
            eos.push(
                i32::try_from(e)
                    .map_err(|_| PyValueError::new_err(format!("eos token id {e} out of range")))?,
            );
        }
        let cfg = SchedulerConfig {
            num_blocks: range(num_blocks, "num_blocks", 0, i32::MAX as i64)? as usize,
            block_size: range(block_size, "block_size", 0, i32::MAX as i64)? as usize,
            max_num_seqs: range(max_num_seqs, "max_num_seqs", 0, i32::MAX as i64)? as usize,
            max_num_batched_tokens: range(
                max_num_batched_tokens,
                "max_num_batched_tokens",
                0,
                i32::MAX as i64,
            )? as usize,
            max_model_len: range(max_model_len, "max_model_len", 0, i32::MAX as i64)? as usize,
            vocab_size: range(vocab_size, "vocab_size", 0, i32::MAX as i64)? as usize,
            eos_token_ids: eos,
            enable_prefix_caching,
            policy: Policy::parse(policy).map_err(to_py)?,
            max_preemptions: range(max_preemptions, "max_preemptions", 0, u32::MAX as i64)? as u32,
            intake_capacity: range(intake_capacity, "intake_capacity", 1, 1 << 24)? as usize,
            long_prefill_token_threshold: range(
                long_prefill_token_threshold,
                "long_prefill_token_threshold",
                0,
                i32::MAX as i64,
            )? as usize,
            num_speculative_tokens: range(
                num_speculative_tokens,
                "num_speculative_tokens",
                0,
                i32::MAX as i64,
            )? as usize,
            speculative_ngram_min: range(
                speculative_ngram_min,
                "speculative_ngram_min",
                0,
                i32::MAX as i64,
            )? as usize,
            speculative_ngram_max: range(
                speculative_ngram_max,
                "speculative_ngram_max",
                0,
                i32::MAX as i64,
            )? as usize,
            speculative_max_running: range(
                speculative_max_running,
                "speculative_max_running",
                0,
                i32::MAX as i64,
            )? as usize,
            speculative_max_step_tokens: range(
                speculative_max_step_tokens,
                "speculative_max_step_tokens",
                0,
                i32::MAX as i64,
            )? as usize,
            speculative_adaptive,
            admission_batch: range(admission_batch, "admission_batch", 0, i32::MAX as i64)?
                as usize,
            admission_max_wait_steps: range(
                admission_max_wait_steps,
                "admission_max_wait_steps",
                0,
                i32::MAX as i64,
            )? as usize,
        };
        Ok(PyScheduler {
            inner: CoreScheduler::new(cfg).map_err(to_py)?,
            sampled: Vec::new(),
        })
    }

    /// A thread-safe submit/abort handle sharing this scheduler's queue.
    fn intake(&self) -> PyIntake {
        PyIntake {
            inner: self.inner.intake(),
        }
    }

    /// Drain the intake and build the next step (GIL released while building).
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyStepBatch> {
        let inner = &mut self.inner;
        py.detach(|| inner.schedule().map(|_| ())).map_err(to_py)?;
        PyStepBatch::build(py, self.inner.batch())
    }

    /// Apply the sampled tokens (int array of length `num_samples` of the last batch).
    fn update(&mut self, py: Python<'_>, sampled: &Bound<'_, PyAny>) -> PyResult<PyStepOutput> {
        let vocab = self.inner.config().vocab_size;
        if let Ok(a) = sampled.extract::<PyReadonlyArray1<'_, i32>>() {
            if a.ndim() != 1 {
                return Err(PyValueError::new_err("sampled must be 1-D"));
            }
            self.sampled.clear();
            self.sampled.extend(a.as_array().iter().copied());
        } else {
            let mut v = std::mem::take(&mut self.sampled);
            let r = token_ids(sampled, "sampled", vocab, &mut v);
            self.sampled = v;
            r?;
        }
        let (inner, toks) = (&mut self.inner, &self.sampled);
        py.detach(|| inner.update(toks).map(|_| ()))
            .map_err(to_py)?;
        let o = self.inner.output();
        let msgs = PyDict::new(py);
        for (id, m) in &o.error_messages {
            msgs.set_item(id, m)?;
        }
        Ok(PyStepOutput {
            req_ids: arr!(py, o.req_ids),
            seq_indices: arr!(py, o.seq_indices),
            token_ids: arr!(py, o.token_ids),
            finish_reasons: arr!(py, o.finish_reasons),
            error_messages: msgs.unbind(),
            num_events: o.len(),
        })
    }

    /// True while sequences are waiting or running, or intake commands are queued.
    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    /// Counters (see README).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("num_waiting", s.num_waiting)?;
        d.set_item("num_running", s.num_running)?;
        d.set_item("num_free_blocks", s.num_free_blocks)?;
        d.set_item("num_cached_blocks", s.num_cached_blocks)?;
        d.set_item("num_used_blocks", s.num_used_blocks)?;
        d.set_item("num_blocks", s.num_blocks)?;
        d.set_item("kv_cache_usage", s.kv_cache_usage)?;
        d.set_item("num_preemptions_total", s.num_preemptions_total)?;
        d.set_item("prefix_cache_queries_total", s.prefix_cache_queries_total)?;
        d.set_item("prefix_cache_hits_total", s.prefix_cache_hits_total)?;
        d.set_item("num_prompt_tokens_total", s.num_prompt_tokens_total)?;
        d.set_item("num_generation_tokens_total", s.num_generation_tokens_total)?;
        d.set_item("num_draft_tokens_total", s.num_draft_tokens_total)?;
        d.set_item("num_accepted_tokens_total", s.num_accepted_tokens_total)?;
        d.set_item("num_admission_holds_total", s.num_admission_holds_total)?;
        d.set_item("intake_queue_len", s.intake_queue_len)?;
        Ok(d)
    }

    /// Forget the prefix cache's free blocks (used ones stay shared); returns how many.
    fn reset_prefix_cache(&mut self) -> usize {
        self.inner.reset_prefix_cache()
    }

    /// Start cache epoch `epoch` (the engine's weights version): sequences admitted from now
    /// on never reuse KV computed before.
    fn set_cache_epoch(&mut self, epoch: u64) {
        self.inner.set_cache_epoch(epoch);
    }

    /// Raise RuntimeError describing the first broken invariant, if any.
    fn check_integrity(&self) -> PyResult<()> {
        self.inner
            .check_integrity()
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks
    }
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.config().max_num_seqs
    }
    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.config().max_num_batched_tokens
    }
    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.config().max_model_len
    }
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.config().vocab_size
    }
    #[getter]
    fn eos_token_ids(&self) -> Vec<i32> {
        self.inner.config().eos_token_ids.clone()
    }
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.config().enable_prefix_caching
    }
    #[getter]
    fn policy(&self) -> &'static str {
        match self.inner.config().policy {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
        }
    }
}

#[pymodule]
#[pyo3(name = "_scheduler")]
fn scheduler_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyIntake>()?;
    m.add_class::<PyStepBatch>()?;
    m.add_class::<PyStepOutput>()?;
    m.add("QueueFullError", m.py().get_type::<QueueFullError>())?;
    m.add_function(wrap_pyfunction!(
        crate::py_attention::py_paged_decode_attention_f32,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_attention::py_paged_prefill_attention_f32,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_linear_f32, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_linear_q4_1_f32, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_pack_half_panels, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_linear_q8_0_f32, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_linear_q8_g16_f32, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_rms_norm_f32, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_rotary_f32, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_linear_isa, m)?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_linear::py_quant_panels_min_rows,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_amx_available, m)?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_linear::py_half_panels_amx_rows,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_linear::py_one_row_int16_available,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_amx_min_rows, m)?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_linear::py_linear_tile_rows_f32,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_pack_amx_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_gguf_blocks::py_q4_k_to_q4_1, m)?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_gguf_blocks::py_k_quant_to_q8_g16,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_pack_amx_q8_0, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_linear::py_linear_amx_f32, m)?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_linear::py_pack_quant_panels_q4_1,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_linear::py_pack_quant_panels_q8_0,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_linear::py_pack_quant_panels_q8_g16,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_linear::py_linear_quant_panels_f32,
        m
    )?)?;
    m.add_class::<crate::py_decoder::PyCpuDecoderStack>()?;
    m.add_class::<crate::py_decoder::PyCpuLoraStack>()?;
    m.add_function(wrap_pyfunction!(
        crate::py_decoder::py_set_decoder_phase_timing,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_decoder::py_take_decoder_phase_times,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(crate::py_greedy::py_greedy_rows_f32, m)?)?;
    m.add_function(wrap_pyfunction!(crate::py_sampling::py_sample_rows_f32, m)?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_sampling::py_apply_penalties_f32,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(
        crate::py_sampling::py_logprobs_rows_f32,
        m
    )?)?;
    m.add_class::<crate::py_guided::PyTokenVocab>()?;
    m.add_class::<crate::py_guided::PyGuidedGrammar>()?;
    m.add_class::<crate::py_guided::PyGuidedSequence>()?;
    Ok(())
}
