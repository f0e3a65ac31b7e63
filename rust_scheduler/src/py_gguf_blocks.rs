//! PyO3 bindings of `gguf_blocks`: a GGUF Q4_K / Q5_K / Q6_K tensor's bytes rewritten into the block
//! kernels' arrays, which the caller allocates (numpy, C-contiguous); the GIL is released while
//! the load's threads (`load_parallel::load_threads`) run. A length that does not fit is a `ValueError`, with nothing written.

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
    mut scale: PyReadwriteArrayDyn<'_, f32>,
    mut min: PyReadwriteArrayDyn<'_, f32>,
    mut nibbles: PyReadwriteArrayDyn<'_, u8>,
) -> PyResult<()> {
    let raw = c_contiguous("raw", raw.is_c_contiguous(), raw.as_slice())?;
    let scale_ok = scale.is_c_contiguous();
    let scale = c_contiguous("scale", scale_ok, scale.as_slice_mut())?;
    let min_ok = min.is_c_contiguous();
    let min = c_contiguous("min", min_ok, min.as_slice_mut())?;
    let nibbles_ok = nibbles.is_c_contiguous();
    let nibbles = c_contiguous("nibbles", nibbles_ok, nibbles.as_slice_mut())?;
    py.detach(|| gguf_blocks::q4_k_to_q4_1(raw, scale, min, nibbles, load_threads()))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// `q6_k_to_q8_g16(raw, scale, min, q)`: Q6_K bytes (whole super-blocks of 210) into Q8G16's
/// float32 `scale` and `min` (one per 16 weights; the minimums are zero) and int8 `q` (one per
/// weight), as `dequant.g16_parts` computes them.
#[pyfunction]
#[pyo3(name = "q6_k_to_q8_g16")]
pub fn py_q6_k_to_q8_g16(
    py: Python<'_>,
    raw: PyReadonlyArrayDyn<'_, u8>,
    scale: PyReadwriteArrayDyn<'_, f32>,
    min: PyReadwriteArrayDyn<'_, f32>,
    q: PyReadwriteArrayDyn<'_, i8>,
) -> PyResult<()> {
    to_q8_g16(py, gguf_blocks::q6_k_to_q8_g16, raw, scale, min, q)
}

/// `k_quant_to_q8_g16(kind, raw, scale, min, q)`: Q4_K (`kind` 12) or Q5_K (13) bytes (whole
/// super-blocks) into Q8G16's float32 `scale` and `min` (one per 16 weights) and int8 `q` (one
/// per weight), as `dequant.g16_parts` computes Q5_K's and `BlockWeight.as_q8_g16` Q4_K's.
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
    let convert: G16Convert = match kind {
        12 => gguf_blocks::q4_k_to_q8_g16,
        13 => gguf_blocks::q5_k_to_q8_g16,
        _ => {
            return Err(PyValueError::new_err(format!(
                "GGUF type {kind} is not Q4_K or Q5_K"
            )))
        }
    };
    to_q8_g16(py, convert, raw, scale, min, q)
}

/// The Q8G16 bindings' shared body: the arrays as slices (C-contiguous or a ValueError), then
/// `convert` on the load's threads without the GIL.
fn to_q8_g16(
    py: Python<'_>,
    convert: G16Convert,
    raw: PyReadonlyArrayDyn<'_, u8>,
    mut scale: PyReadwriteArrayDyn<'_, f32>,
    mut min: PyReadwriteArrayDyn<'_, f32>,
    mut q: PyReadwriteArrayDyn<'_, i8>,
) -> PyResult<()> {
    let raw = c_contiguous("raw", raw.is_c_contiguous(), raw.as_slice())?;
    let scale_ok = scale.is_c_contiguous();
    let scale = c_contiguous("scale", scale_ok, scale.as_slice_mut())?;
    let min_ok = min.is_c_contiguous();
    let min = c_contiguous("min", min_ok, min.as_slice_mut())?;
    let q_ok = q.is_c_contiguous();
    let q = c_contiguous("q", q_ok, q.as_slice_mut())?;
    py.detach(|| convert(raw, scale, min, q, load_threads()))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// A `gguf_blocks` conversion to Q8G16's arrays.
type G16Convert =
    fn(&[u8], &mut [f32], &mut [f32], &mut [i8], usize) -> Result<(), KernelInputError>;
