//! PyO3 bindings of the CPU linear-layer kernel (`cpu_linear`) and the elementwise ops
//! (`cpu_elementwise`): numpy views of torch CPU tensors
//! in, the result written into `out` in place, GIL released while it runs.
//!
//! Every shape problem is a `ValueError` (checked by `LinearShape::validate` before any read);
//! arrays must be C-contiguous float32.

use crate::cpu_amx_linear::{self, linear_amx_f32, AmxFormat, AmxShape, AmxTiles};
use crate::cpu_elementwise::{rms_norm_f32, rotary_f32};
use crate::cpu_error::KernelInputError;
use crate::cpu_half_panels;
use crate::cpu_linear::{linear_f32, LinearShape, PANEL_WIDTH};
use crate::cpu_quant_linear::{linear_quant_f32, QuantShape, QuantWeight};
use crate::cpu_quant_panels::{
    self, linear_quant_panels_f32, PanelFormat, QuantPanelShape, QuantPanels,
};
use crate::cpu_tile_rows::linear_tile_rows_f32;
use numpy::{
    IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadwriteArray2,
    PyReadwriteArray3, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `slice` (an array's `as_slice` / `as_slice_mut`) if the array is C-contiguous (`ok`), else a
/// `ValueError` naming it.
pub(crate) fn c_contiguous<T>(
    name: &str,
    ok: bool,
    slice: Result<T, numpy::AsSliceError>,
) -> PyResult<T> {
    let not_c = || PyValueError::new_err(format!("{name} must be C-contiguous"));
    if !ok {
        return Err(not_c());
    }
    slice.map_err(|_| not_c())
}

/// An optional bias as a slice (empty when None).
fn bias_slice<'a>(bias: &'a Option<PyReadonlyArray1<'_, f32>>) -> PyResult<&'a [f32]> {
    match bias {
        Some(b) => c_contiguous("bias", b.is_c_contiguous(), b.as_slice()),
        None => Ok(&[]),
    }
}

/// `linear_f32(x, packed, bias, out, num_threads)`: `out[M, N] = x[M, K] @ W^T + bias` with `W`
/// packed as `[ceil(N / 16), K, 16]` (panel `p`, row `k` = `W[16p..16p+16, k]`, zero padded);
/// `bias` `[N]` or None. All float32. Writes `out`; returns None.
#[pyfunction]
#[pyo3(name = "linear_f32", signature = (x, packed, bias, out, num_threads))]
pub fn py_linear_f32(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    packed: PyReadonlyArray3<'_, f32>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    mut out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let [m, k] = [x.shape()[0], x.shape()[1]];
    let [out_m, n] = [out.shape()[0], out.shape()[1]];
    let [panels, packed_k, width] = [packed.shape()[0], packed.shape()[1], packed.shape()[2]];
    if out_m != m {
        return Err(PyValueError::new_err(format!(
            "out has {out_m} rows, x has {m}"
        )));
    }
    if width != PANEL_WIDTH || packed_k != k || panels != n.div_ceil(PANEL_WIDTH) {
        return Err(PyValueError::new_err(format!(
            "packed weight has shape [{panels}, {packed_k}, {width}]; x [{m}, {k}] and out \
             [{m}, {n}] need [{}, {k}, {PANEL_WIDTH}]",
            n.div_ceil(PANEL_WIDTH)
        )));
    }
    let x = c_contiguous("x", x.is_c_contiguous(), x.as_slice())?;
    let packed = c_contiguous("packed", packed.is_c_contiguous(), packed.as_slice())?;
    let bias = bias_slice(&bias)?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    let shape = LinearShape { m, n, k };
    py.detach(|| linear_f32(&shape, x, packed, bias, out, num_threads))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// `linear_q4_1_f32(x, scale, min, qs, bias, out, num_threads)`: `out[M, N] = x[M, K] @ W^T +
/// bias` with `W` in Q4_1 blocks: `scale`, `min` `[N, K / 32]` float32, `qs` `[N, K / 32, 16]`
/// uint8; `M` at most 4. Writes `out`; returns None.
#[pyfunction]
#[pyo3(name = "linear_q4_1_f32", signature = (x, scale, min, qs, bias, out, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn py_linear_q4_1_f32(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    scale: PyReadonlyArray2<'_, f32>,
    min: PyReadonlyArray2<'_, f32>,
    qs: PyReadonlyArray3<'_, u8>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let w = q4_1_weight(&scale, &min, &qs)?;
    quant_call(py, x, scale.shape()[0], w, bias, out, num_threads)
}

/// `linear_q8_0_f32(x, scale, qs, bias, out, num_threads)`: the same with `W` in Q8_0 blocks:
/// `scale` `[N, K / 32]` float32, `qs` `[N, K / 32, 32]` int8.
#[pyfunction]
#[pyo3(name = "linear_q8_0_f32", signature = (x, scale, qs, bias, out, num_threads))]
pub fn py_linear_q8_0_f32(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    scale: PyReadonlyArray2<'_, f32>,
    qs: PyReadonlyArray3<'_, i8>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let w = q8_0_weight(&scale, &qs)?;
    quant_call(py, x, scale.shape()[0], w, bias, out, num_threads)
}

/// `linear_q8_g16_f32(x, scale, min, qs, bias, out, num_threads)`: the same with `W` as int8
/// weights with a scale and a minimum per 16 inputs (`w = scale * q + min`): `scale`, `min`
/// `[N, K / 16]` float32, `qs` `[N, K / 32, 32]` int8.
#[pyfunction]
#[pyo3(name = "linear_q8_g16_f32", signature = (x, scale, min, qs, bias, out, num_threads))]
#[allow(clippy::too_many_arguments)]
pub fn py_linear_q8_g16_f32(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    scale: PyReadonlyArray2<'_, f32>,
    min: PyReadonlyArray2<'_, f32>,
    qs: PyReadonlyArray3<'_, i8>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let w = q8_g16_weight(&scale, &min, &qs)?;
    quant_call(py, x, scale.shape()[0], w, bias, out, num_threads)
}

/// Shared tail of the linear bindings over GGUF blocks (as they are, as AMX tiles, as
/// quantized panels): `out` must have `x`'s rows (and `weight_rows` columns, when given), the
/// arrays must be C-contiguous, then `kernel(m, n, k, x, bias, out)` runs without the GIL; its
/// error is a `ValueError`.
fn rows_call(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight_rows: Option<usize>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    mut out: PyReadwriteArray2<'_, f32>,
    kernel: impl FnOnce(usize, usize, usize, &[f32], &[f32], &mut [f32]) -> Result<(), KernelInputError>
        + Send,
) -> PyResult<()> {
    let [m, k] = [x.shape()[0], x.shape()[1]];
    let [out_m, n] = [out.shape()[0], out.shape()[1]];
    if out_m != m || weight_rows.is_some_and(|rows| rows != n) {
        let rows = weight_rows.map_or(String::new(), |r| format!(" and the weight has {r} rows"));
        return Err(PyValueError::new_err(format!(
            "out is [{out_m}, {n}]{rows}; x [{m}, {k}] needs out [{m}, N] (N weight rows)"
        )));
    }
    let x = c_contiguous("x", x.is_c_contiguous(), x.as_slice())?;
    let bias = bias_slice(&bias)?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    py.detach(|| kernel(m, n, k, x, bias, out))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// Shared tail of the two quantized bindings.
fn quant_call(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight_rows: usize,
    w: QuantWeight<'_>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    rows_call(
        py,
        x,
        Some(weight_rows),
        bias,
        out,
        |m, n, k, x, bias, out| {
            linear_quant_f32(&QuantShape { m, n, k }, x, w, bias, out, num_threads)
        },
    )
}

/// `amx_available()`: whether `linear_amx_f32` runs here (AMX-TILE, AMX-BF16 and AVX-512F, the
/// tile state granted by Linux, `FERROBATCH_CPU_ISA` unset or `amx`).
#[pyfunction]
#[pyo3(name = "amx_available")]
pub fn py_amx_available() -> bool {
    cpu_amx_linear::available()
}

/// `half_panels_amx_rows()`: the fewest rows of a step whose bfloat16 panels go to AMX tiles
/// (`cpu_half_amx`: float32 accuracy, not `linear_f32`'s bits), or None where AMX does not run.
#[pyfunction]
#[pyo3(name = "half_panels_amx_rows")]
pub fn py_half_panels_amx_rows() -> Option<usize> {
    cpu_amx_linear::available().then_some(crate::cpu_half_amx::MIN_ROWS)
}

/// `amx_min_rows(k)`: the fewest rows of a step the AMX tiles of a layer of `k` inputs take
/// (fewer go to its GGUF blocks): 3, 4 or 5 (`cpu_amx_linear::min_rows`).
#[pyfunction]
#[pyo3(name = "amx_min_rows")]
pub fn py_amx_min_rows(k: usize) -> usize {
    cpu_amx_linear::min_rows(k)
}

/// `pack_amx_q4_1(scale, min, qs)`: Q4_1 blocks (the arrays `linear_q4_1_f32` reads) as the
/// AMX kernel's tiles: a uint16 array of `ceil(N / 16) * K / 32 * 192` (4-bit integers,
/// `cpu_amx_linear.rs`).
#[pyfunction]
#[pyo3(name = "pack_amx_q4_1")]
pub fn py_pack_amx_q4_1<'py>(
    py: Python<'py>,
    scale: PyReadonlyArray2<'py, f32>,
    min: PyReadonlyArray2<'py, f32>,
    qs: PyReadonlyArray3<'py, u8>,
) -> PyResult<Bound<'py, PyArray1<u16>>> {
    let [n, nb] = [scale.shape()[0], scale.shape()[1]];
    let w = q4_1_weight(&scale, &min, &qs)?;
    pack_call(py, &w, n, nb, AMX_TILES)
}

