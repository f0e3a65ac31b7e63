//! PyO3 bindings of the CPU attention kernels (`cpu_attention`: decode rows,
//! `cpu_prefill_attention`: prefill chunks): numpy views of torch CPU tensors in, results written
//! into `out` in place, GIL released while they run.
//!
//! Every shape or index problem is a `ValueError` (checked by the kernels' `validate` before any
//! read); arrays must be C-contiguous float32 / int32, the caches float32, float16, uint8
//! (FP8 E4M3 bytes, `cpu_kv_fp8`: torch's float8_e4m3fn viewed as uint8) or int8 (`cpu_kv_q8`:
//! each head row's bytes then its f32 scale's four, so the last dimension is `D + 4`), both
//! alike (`cpu_kv`).

use crate::cpu_attention::{paged_decode_attention_f32, DecodeShape};
use crate::cpu_kv::f16;
use crate::cpu_kv::KvElement;
use crate::cpu_kv_fp8::{as_fp8, F8E4M3};
use crate::cpu_kv_q8::{as_q8, Q8};
use crate::cpu_prefill_attention::{paged_prefill_attention_f32, PrefillShape};
use crate::py_linear::c_contiguous;
use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn, PyReadwriteArrayDyn,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pub(crate) fn dims<const N: usize>(name: &str, shape: &[usize]) -> PyResult<[usize; N]> {
    shape.try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must have {N} dimensions, got shape {shape:?}"
        ))
    })
}

/// The array's elements in C order; `ValueError` unless it is C-contiguous (a Fortran-ordered
/// array would also give a slice, in the wrong order).
pub(crate) fn c_slice<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    name: &str,
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
) -> PyResult<&'a [T]> {
    let not_c = || PyValueError::new_err(format!("{name} must be C-contiguous"));
    if !a.is_c_contiguous() {
        return Err(not_c());
    }
    a.as_slice().map_err(|_| not_c())
}

/// The K and V caches a kernel reads: numpy arrays of one element type the kernels take.
pub(crate) enum KvArrays<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>, PyReadonlyArrayDyn<'py, f32>),
    F16(PyReadonlyArrayDyn<'py, f16>, PyReadonlyArrayDyn<'py, f16>),
    /// FP8 E4M3 bytes
    Fp8(PyReadonlyArrayDyn<'py, u8>, PyReadonlyArrayDyn<'py, u8>),
    /// int8 head rows with their scales
    Q8(PyReadonlyArrayDyn<'py, i8>, PyReadonlyArrayDyn<'py, i8>),
}

/// [`KvArrays`] as C-ordered slices.
pub(crate) enum KvSlices<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [f16], &'a [f16]),
    Fp8(&'a [F8E4M3], &'a [F8E4M3]),
    Q8(&'a [Q8], &'a [Q8]),
}

/// Evaluates `$body` with `$k` / `$v` bound to the slices of a [`KvSlices`], whichever their
/// element type (the body is compiled once per type).
macro_rules! with_kv_slices {
    ($kv:expr, |$k:ident, $v:ident| $body:expr) => {
        match $kv {
            KvSlices::F32($k, $v) => $body,
            KvSlices::F16($k, $v) => $body,
            KvSlices::Fp8($k, $v) => $body,
            KvSlices::Q8($k, $v) => $body,
        }
    };
}

