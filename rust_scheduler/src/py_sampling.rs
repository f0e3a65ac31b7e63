//! PyO3 binding of random sampling's draw on the CPU (`cpu_sampling`): a numpy view of the
//! step's float32 logits and the rows' sampling arrays in, each row's token written into `out`
//! in place, the GIL released while the rows are drawn. A shape or parameter problem is a
//! `ValueError`.

use crate::cpu_sampling::{sample_rows_f32, RowSampling};
use crate::py_linear::c_contiguous;
use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray1, PyUntypedArrayMethods};
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