/// `pack_amx_q8_0(scale, qs)`: the same for Q8_0 blocks (`qs` `[N, K / 32, 32]` int8): `576`
/// per chunk (bfloat16 integers).
#[pyfunction]
#[pyo3(name = "pack_amx_q8_0")]
pub fn py_pack_amx_q8_0<'py>(
    py: Python<'py>,
    scale: PyReadonlyArray2<'py, f32>,
    qs: PyReadonlyArray3<'py, i8>,
) -> PyResult<Bound<'py, PyArray1<u16>>> {
    let [n, nb] = [scale.shape()[0], scale.shape()[1]];
    let w = q8_0_weight(&scale, &qs)?;
    pack_call(py, &w, n, nb, AMX_TILES)
}

/// The Q4_1 weight of a binding's block arrays (a `ValueError` for one not C-contiguous).
fn q4_1_weight<'a>(
    scale: &'a PyReadonlyArray2<'_, f32>,
    min: &'a PyReadonlyArray2<'_, f32>,
    qs: &'a PyReadonlyArray3<'_, u8>,
) -> PyResult<QuantWeight<'a>> {
    Ok(QuantWeight::Q4_1 {
        scale: c_contiguous("scale", scale.is_c_contiguous(), scale.as_slice())?,
        min: c_contiguous("min", min.is_c_contiguous(), min.as_slice())?,
        qs: c_contiguous("qs", qs.is_c_contiguous(), qs.as_slice())?,
    })
}