impl<'py> KvArrays<'py> {
    fn extract(k_cache: &Bound<'py, PyAny>, v_cache: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let (Ok(k), Ok(v)) = (k_cache.extract(), v_cache.extract()) {
            return Ok(KvArrays::F32(k, v));
        }
        if let (Ok(k), Ok(v)) = (k_cache.extract(), v_cache.extract()) {
            return Ok(KvArrays::F16(k, v));
        }
        if let (Ok(k), Ok(v)) = (k_cache.extract(), v_cache.extract()) {
            return Ok(KvArrays::Fp8(k, v));
        }
        if let (Ok(k), Ok(v)) = (k_cache.extract(), v_cache.extract()) {
            return Ok(KvArrays::Q8(k, v));
        }
        Err(PyValueError::new_err(
            "k_cache and v_cache must be numpy arrays, both float32, both float16, both uint8 \
             (FP8 E4M3 bytes) or both int8 (head rows with their scales)",
        ))
    }

    fn shapes(&self) -> (&[usize], &[usize]) {
        match self {
            KvArrays::F32(k, v) => (k.shape(), v.shape()),
            KvArrays::F16(k, v) => (k.shape(), v.shape()),
            KvArrays::Fp8(k, v) => (k.shape(), v.shape()),
            KvArrays::Q8(k, v) => (k.shape(), v.shape()),
        }
    }

    /// Elements after each head's values in a cache row (`cpu_kv`'s `ROW_EXTRA`).
    fn row_extra(&self) -> usize {
        match self {
            KvArrays::Q8(..) => Q8::ROW_EXTRA,
            _ => 0,
        }
    }

    fn slices(&self) -> PyResult<KvSlices<'_>> {
        Ok(match self {
            KvArrays::F32(k, v) => KvSlices::F32(c_slice("k_cache", k)?, c_slice("v_cache", v)?),
            KvArrays::F16(k, v) => KvSlices::F16(c_slice("k_cache", k)?, c_slice("v_cache", v)?),
            KvArrays::Fp8(k, v) => KvSlices::Fp8(
                as_fp8(c_slice("k_cache", k)?),
                as_fp8(c_slice("v_cache", v)?),
            ),
            KvArrays::Q8(k, v) => {
                KvSlices::Q8(as_q8(c_slice("k_cache", k)?), as_q8(c_slice("v_cache", v)?))
            }
        })
    }
}

/// `paged_decode_attention_f32(q, k_cache, v_cache, block_tables, ctx_lens, out, scale,
/// num_threads, starts=None)`: q/out `[S, Hq, D]` float32, caches `[num_blocks, block_size, Hkv,
/// D]` float32, float16 or uint8 (FP8 E4M3 bytes), or `[.., D + 4]` int8 (head rows with their
/// scales), block_tables `[S, max_blocks]` / ctx_lens `[S]` int32. `starts`, an optional `[S]`
/// int32 array, gives each row a sliding window: row `s` attends keys `starts[s]..ctx_lens[s]`
/// only (`0 <= starts[s] < ctx_lens[s]`, else `ValueError`); None attends all keys. Writes
/// `out`; returns None.
#[pyfunction]
#[pyo3(name = "paged_decode_attention_f32")]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, ctx_lens, out, scale, num_threads,
                    starts=None))]
#[allow(clippy::too_many_arguments)]
pub fn py_paged_decode_attention_f32(
    py: Python<'_>,
    q: PyReadonlyArrayDyn<'_, f32>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArray2<'_, i32>,
    ctx_lens: PyReadonlyArray1<'_, i32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    scale: f32,
    num_threads: usize,
    starts: Option<PyReadonlyArray1<'_, i32>>,
) -> PyResult<()> {
    let [num_seqs, num_heads, head_dim] = dims::<3>("q", q.shape())?;
    let kv = KvArrays::extract(k_cache, v_cache)?;
    let [num_blocks, block_size, num_kv_heads, _] = cache_dims(&kv, head_dim)?;
    if out.shape() != q.shape() {
        return Err(PyValueError::new_err("out must have q's shape"));
    }
    let [bt_rows, max_blocks_per_seq] = dims::<2>("block_tables", block_tables.shape())?;
    if bt_rows != num_seqs {
        return Err(PyValueError::new_err(
            "block_tables needs one row per sequence",
        ));
    }
    let shape = DecodeShape {
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        max_blocks_per_seq,
    };
    let q = c_slice("q", &q)?;
    let kv = kv.slices()?;
    let bt = c_slice("block_tables", &block_tables)?;
    let ctx = c_slice("ctx_lens", &ctx_lens)?;
    let starts = starts
        .as_ref()
        .map(|starts| c_slice("starts", starts))
        .transpose()?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    py.detach(|| {
        with_kv_slices!(kv, |k, v| paged_decode_attention_f32(
            &shape,
            q,
            k,
            v,
            bt,
            ctx,
            starts,
            out,
            scale,
            num_threads
        ))
    })
    .map_err(|e| PyValueError::new_err(e.0))
}

