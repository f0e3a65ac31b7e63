//! PyO3 bindings of the sampler's CPU kernels: the draw (`cpu_sampling`: a numpy view of the
//! step's float32 logits and the rows' sampling arrays in, each row's token written into `out`),
//! the penalties (`cpu_penalties`: the logits changed in place) and the logprobs
//! (`cpu_logprobs`), the GIL released while they run. A shape or parameter problem is a
//! `ValueError`.

use crate::cpu_logprobs::logprobs_rows_f32;
use crate::cpu_penalties::{apply_penalties_f32, RowPenalties, RowTokens};
use crate::cpu_sampling::{sample_rows_f32, RowSampling};
use crate::py_linear::c_contiguous;
use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray1, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `sample_rows_f32(logits, temperature, top_k, top_p, min_p, uniform, out, num_threads)`: for
/// each row `r` of `logits` (`[S, V]` float32), `out[r]` (int64 `[S]`) = the token drawn at
/// `uniform[r]` (float64 in [0, 1)) from the softmax of `logits[r] / temperature[r]` cut to
/// `top_k[r]` (int32; 0: all), then `top_p[r]` (float32 in (0, 1]), then `min_p[r]` (float32 in
/// [0, 1]): the first token in index order at which the kept probabilities' running sum reaches
/// `1 - uniform[r]`. A row with `temperature <= 0` gets its argmax. Returns None.
#[pyfunction]
#[pyo3(
    name = "sample_rows_f32",
    signature = (logits, temperature, top_k, top_p, min_p, uniform, out, num_threads)
)]
#[allow(clippy::too_many_arguments)]
pub fn py_sample_rows_f32(
    py: Python<'_>,
    logits: PyReadonlyArray2<'_, f32>,
    temperature: PyReadonlyArray1<'_, f32>,
    top_k: PyReadonlyArray1<'_, i32>,
    top_p: PyReadonlyArray1<'_, f32>,
    min_p: PyReadonlyArray1<'_, f32>,
    uniform: PyReadonlyArray1<'_, f64>,
    mut out: PyReadwriteArray1<'_, i64>,
    num_threads: usize,
) -> PyResult<()> {
    let [rows, vocab] = [logits.shape()[0], logits.shape()[1]];
    let arrays = [
        ("temperature", temperature.len()),
        ("top_k", top_k.len()),
        ("top_p", top_p.len()),
        ("min_p", min_p.len()),
        ("uniform", uniform.len()),
        ("out", out.len()),
    ];
    if let Some((name, len)) = arrays.iter().find(|(_, len)| *len != rows) {
        return Err(PyValueError::new_err(format!(
            "{name} has {len} elements; logits of {rows} rows need {rows}"
        )));
    }
    let logits = c_contiguous("logits", logits.is_c_contiguous(), logits.as_slice())?;
    let params: Vec<RowSampling> = (0..rows)
        .map(|r| {
            let k = *top_k.get(r).expect("length checked");
            RowSampling {
                temperature: *temperature.get(r).expect("length checked"),
                top_k: usize::try_from(k).unwrap_or(0),
                top_p: *top_p.get(r).expect("length checked"),
                min_p: *min_p.get(r).expect("length checked"),
                uniform: *uniform.get(r).expect("length checked"),
            }
        })
        .collect();
    let mut tokens = vec![0usize; rows];
    py.detach(|| sample_rows_f32(logits, vocab, &params, &mut tokens, num_threads))
        .map_err(|e| PyValueError::new_err(e.0))?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    for (o, t) in out.iter_mut().zip(&tokens) {
        *o = *t as i64;
    }
    Ok(())
}