/// The Q8_0 weight of a binding's block arrays.
fn q8_0_weight<'a>(
    scale: &'a PyReadonlyArray2<'_, f32>,
    qs: &'a PyReadonlyArray3<'_, i8>,
) -> PyResult<QuantWeight<'a>> {
    Ok(QuantWeight::Q8_0 {
        scale: c_contiguous("scale", scale.is_c_contiguous(), scale.as_slice())?,
        qs: c_contiguous("qs", qs.is_c_contiguous(), qs.as_slice())?,
    })
}

/// A packing's `(packed_len, pack_into)` pair (`cpu_quant_panels`, `cpu_amx_linear`).
type Packing<T> = (
    fn(&QuantWeight<'_>, usize, usize) -> Result<usize, KernelInputError>,
    fn(&QuantWeight<'_>, usize, usize, &mut [T]) -> Result<(), KernelInputError>,
);

const AMX_TILES: Packing<u16> = (cpu_amx_linear::packed_len, cpu_amx_linear::pack_into);
const QUANT_PANELS: Packing<u8> = (cpu_quant_panels::packed_len, cpu_quant_panels::pack_into);

/// The Q8G16 weight of a binding's arrays.
fn q8_g16_weight<'a>(
    scale: &'a PyReadonlyArray2<'_, f32>,
    min: &'a PyReadonlyArray2<'_, f32>,
    qs: &'a PyReadonlyArray3<'_, i8>,
) -> PyResult<QuantWeight<'a>> {
    Ok(QuantWeight::Q8G16 {
        scale: c_contiguous("scale", scale.is_c_contiguous(), scale.as_slice())?,
        min: c_contiguous("min", min.is_c_contiguous(), min.as_slice())?,
        qs: c_contiguous("qs", qs.is_c_contiguous(), qs.as_slice())?,
    })
}