/// The caches' `[num_blocks, block_size, Hkv, D (+ 4, int8)]` after checking that V matches K
/// and that `D` is q's `head_dim`.
fn cache_dims(kv: &KvArrays<'_>, head_dim: usize) -> PyResult<[usize; 4]> {
    let (k_shape, v_shape) = kv.shapes();
    let dims4 = dims::<4>("k_cache", k_shape)?;
    if v_shape != k_shape {
        return Err(PyValueError::new_err("v_cache must have k_cache's shape"));
    }
    let extra = kv.row_extra();
    if dims4[3] != head_dim + extra {
        let cache_head_dim = dims4[3] as i64 - extra as i64;
        return Err(PyValueError::new_err(format!(
            "head_dim of q ({head_dim}) and of the cache ({cache_head_dim}) differ"
        )));
    }
    Ok(dims4)
}

/// `paged_prefill_attention_f32(q, k_cache, v_cache, block_tables, q_starts, q_lens, seq_lens,
/// out, scale, num_threads, amx=True, window=None)`: q/out `[T, Hq, D]` float32, caches `[num_blocks,
/// block_size, Hkv, D]` float32, float16 or uint8 (FP8 E4M3), or `[.., D + 4]` int8; per
/// sequence `block_tables`
/// `[S, max_blocks]` and `q_starts` / `q_lens` / `seq_lens` `[S]` int32. Writes the sequences'
/// rows of `out`; returns None. `amx=False` keeps the kernel off its AMX path; `window`: each
/// query attends its last `window` positions only (a sliding-window layer).
#[pyfunction]
#[pyo3(name = "paged_prefill_attention_f32")]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, q_starts, q_lens, seq_lens, out, scale,
                    num_threads, amx=true, window=None))]
#[allow(clippy::too_many_arguments)]
pub fn py_paged_prefill_attention_f32(
    py: Python<'_>,
    q: PyReadonlyArrayDyn<'_, f32>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: PyReadonlyArray2<'_, i32>,
    q_starts: PyReadonlyArray1<'_, i32>,
    q_lens: PyReadonlyArray1<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    scale: f32,
    num_threads: usize,
    amx: bool,
    window: Option<usize>,
) -> PyResult<()> {
    let [num_tokens, num_heads, head_dim] = dims::<3>("q", q.shape())?;
    let kv = KvArrays::extract(k_cache, v_cache)?;
    let [num_blocks, block_size, num_kv_heads, _] = cache_dims(&kv, head_dim)?;
    if out.shape() != q.shape() {
        return Err(PyValueError::new_err("out must have q's shape"));
    }
    let [num_seqs, max_blocks_per_seq] = dims::<2>("block_tables", block_tables.shape())?;
    let shape = PrefillShape {
        num_tokens,
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        max_blocks_per_seq,
    };
    let q = c_slice("q", &q)?;
    let kv = kv.slices()?;
    let bt = c_slice("block_tables", &block_tables)?;
    let starts = c_slice("q_starts", &q_starts)?;
    let lens = c_slice("q_lens", &q_lens)?;
    let ctx = c_slice("seq_lens", &seq_lens)?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    py.detach(|| {
        with_kv_slices!(kv, |k, v| paged_prefill_attention_f32(
            &shape,
            q,
            k,
            v,
            bt,
            starts,
            lens,
            ctx,
            out,
            scale,
            num_threads,
            amx,
            window
        ))
    })
    .map_err(|e| PyValueError::new_err(e.0))
}