/// `apply_penalties_f32(logits, repetition, frequency, presence, tokens, spans, num_threads)`:
/// the sampler's penalties on each row `r` of `logits` (`[S, V]` float32, C-contiguous, changed
/// in place): `repetition[r]` (float32; 1: none) once per distinct token of
/// `tokens[spans[r, 0]:spans[r, 1]]` (the row's prompt and output), then `frequency[r]` and
/// `presence[r]` (float32) per distinct token of `tokens[spans[r, 2]:spans[r, 3]]` (its output),
/// `tokens` int64, `spans` int64 `[S, 4]`. A token id outside the vocabulary is a ValueError
/// before any logit changes. Returns None.
#[pyfunction]
#[pyo3(
    name = "apply_penalties_f32",
    signature = (logits, repetition, frequency, presence, tokens, spans, num_threads)
)]
#[allow(clippy::too_many_arguments)]
pub fn py_apply_penalties_f32(
    py: Python<'_>,
    mut logits: PyReadwriteArray2<'_, f32>,
    repetition: PyReadonlyArray1<'_, f32>,
    frequency: PyReadonlyArray1<'_, f32>,
    presence: PyReadonlyArray1<'_, f32>,
    tokens: PyReadonlyArray1<'_, i64>,
    spans: PyReadonlyArray2<'_, i64>,
    num_threads: usize,
) -> PyResult<()> {
    let [rows, vocab] = [logits.shape()[0], logits.shape()[1]];
    let arrays = [
        ("repetition", repetition.len()),
        ("frequency", frequency.len()),
        ("presence", presence.len()),
    ];
    if let Some((name, len)) = arrays.iter().find(|(_, len)| *len != rows) {
        return Err(PyValueError::new_err(format!(
            "{name} has {len} elements; logits of {rows} rows need {rows}"
        )));
    }
    if spans.shape() != [rows, 4] {
        return Err(PyValueError::new_err(format!(
            "spans has shape {:?}; logits of {rows} rows need [{rows}, 4]",
            spans.shape()
        )));
    }
    let tokens = c_contiguous("tokens", tokens.is_c_contiguous(), tokens.as_slice())?;
    let spans = c_contiguous("spans", spans.is_c_contiguous(), spans.as_slice())?;
    let at = |v: i64| usize::try_from(v).unwrap_or(usize::MAX);
    let row_tokens: Vec<RowTokens> = spans
        .chunks_exact(4)
        .map(|s| RowTokens {
            seen: (at(s[0]), at(s[1])),
            counted: (at(s[2]), at(s[3])),
        })
        .collect();
    let penalties: Vec<RowPenalties> = (0..rows)
        .map(|r| RowPenalties {
            repetition: *repetition.get(r).expect("length checked"),
            frequency: *frequency.get(r).expect("length checked"),
            presence: *presence.get(r).expect("length checked"),
        })
        .collect();
    let logits_c = logits.is_c_contiguous();
    let logits = c_contiguous("logits", logits_c, logits.as_slice_mut())?;
    py.detach(|| apply_penalties_f32(logits, vocab, &penalties, &row_tokens, tokens, num_threads))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// `logprobs_rows_f32(logits, tokens, chosen, top_ids, top_values, num_threads)`: per row `r` of
/// `logits` (`[S, V]` float32, C-contiguous), `chosen[r]` (float32 `[S]`) = the `log_softmax`
/// of token `tokens[r]` (int64 `[S]`), and `top_ids[r]` (int64 `[S, n]`) / `top_values[r]`
/// (float32 `[S, n]`) the row's `n` most likely tokens and their logprobs, descending (equal
/// logits by lower index). Returns None.
#[pyfunction]
#[pyo3(
    name = "logprobs_rows_f32",
    signature = (logits, tokens, chosen, top_ids, top_values, num_threads)
)]
pub fn py_logprobs_rows_f32(
    py: Python<'_>,
    logits: PyReadonlyArray2<'_, f32>,
    tokens: PyReadonlyArray1<'_, i64>,
    mut chosen: PyReadwriteArray1<'_, f32>,
    mut top_ids: PyReadwriteArray2<'_, i64>,
    mut top_values: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let [rows, vocab] = [logits.shape()[0], logits.shape()[1]];
    let n = top_ids.shape()[1];
    if tokens.len() != rows || top_ids.shape()[0] != rows || top_values.shape() != [rows, n] {
        return Err(PyValueError::new_err(format!(
            "tokens {:?}, top_ids {:?} and top_values {:?} for logits of {rows} rows",
            tokens.shape(),
            top_ids.shape(),
            top_values.shape()
        )));
    }
    let logits = c_contiguous("logits", logits.is_c_contiguous(), logits.as_slice())?;
    let tokens: Vec<usize> = (0..rows)
        .map(|r| usize::try_from(*tokens.get(r).expect("length checked")).unwrap_or(usize::MAX))
        .collect();
    let c = chosen.is_c_contiguous();
    let chosen = c_contiguous("chosen", c, chosen.as_slice_mut())?;
    let c = top_ids.is_c_contiguous();
    let top_ids = c_contiguous("top_ids", c, top_ids.as_slice_mut())?;
    let c = top_values.is_c_contiguous();
    let top_values = c_contiguous("top_values", c, top_values.as_slice_mut())?;
    py.detach(|| {
        logprobs_rows_f32(
            logits,
            vocab,
            &tokens,
            n,
            chosen,
            top_ids,
            top_values,
            num_threads,
        )
    })
    .map_err(|e| PyValueError::new_err(e.0))
}