/// Shared tail of the pack bindings: the packing without the GIL, as a numpy array starting on
/// a 64-byte boundary (the kernels' tile rows and panel records are 64-byte multiples, and
/// one straddling two cache lines costs two accesses): packed straight into an aligned part
/// of one allocation, whose other bytes (under 64) the array does not show.
fn pack_call<'py, T: numpy::Element + Send + Copy + Default>(
    py: Python<'py>,
    w: &QuantWeight<'_>,
    n: usize,
    nb: usize,
    (packed_len, pack_into): Packing<T>,
) -> PyResult<Bound<'py, PyArray1<T>>> {
    let k = nb * crate::cpu_quant_linear::BLOCK;
    let len = packed_len(w, n, k).map_err(|e| PyValueError::new_err(e.0))?;
    aligned_64(py, len, |data| pack_into(w, n, k, data))
}

/// `linear_amx_f32(x, tiles, kind, bias, out, num_threads)`: `out[M, N] = x[M, K] @ W^T + bias`
/// with `W` packed by `pack_amx_q4_1` (`kind` "q4_1") / `pack_amx_q8_0` ("q8_0"); a ValueError
/// where AMX is not available.
#[pyfunction]
#[pyo3(name = "linear_amx_f32", signature = (x, tiles, kind, bias, out, num_threads))]
pub fn py_linear_amx_f32(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    tiles: PyReadonlyArray1<'_, u16>,
    kind: &str,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    tiles_call(py, x, tiles, kind, bias, out, num_threads, linear_amx_f32)
}

/// `linear_tile_rows_f32(x, tiles, kind, bias, out, num_threads)`: as `linear_amx_f32` for
/// steps of at most 4 rows, without tile instructions (`cpu_tile_rows.rs`); a ValueError where
/// AMX is not available or for more rows.
#[pyfunction]
#[pyo3(name = "linear_tile_rows_f32", signature = (x, tiles, kind, bias, out, num_threads))]
pub fn py_linear_tile_rows_f32(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    tiles: PyReadonlyArray1<'_, u16>,
    kind: &str,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    tiles_call(
        py,
        x,
        tiles,
        kind,
        bias,
        out,
        num_threads,
        linear_tile_rows_f32,
    )
}

/// The signature of the kernels over AMX tiles (`linear_amx_f32`, `linear_tile_rows_f32`).
type TilesKernel = fn(
    &AmxShape,
    &[f32],
    AmxTiles<'_>,
    &[f32],
    &mut [f32],
    usize,
) -> Result<(), crate::cpu_error::KernelInputError>;

