//! PyO3 bindings of `gguf_blocks`: a GGUF Q4_K / Q5_K / Q6_K tensor's bytes rewritten into the block
//! kernels' arrays, which the caller allocates (numpy, C-contiguous); the GIL is released while
//! the load's threads (`load_parallel::load_threads`) run. A length that does not fit is a
//! `ValueError`, with nothing written.

use crate::cpu_error::KernelInputError;
use crate::gguf_blocks;
use crate::load_parallel::load_threads;
use crate::py_linear::c_contiguous;
use numpy::{PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `q4_k_to_q4_1(raw, scale, min, nibbles)`: Q4_K bytes (whole super-blocks of 144)
/// into the Q4_1 kernel's float32 `scale` and `min` (one per 32 weights) and uint8 `nibbles`
/// (16 per 32 weights), as `dequant.q4_nibbles` computes them.
#[pyfunction]
#[pyo3(name = "q4_k_to_q4_1")]
pub fn py_q4_k_to_q4_1(
    py: Python<'_>,
    raw: PyReadonlyArrayDyn<'_, u8>,
    scale: PyReadwriteArrayDyn<'_, f32>,
    min: PyReadwriteArrayDyn<'_, f32>,
    nibbles: PyReadwriteArrayDyn<'_, u8>,
) -> PyResult<()> {
    run(py, raw, scale, min, nibbles, |raw, scale, min, nibbles| {
        gguf_blocks::q4_k_to_q4_1(raw, scale, min, nibbles, load_threads())
    })
}

/// `k_quant_to_q8_g16(kind, raw, scale, min, q)`: Q4_K (`kind` 12), Q5_K (13) or Q6_K (14)
/// bytes (whole super-blocks) into Q8G16's float32 `scale` and `min` (one per 16 weights) and
/// int8 `q` (one per weight), as `dequant.g16_parts` computes Q5_K's and Q6_K's and
/// `BlockWeight.as_q8_g16` Q4_K's.
#[pyfunction]
#[pyo3(name = "k_quant_to_q8_g16")]
pub fn py_k_quant_to_q8_g16(
    py: Python<'_>,
    kind: u32,
    raw: PyReadonlyArrayDyn<'_, u8>,
    scale: PyReadwriteArrayDyn<'_, f32>,
    min: PyReadwriteArrayDyn<'_, f32>,
    q: PyReadwriteArrayDyn<'_, i8>,
) -> PyResult<()> {
    run(py, raw, scale, min, q, |raw, scale, min, q| {
        gguf_blocks::k_quant_to_q8_g16(kind, raw, scale, min, q, load_threads())
    })
}

/// The bindings' shared body: the arrays as slices (C-contiguous or a ValueError), then
/// `convert` without the GIL.
fn run<T: numpy::Element + Send>(
    py: Python<'_>,
    raw: PyReadonlyArrayDyn<'_, u8>,
    mut scale: PyReadwriteArrayDyn<'_, f32>,
    mut min: PyReadwriteArrayDyn<'_, f32>,
    mut values: PyReadwriteArrayDyn<'_, T>,
    convert: impl FnOnce(&[u8], &mut [f32], &mut [f32], &mut [T]) -> Result<(), KernelInputError> + Send,
) -> PyResult<()> {
    let raw = c_contiguous("raw", raw.is_c_contiguous(), raw.as_slice())?;
    let scale_ok = scale.is_c_contiguous();
    let scale = c_contiguous("scale", scale_ok, scale.as_slice_mut())?;
    let min_ok = min.is_c_contiguous();
    let min = c_contiguous("min", min_ok, min.as_slice_mut())?;
    let values_ok = values.is_c_contiguous();
    let values = c_contiguous("values", values_ok, values.as_slice_mut())?;
    py.detach(|| convert(raw, scale, min, values))
        .map_err(|e| PyValueError::new_err(e.0))
}
