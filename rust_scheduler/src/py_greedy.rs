//! PyO3 binding of greedy sampling's read of the logits (`cpu_greedy`): a numpy view of the
//! step's float32 logits in, each row's argmax and finite flag written into `out` in place. The
//! GIL stays held: a call takes about a tenth of a millisecond. A shape problem is a
//! `ValueError`.

use crate::cpu_greedy::{greedy_rows_f32, GreedyRow};
use crate::py_linear::c_contiguous;
use numpy::{PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `greedy_rows_f32(logits, out, num_threads)`: for each row `r` of `logits` (`[S, V]`
/// float32), `out[r] = (index of its first largest value, 1 if every value is finite else 0)`
/// (`out`: int64 `[S, 2]`, as the CUDA path's `sampler.greedy_rows`); a row's index is
/// meaningless where its flag is 0. Returns None.
#[pyfunction]
#[pyo3(name = "greedy_rows_f32", signature = (logits, out, num_threads))]
pub fn py_greedy_rows_f32(
    logits: PyReadonlyArray2<'_, f32>,
    mut out: PyReadwriteArray2<'_, i64>,
    num_threads: usize,
) -> PyResult<()> {
    let [rows, vocab] = [logits.shape()[0], logits.shape()[1]];
    if out.shape() != [rows, 2] {
        return Err(PyValueError::new_err(format!(
            "out has shape {:?}; logits of {rows} rows need [{rows}, 2]",
            out.shape()
        )));
    }
    let logits = c_contiguous("logits", logits.is_c_contiguous(), logits.as_slice())?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    let empty = GreedyRow {
        token: 0,
        finite: false,
    };
    let mut answers = vec![empty; rows];
    greedy_rows_f32(logits, vocab, &mut answers, num_threads)
        .map_err(|e| PyValueError::new_err(e.0))?;
    for (pair, a) in out.chunks_exact_mut(2).zip(&answers) {
        pair[0] = a.token as i64;
        pair[1] = i64::from(a.finite);
    }
    Ok(())
}