/// The body both tile bindings share: `kind` names the tiles' format, `kernel` runs them.
#[allow(clippy::too_many_arguments)]
fn tiles_call(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    tiles: PyReadonlyArray1<'_, u16>,
    kind: &str,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
    kernel: TilesKernel,
) -> PyResult<()> {
    let format = amx_format(kind)?;
    let data = c_contiguous("tiles", tiles.is_c_contiguous(), tiles.as_slice())?;
    let tiles = AmxTiles { format, data };
    rows_call(py, x, None, bias, out, |m, n, k, x, bias, out| {
        kernel(&AmxShape { m, n, k }, x, tiles, bias, out, num_threads)
    })
}

/// `pack_quant_panels_q4_1(scale, min, qs)`: Q4_1 blocks (the arrays `linear_q4_1_f32` reads)
/// laid out as 16-feature panels for `linear_quant_panels_f32`: a uint8 array of
/// `ceil(N / 16) * K / 32 * 384` (`cpu_quant_panels.rs`).
#[pyfunction]
#[pyo3(name = "pack_quant_panels_q4_1")]
pub fn py_pack_quant_panels_q4_1<'py>(
    py: Python<'py>,
    scale: PyReadonlyArray2<'py, f32>,
    min: PyReadonlyArray2<'py, f32>,
    qs: PyReadonlyArray3<'py, u8>,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let [n, nb] = [scale.shape()[0], scale.shape()[1]];
    let w = q4_1_weight(&scale, &min, &qs)?;
    pack_call(py, &w, n, nb, QUANT_PANELS)
}

/// `pack_quant_panels_q8_0(scale, qs)`: the same for Q8_0 blocks (`qs` `[N, K / 32, 32]`
/// int8): 576 bytes per 16 features x 32 inputs.
#[pyfunction]
#[pyo3(name = "pack_quant_panels_q8_0")]
pub fn py_pack_quant_panels_q8_0<'py>(
    py: Python<'py>,
    scale: PyReadonlyArray2<'py, f32>,
    qs: PyReadonlyArray3<'py, i8>,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let [n, nb] = [scale.shape()[0], scale.shape()[1]];
    let w = q8_0_weight(&scale, &qs)?;
    pack_call(py, &w, n, nb, QUANT_PANELS)
}

/// `pack_quant_panels_q8_g16(scale, min, qs)`: the same for Q8G16 weights (the arrays
/// `linear_q8_g16_f32` reads): 768 bytes per 16 features x 32 inputs, or 640 where every
/// minimum is +0 (bit for bit: Q6_K's form), the panels of kind "q8_s16".
#[pyfunction]
#[pyo3(name = "pack_quant_panels_q8_g16")]
pub fn py_pack_quant_panels_q8_g16<'py>(
    py: Python<'py>,
    scale: PyReadonlyArray2<'py, f32>,
    min: PyReadonlyArray2<'py, f32>,
    qs: PyReadonlyArray3<'py, i8>,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let [n, nb] = [qs.shape()[0], qs.shape()[1]];
    let w = q8_g16_weight(&scale, &min, &qs)?;
    pack_call(py, &w, n, nb, QUANT_PANELS)
}

/// `linear_quant_panels_f32(x, panels, kind, bias, out, num_threads)`: `out[M, N] = x[M, K] @
/// W^T + bias` with `W` packed by `pack_quant_panels_q4_1` (`kind` "q4_1") /
/// `pack_quant_panels_q8_0` ("q8_0") / `pack_quant_panels_q8_g16` ("q8_g16", or "q8_s16" where
/// its minimums are all +0) / `pack_half_panels` ("bf16", "f16"); bit for bit what `linear_f32`
/// gives over the loader's float32 weights. Writes `out`; returns None.
#[pyfunction]
#[pyo3(name = "linear_quant_panels_f32", signature = (x, panels, kind, bias, out, num_threads))]
pub fn py_linear_quant_panels_f32(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    panels: PyReadonlyArray1<'_, u8>,
    kind: &str,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let format = panel_format(kind)?;
    let data = c_contiguous("panels", panels.is_c_contiguous(), panels.as_slice())?;
    let panels = QuantPanels { format, data };
    rows_call(py, x, None, bias, out, |m, n, k, x, bias, out| {
        linear_quant_panels_f32(
            &QuantPanelShape { m, n, k },
            x,
            panels,
            bias,
            out,
            num_threads,
        )
    })
}

