//! PyO3 bindings of the CPU attention kernels (`cpu_attention`: decode rows,
//! `cpu_prefill_attention`: prefill chunks): numpy views of torch CPU tensors in, results written
//! into `out` in place, GIL released while they run.
//!
//! Every shape or index problem is a `ValueError` (checked by the kernels' `validate` before any
//! read); arrays must be C-contiguous float32 / int32.

use crate::cpu_attention::{paged_decode_attention_f32, DecodeShape};
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

/// `paged_decode_attention_f32(q, k_cache, v_cache, block_tables, ctx_lens, out, scale,
/// num_threads)`: q/out `[S, Hq, D]`, caches `[num_blocks, block_size, Hkv, D]` float32,
/// block_tables `[S, max_blocks]` / ctx_lens `[S]` int32. Writes `out`; returns None.
#[pyfunction]
#[pyo3(name = "paged_decode_attention_f32")]
#[allow(clippy::too_many_arguments)]
pub fn py_paged_decode_attention_f32(
    py: Python<'_>,
    q: PyReadonlyArrayDyn<'_, f32>,
    k_cache: PyReadonlyArrayDyn<'_, f32>,
    v_cache: PyReadonlyArrayDyn<'_, f32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    ctx_lens: PyReadonlyArray1<'_, i32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    scale: f32,
    num_threads: usize,
) -> PyResult<()> {
    let [num_seqs, num_heads, head_dim] = dims::<3>("q", q.shape())?;
    let [num_blocks, block_size, num_kv_heads, _] = cache_dims(&k_cache, &v_cache, head_dim)?;
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
    let k = c_slice("k_cache", &k_cache)?;
    let v = c_slice("v_cache", &v_cache)?;
    let bt = c_slice("block_tables", &block_tables)?;
    let ctx = c_slice("ctx_lens", &ctx_lens)?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    py.detach(|| paged_decode_attention_f32(&shape, q, k, v, bt, ctx, out, scale, num_threads))
        .map_err(|e| PyValueError::new_err(e.0))
}

/// The caches' `[num_blocks, block_size, Hkv, D]` after checking that V matches K and that `D`
/// is q's `head_dim`.
fn cache_dims(
    k_cache: &PyReadonlyArrayDyn<'_, f32>,
    v_cache: &PyReadonlyArrayDyn<'_, f32>,
    head_dim: usize,
) -> PyResult<[usize; 4]> {
    let dims4 = dims::<4>("k_cache", k_cache.shape())?;
    if v_cache.shape() != k_cache.shape() {
        return Err(PyValueError::new_err("v_cache must have k_cache's shape"));
    }
    if dims4[3] != head_dim {
        return Err(PyValueError::new_err(format!(
            "head_dim of q ({head_dim}) and of the cache ({}) differ",
            dims4[3]
        )));
    }
    Ok(dims4)
}

/// `paged_prefill_attention_f32(q, k_cache, v_cache, block_tables, q_starts, q_lens, seq_lens,
/// out, scale, num_threads)`: q/out `[T, Hq, D]`, caches `[num_blocks, block_size, Hkv, D]`
/// float32; per sequence `block_tables` `[S, max_blocks]` and `q_starts` / `q_lens` / `seq_lens`
/// `[S]` int32. Writes the sequences' rows of `out`; returns None.
#[pyfunction]
#[pyo3(name = "paged_prefill_attention_f32")]
#[allow(clippy::too_many_arguments)]
pub fn py_paged_prefill_attention_f32(
    py: Python<'_>,
    q: PyReadonlyArrayDyn<'_, f32>,
    k_cache: PyReadonlyArrayDyn<'_, f32>,
    v_cache: PyReadonlyArrayDyn<'_, f32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    q_starts: PyReadonlyArray1<'_, i32>,
    q_lens: PyReadonlyArray1<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    scale: f32,
    num_threads: usize,
) -> PyResult<()> {
    let [num_tokens, num_heads, head_dim] = dims::<3>("q", q.shape())?;
    let [num_blocks, block_size, num_kv_heads, _] = cache_dims(&k_cache, &v_cache, head_dim)?;
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
    let k = c_slice("k_cache", &k_cache)?;
    let v = c_slice("v_cache", &v_cache)?;
    let bt = c_slice("block_tables", &block_tables)?;
    let starts = c_slice("q_starts", &q_starts)?;
    let lens = c_slice("q_lens", &q_lens)?;
    let ctx = c_slice("seq_lens", &seq_lens)?;
    let out_c = out.is_c_contiguous();
    let out = c_contiguous("out", out_c, out.as_slice_mut())?;
    py.detach(|| {
        paged_prefill_attention_f32(
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
        )
    })
    .map_err(|e| PyValueError::new_err(e.0))
}