/// `pack_half_panels(weight)`: a float32 `[N, K]` weight whose every value a 16-bit float holds
/// exactly (a bfloat16 or float16 checkpoint's) as `(kind, panels)`: `kind` "bf16" or "f16",
/// `panels` uint8 `ceil(N / 16) * K / 32 * 1024` for `linear_quant_panels_f32`
/// (`cpu_half_panels.rs`: half the float32 panels' bytes, the same output bit for bit); None
/// where neither holds every value, or `K` is not a multiple of 32.
#[pyfunction]
#[pyo3(name = "pack_half_panels")]
pub fn py_pack_half_panels<'py>(
    py: Python<'py>,
    weight: PyReadonlyArray2<'py, f32>,
) -> PyResult<Option<KindAndPanels<'py>>> {
    let [n, k] = [weight.shape()[0], weight.shape()[1]];
    let w = c_contiguous("weight", weight.is_c_contiguous(), weight.as_slice())?;
    if n == 0 || k == 0 || !k.is_multiple_of(crate::cpu_quant_linear::BLOCK) {
        return Ok(None);
    }
    let Some(format) = py.detach(|| cpu_half_panels::format_of(w)) else {
        return Ok(None);
    };
    let len = cpu_half_panels::packed_len(n, k).map_err(|e| PyValueError::new_err(e.0))?;
    let panels = aligned_64(py, len, |data| {
        cpu_half_panels::pack_into(w, n, k, format, data)
    })?;
    let kind = if format == PanelFormat::Bf16 {
        "bf16"
    } else {
        "f16"
    };
    Ok(Some((kind, panels)))
}

/// `pack_half_panels`' answer: the panels' kind and bytes.
type KindAndPanels<'py> = (&'static str, Bound<'py, PyArray1<u8>>);

/// A `len`-element array starting on a 64-byte boundary, filled by `fill` (GIL released).
fn aligned_64<'py, T: numpy::Element + Send + Copy + Default>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [T]) -> Result<(), KernelInputError> + Send,
) -> PyResult<Bound<'py, PyArray1<T>>> {
    let mut buffer = vec![T::default(); len + 64 / std::mem::size_of::<T>()];
    let skip = buffer.as_ptr().align_offset(64);
    py.detach(|| fill(&mut buffer[skip..skip + len]))
        .map_err(|e| PyValueError::new_err(e.0))?;
    let whole = buffer.into_pyarray(py);
    let aligned = whole.as_any().get_item(pyo3::types::PySlice::new(
        py,
        skip as isize,
        (skip + len) as isize,
        1,
    ))?;
    Ok(aligned.cast_into::<PyArray1<T>>()?)
}

/// The packed format of a block kind's panels.
fn panel_format(kind: &str) -> PyResult<PanelFormat> {
    match kind {
        "q4_1" => Ok(PanelFormat::Q4_1),
        "q8_0" => Ok(PanelFormat::Q8_0),
        "q8_g16" => Ok(PanelFormat::Q8G16),
        "q8_s16" => Ok(PanelFormat::Q8S16),
        "bf16" => Ok(PanelFormat::Bf16),
        "f16" => Ok(PanelFormat::F16),
        _ => Err(PyValueError::new_err(format!(
            "quantized panels are packed from 'q4_1', 'q8_0' or 'q8_g16' blocks ('q8_s16': \
             q8_g16 blocks whose minimums are all +0), or 16-bit float weights ('bf16', \
             'f16'), not {kind:?}"
        ))),
    }
}

/// The packed format of a block kind's AMX tiles ("q4_1": nibbles, "q8_0": int8).
pub(crate) fn amx_format(kind: &str) -> PyResult<AmxFormat> {
    match kind {
        "q4_1" => Ok(AmxFormat::Nibbles),
        "q8_0" => Ok(AmxFormat::Int8),
        _ => Err(PyValueError::new_err(format!(
            "AMX tiles are packed from 'q4_1' or 'q8_0' blocks, not {kind:?}"
        ))),
    }
}

/// `rms_norm_f32(x, weight, eps, out)`: each row of `x` `[M, H]` divided by its root mean square
/// (plus `eps`) times `weight` `[H]`, into `out` `[M, H]`. float32, C-contiguous.
#[pyfunction]
#[pyo3(name = "rms_norm_f32")]
pub fn py_rms_norm_f32(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight: PyReadonlyArray1<'_, f32>,
    eps: f32,
    mut out: PyReadwriteArray2<'_, f32>,
) -> PyResult<()> {
    if out.shape() != x.shape() || x.shape()[1] != weight.shape()[0] {
        return Err(PyValueError::new_err(format!(
            "rms_norm: x {:?}, weight {:?} and out {:?} do not match",
            x.shape(),
            weight.shape(),
            out.shape()
        )));
    }
    let x = c_contiguous("x", x.is_c_contiguous(), x.as_slice())?;
    let weight = c_contiguous("weight", weight.is_c_contiguous(), weight.as_slice())?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    py.detach(|| rms_norm_f32(x, weight, eps, out))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// `rotary_f32(x, cos, sin)`: rotate-half RoPE of `x` `[T, heads, D]` in place, with `cos` /
/// `sin` `[T, D]`. float32, C-contiguous.
#[pyfunction]
#[pyo3(name = "rotary_f32")]
pub fn py_rotary_f32(
    py: Python<'_>,
    mut x: PyReadwriteArray3<'_, f32>,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
) -> PyResult<()> {
    let (tokens, head_dim) = (x.shape()[0], x.shape()[2]);
    if cos.shape() != [tokens, head_dim] || sin.shape() != cos.shape() {
        return Err(PyValueError::new_err(format!(
            "rotary: cos {:?} and sin {:?} must be [T, D] for x {:?}",
            cos.shape(),
            sin.shape(),
            x.shape()
        )));
    }
    let cos = c_contiguous("cos", cos.is_c_contiguous(), cos.as_slice())?;
    let sin = c_contiguous("sin", sin.is_c_contiguous(), sin.as_slice())?;
    let x_c = x.is_c_contiguous();
    let x = c_contiguous("x", x_c, x.as_slice_mut())?;
    py.detach(|| rotary_f32(x, head_dim, cos, sin))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// `linear_isa()`: the instruction set the linear kernels use on this CPU (`"avx512"`,
/// `"avx2"` or `"portable"`, at most what `FERROBATCH_CPU_ISA` allows).
#[pyfunction]
#[pyo3(name = "linear_isa")]
pub fn py_linear_isa() -> &'static str {
    crate::cpu_isa::Isa::detect(crate::cpu_isa::Isa::Avx512).name()
}

/// `one_row_int16_available()`: whether one row of x against GGUF Q4_1 blocks takes the int16
/// dot-product kernel here (AVX-512 VNNI, at most what `FERROBATCH_CPU_ISA` allows;
/// `cpu_q4_1_one_row`).
#[pyfunction]
#[pyo3(name = "one_row_int16_available")]
pub fn py_one_row_int16_available() -> bool {
    crate::cpu_q4_1_one_row::available()
}

/// `quant_panels_min_rows()`: the fewest rows of a step that read a GGUF layer's quantized
/// panels rather than its blocks on this CPU (without AMX): 4 on AVX2, 6 elsewhere
/// (`cpu_quant_panels::min_rows`).
#[pyfunction]
#[pyo3(name = "quant_panels_min_rows")]
pub fn py_quant_panels_min_rows() -> usize {
    crate::cpu_quant_panels::min_rows()
}
