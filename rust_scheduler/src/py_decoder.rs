//! PyO3 binding of the fused CPU decode step (`cpu_decoder`): `CpuDecoderStack` holds the
//! model's per-layer weight arrays (numpy views of the torch tensors, kept alive, never copied)
//! and runs a step through all layers in one call, GIL released.
//!
//! Every problem with the arrays (dtype, layout, shape) is a `ValueError`, raised before
//! anything is written: weights are checked when the stack is built (and their shapes again by
//! `cpu_decoder::validate` on every call), the step's buffers by `cpu_decoder::validate`.
//!
//! The weights are viewed once, when the stack is built: their slices point into numpy
//! buffers the stack holds references to, so they stay valid for its life (a numpy array
//! never moves its data while other references to it exist), and the stack's contract is that
//! nobody writes them meanwhile. Borrowing ~660 arrays through rust-numpy's borrow checker on
//! every call instead cost ~0.33 ms per step (3-4 % of a one-row SmolLM2 step).

use crate::cpu_amx_linear::{AmxFormat, AmxTiles};
use crate::cpu_decoder::{
    forward_step, CacheShape, DecoderShape, Layer, Linear, PrefillChunks, StepRows,
};
use crate::cpu_elementwise::GateActivation;
use crate::cpu_kv::f16;
use crate::cpu_kv::KvElement;
use crate::cpu_kv_fp8::{as_fp8_mut, F8E4M3};
use crate::cpu_kv_q8::{as_q8_mut, Q8};
use crate::cpu_lora::{LoraLayer, LoraWeights, StepLora};
use crate::cpu_quant_linear::QuantWeight;
use crate::cpu_quant_panels::{PanelFormat, QuantPanels};
use crate::py_attention::{c_slice, dims};
use numpy::{
    Element, PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn,
    PyReadwriteArray2, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

type F32Array = Py<PyArrayDyn<f32>>;

/// One KV cache array per layer, all of one element type the kernels take (`cpu_kv`).
enum LayerCaches<'py> {
    F32(Vec<Bound<'py, PyArrayDyn<f32>>>),
    F16(Vec<Bound<'py, PyArrayDyn<f16>>>),
    /// FP8 E4M3 bytes (`cpu_kv_fp8`)
    Fp8(Vec<Bound<'py, PyArrayDyn<u8>>>),
    /// int8 head rows with their scales (`cpu_kv_q8`)
    Q8(Vec<Bound<'py, PyArrayDyn<i8>>>),
}

impl<'py> LayerCaches<'py> {
    fn extract(caches: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(list) = caches.extract() {
            return Ok(LayerCaches::F32(list));
        }
        if let Ok(list) = caches.extract() {
            return Ok(LayerCaches::F16(list));
        }
        if let Ok(list) = caches.extract() {
            return Ok(LayerCaches::Fp8(list));
        }
        if let Ok(list) = caches.extract() {
            return Ok(LayerCaches::Q8(list));
        }
        Err(PyValueError::new_err(
            "caches must be a list of numpy arrays, all float32, all float16, all uint8 (FP8 \
             E4M3 bytes) or all int8 (head rows with their scales)",
        ))
    }

    fn first_shape(&self) -> Vec<usize> {
        match self {
            LayerCaches::F32(list) => list.first().map(|c| c.shape().to_vec()),
            LayerCaches::F16(list) => list.first().map(|c| c.shape().to_vec()),
            LayerCaches::Fp8(list) => list.first().map(|c| c.shape().to_vec()),
            LayerCaches::Q8(list) => list.first().map(|c| c.shape().to_vec()),
        }
        .unwrap_or_default()
    }

    /// Elements after each head's values in a cache row (`cpu_kv`'s `ROW_EXTRA`).
    fn row_extra(&self) -> usize {
        match self {
            LayerCaches::Q8(_) => Q8::ROW_EXTRA,
            _ => 0,
        }
    }
}

/// Write access to every layer's cache (`ValueError` if one is already borrowed).
fn borrow_caches<'py, E: Element>(
    caches: &[Bound<'py, PyArrayDyn<E>>],
) -> PyResult<Vec<PyReadwriteArrayDyn<'py, E>>> {
    caches
        .iter()
        .map(|c| c.try_readwrite())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PyValueError::new_err(format!("caches: {e}")))
}

/// The borrowed caches as C-ordered slices (`ValueError` for one that is not C-contiguous).
fn cache_slices<'a, E: Element>(
    guards: &'a mut [PyReadwriteArrayDyn<'_, E>],
) -> PyResult<Vec<&'a mut [E]>> {
    let mut views = Vec::with_capacity(guards.len());
    for (i, g) in guards.iter_mut().enumerate() {
        let not_c = || PyValueError::new_err(format!("caches[{i}] must be C-contiguous"));
        if !g.is_c_contiguous() {
            return Err(not_c());
        }
        views.push(g.as_slice_mut().map_err(|_| not_c())?);
    }
    Ok(views)
}

/// A linear layer's arrays: `(n, k, panels, bias | None, blocks | None[, tiles | None[,
/// qpanels | None]])` from Python, blocks `("q4_1", scale, min, qs)`, `("q8_0", scale, qs)` or
/// `("q8_g16", scale, min, qs)`
/// (the `linear_q*_f32` kernels' arrays), or the kind alone (`("q8_g16",)`: quantized panels
/// kept without their blocks; `("q8_s16",)` for those packed from blocks whose minimums are all
/// +0; `("bf16",)` / `("f16",)` for 16-bit float panels, `pack_half_panels`'), tiles the same
/// blocks as `pack_amx_q*` packs them, qpanels as `pack_quant_panels_q*` packs them.
struct LinearArrays {
    n: usize,
    k: usize,
    panels: F32Array,
    bias: Option<F32Array>,
    blocks: Option<BlockArrays>,
    tiles: Option<Py<PyArrayDyn<u16>>>,
    qpanels: Option<Py<PyArrayDyn<u8>>>,
}

enum BlockArrays {
    Q4_1 {
        scale: F32Array,
        min: F32Array,
        qs: Py<PyArrayDyn<u8>>,
    },
    Q8_0 {
        scale: F32Array,
        qs: Py<PyArrayDyn<i8>>,
    },
    Q8G16 {
        scale: F32Array,
        min: F32Array,
        qs: Py<PyArrayDyn<i8>>,
    },
    /// no blocks: the quantized panels or the AMX tiles alone, of this kind
    PanelsAlone(PanelFormat),
}

impl LinearArrays {
    fn extract(spec: &Bound<'_, PyAny>) -> PyResult<LinearArrays> {
        let spec = spec.cast::<PyTuple>()?;
        let len = spec.len();
        if !(5..=7).contains(&len) {
            return Err(PyValueError::new_err(format!(
                "a linear layer is (n, k, panels, bias, blocks[, tiles[, qpanels]]), got {len} \
                 items"
            )));
        }
        let tiles: Option<Py<PyArrayDyn<u16>>> = match len {
            5 => None,
            _ => spec.get_item(5)?.extract()?,
        };
        let qpanels: Option<Py<PyArrayDyn<u8>>> = match len {
            7 => spec.get_item(6)?.extract()?,
            _ => None,
        };
        let (n, k, panels, bias, blocks): (
            usize,
            usize,
            F32Array,
            Option<F32Array>,
            Option<Bound<'_, PyTuple>>,
        ) = spec.get_slice(0, 5).extract()?;
        let blocks = match blocks {
            None => None,
            Some(t) => {
                let kind: String = t.get_item(0)?.extract()?;
                match (kind.as_str(), t.len()) {
                    ("q4_1", 4) => Some(BlockArrays::Q4_1 {
                        scale: t.get_item(1)?.extract()?,
                        min: t.get_item(2)?.extract()?,
                        qs: t.get_item(3)?.extract()?,
                    }),
                    ("q8_0", 3) => Some(BlockArrays::Q8_0 {
                        scale: t.get_item(1)?.extract()?,
                        qs: t.get_item(2)?.extract()?,
                    }),
                    ("q8_g16", 4) => Some(BlockArrays::Q8G16 {
                        scale: t.get_item(1)?.extract()?,
                        min: t.get_item(2)?.extract()?,
                        qs: t.get_item(3)?.extract()?,
                    }),
                    ("q4_1", 1) => Some(BlockArrays::PanelsAlone(PanelFormat::Q4_1)),
                    ("q8_0", 1) => Some(BlockArrays::PanelsAlone(PanelFormat::Q8_0)),
                    ("q8_g16", 1) => Some(BlockArrays::PanelsAlone(PanelFormat::Q8G16)),
                    ("q8_s16", 1) => Some(BlockArrays::PanelsAlone(PanelFormat::Q8S16)),
                    ("bf16", 1) => Some(BlockArrays::PanelsAlone(PanelFormat::Bf16)),
                    ("f16", 1) => Some(BlockArrays::PanelsAlone(PanelFormat::F16)),
                    _ => {
                        return Err(PyValueError::new_err(format!(
                            "blocks must be ('q4_1', scale, min, qs), ('q8_0', scale, qs), \
                             ('q8_g16', scale, min, qs) or a kind alone (quantized panels or AMX \
                             tiles without blocks; 'q8_s16': Q8G16 panels without minimums; \
                             'bf16' / 'f16': 16-bit float panels), got \
                             {kind:?} with {} items",
                            t.len()
                        )))
                    }
                }
            }
        };
        Ok(LinearArrays {
            n,
            k,
            panels,
            bias,
            blocks,
            tiles,
            qpanels,
        })
    }

    fn borrow<'py>(&self, py: Python<'py>) -> LinearBorrow<'py> {
        LinearBorrow {
            n: self.n,
            k: self.k,
            panels: self.panels.bind(py).readonly(),
            bias: self.bias.as_ref().map(|b| b.bind(py).readonly()),
            blocks: self.blocks.as_ref().map(|b| match b {
                BlockArrays::Q4_1 { scale, min, qs } => BlockBorrow::Q4_1(
                    scale.bind(py).readonly(),
                    min.bind(py).readonly(),
                    qs.bind(py).readonly(),
                ),
                BlockArrays::Q8_0 { scale, qs } => {
                    BlockBorrow::Q8_0(scale.bind(py).readonly(), qs.bind(py).readonly())
                }
                BlockArrays::Q8G16 { scale, min, qs } => BlockBorrow::Q8G16(
                    scale.bind(py).readonly(),
                    min.bind(py).readonly(),
                    qs.bind(py).readonly(),
                ),
                BlockArrays::PanelsAlone(format) => BlockBorrow::PanelsAlone(*format),
            }),
            tiles: self.tiles.as_ref().map(|t| t.bind(py).readonly()),
            qpanels: self.qpanels.as_ref().map(|t| t.bind(py).readonly()),
        }
    }
}

/// Shared borrows of one linear layer's arrays, held for the duration of a call.
struct LinearBorrow<'py> {
    n: usize,
    k: usize,
    panels: PyReadonlyArrayDyn<'py, f32>,
    bias: Option<PyReadonlyArrayDyn<'py, f32>>,
    blocks: Option<BlockBorrow<'py>>,
    tiles: Option<PyReadonlyArrayDyn<'py, u16>>,
    qpanels: Option<PyReadonlyArrayDyn<'py, u8>>,
}

enum BlockBorrow<'py> {
    Q4_1(
        PyReadonlyArrayDyn<'py, f32>,
        PyReadonlyArrayDyn<'py, f32>,
        PyReadonlyArrayDyn<'py, u8>,
    ),
    Q8_0(PyReadonlyArrayDyn<'py, f32>, PyReadonlyArrayDyn<'py, i8>),
    Q8G16(
        PyReadonlyArrayDyn<'py, f32>,
        PyReadonlyArrayDyn<'py, f32>,
        PyReadonlyArrayDyn<'py, i8>,
    ),
    PanelsAlone(PanelFormat),
}

impl LinearBorrow<'_> {
    fn view(&self) -> PyResult<Linear<'_>> {
        let blocks = match &self.blocks {
            None | Some(BlockBorrow::PanelsAlone(_)) => None,
            Some(BlockBorrow::Q4_1(scale, min, qs)) => Some(QuantWeight::Q4_1 {
                scale: c_slice("scale", scale)?,
                min: c_slice("min", min)?,
                qs: c_slice("qs", qs)?,
            }),
            Some(BlockBorrow::Q8_0(scale, qs)) => Some(QuantWeight::Q8_0 {
                scale: c_slice("scale", scale)?,
                qs: c_slice("qs", qs)?,
            }),
            Some(BlockBorrow::Q8G16(scale, min, qs)) => Some(QuantWeight::Q8G16 {
                scale: c_slice("scale", scale)?,
                min: c_slice("min", min)?,
                qs: c_slice("qs", qs)?,
            }),
        };
        Ok(Linear {
            n: self.n,
            k: self.k,
            panels: c_slice("panels", &self.panels)?,
            bias: match &self.bias {
                Some(b) => c_slice("bias", b)?,
                None => &[],
            },
            blocks,
            tiles: match (&self.tiles, &self.blocks) {
                (None, _) => None,
                (Some(t), Some(b)) => Some(AmxTiles {
                    format: match b {
                        BlockBorrow::Q4_1(..) => AmxFormat::Nibbles,
                        BlockBorrow::Q8_0(..) => AmxFormat::Int8,
                        BlockBorrow::Q8G16(..) => {
                            return Err(PyValueError::new_err("q8_g16 blocks have no AMX tiles"))
                        }
                        BlockBorrow::PanelsAlone(PanelFormat::Q4_1) => AmxFormat::Nibbles,
                        BlockBorrow::PanelsAlone(PanelFormat::Q8_0) => AmxFormat::Int8,
                        BlockBorrow::PanelsAlone(PanelFormat::Q8G16 | PanelFormat::Q8S16) => {
                            return Err(PyValueError::new_err("q8_g16 weights have no AMX tiles"))
                        }
                        BlockBorrow::PanelsAlone(PanelFormat::Bf16 | PanelFormat::F16) => {
                            return Err(PyValueError::new_err(
                                "16-bit float panels have no AMX tiles",
                            ))
                        }
                    },
                    data: c_slice("tiles", t)?,
                }),
                (Some(_), None) => {
                    return Err(PyValueError::new_err(
                        "AMX tiles come with the blocks they were packed from",
                    ))
                }
            },
            qpanels: match (&self.qpanels, &self.blocks) {
                (None, _) => None,
                (Some(t), Some(b)) => Some(QuantPanels {
                    // the blocks' own format (Q8G16 blocks without minimums pack as Q8S16)
                    format: match (b, &blocks) {
                        (BlockBorrow::PanelsAlone(format), _) => *format,
                        (_, Some(w)) => PanelFormat::of(w).expect("every block format has panels"),
                        (_, None) => unreachable!("blocks are viewed unless the panels are alone"),
                    },
                    data: c_slice("qpanels", t)?,
                }),
                (Some(_), None) => {
                    return Err(PyValueError::new_err(
                        "quantized panels come with the blocks they were packed from",
                    ))
                }
            },
        })
    }
}

struct LayerArrays {
    input_norm: F32Array,
    post_norm: F32Array,
    /// Qwen3's per-head q / k norms, when the layer has them
    head_norms: Option<(F32Array, F32Array)>,
    /// Gemma 3's attention and MLP output norms, when the layer has them
    output_norms: Option<(F32Array, F32Array)>,
    /// qkv, o_proj, gate_up, down
    linears: [LinearArrays; 4],
}

struct LayerBorrow<'py> {
    input_norm: PyReadonlyArrayDyn<'py, f32>,
    post_norm: PyReadonlyArrayDyn<'py, f32>,
    head_norms: Option<(PyReadonlyArrayDyn<'py, f32>, PyReadonlyArrayDyn<'py, f32>)>,
    output_norms: Option<(PyReadonlyArrayDyn<'py, f32>, PyReadonlyArrayDyn<'py, f32>)>,
    linears: [LinearBorrow<'py>; 4],
}

impl LayerBorrow<'_> {
    fn view(&self) -> PyResult<Layer<'_>> {
        let [qkv, o_proj, gate_up, down] = &self.linears;
        let (q_norm, k_norm) = match &self.head_norms {
            Some((q, k)) => (c_slice("q_norm", q)?, c_slice("k_norm", k)?),
            None => (&[][..], &[][..]),
        };
        let (attn_out_norm, mlp_out_norm) = match &self.output_norms {
            Some((a, m)) => (c_slice("attn_out_norm", a)?, c_slice("mlp_out_norm", m)?),
            None => (&[][..], &[][..]),
        };
        Ok(Layer {
            input_norm: c_slice("input_norm", &self.input_norm)?,
            qkv: qkv.view()?,
            o_proj: o_proj.view()?,
            post_norm: c_slice("post_norm", &self.post_norm)?,
            gate_up: gate_up.view()?,
            down: down.view()?,
            q_norm,
            k_norm,
            rope: true,
            attn_out_norm,
            mlp_out_norm,
            window: None,
            local_rope: false,
        })
    }
}

/// `CpuDecoderStack(hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale,
/// layers, nope_layers=[], activation="silu", windows=None, local_rope_layers=[])`: a
/// Llama-family model's decoder layers for fused CPU decode steps (the layers `nope_layers`
/// names take no RoPE: SmolLM3; Gemma 3: `activation="gelu_tanh"`, `windows` one sliding
/// window or None per layer, `local_rope_layers` rotating with `forward`'s `local_cos` /
/// `local_sin`). `layers[i]` is `(input_norm, qkv, o_proj, post_norm, gate_up, down[, q_norm,
/// k_norm[, attn_out_norm, mlp_out_norm]])`, norms float32 `[hidden]` (Qwen3's per-head
/// `q_norm` / `k_norm`: `[head_dim]`; Gemma 3's output norms), each linear
/// `(n, k, panels, bias | None, blocks | None[, tiles | None])` with `panels` as `linear_f32`
/// reads them, `blocks` `("q4_1", scale, min, qs)` / `("q8_0", scale, qs)` as `linear_q*_f32`
/// read them and `tiles` as `linear_amx_f32` reads them.
/// The arrays are referenced, not copied, and must not be written while the stack lives.
#[pyclass(name = "CpuDecoderStack", module = "ferrobatch._scheduler", frozen)]
pub struct PyCpuDecoderStack {
    shape: DecoderShape,
    /// every layer's weights, viewed once when the stack was built: slices into the buffers of
    /// `_arrays` (see the module header)
    views: Vec<Layer<'static>>,
    /// the weight arrays, referenced for as long as `views` points into them
    _arrays: Vec<LayerArrays>,
}

fn borrow_layers<'py>(py: Python<'py>, layers: &[LayerArrays]) -> Vec<LayerBorrow<'py>> {
    layers
        .iter()
        .map(|l| LayerBorrow {
            input_norm: l.input_norm.bind(py).readonly(),
            post_norm: l.post_norm.bind(py).readonly(),
            head_norms: l
                .head_norms
                .as_ref()
                .map(|(q, k)| (q.bind(py).readonly(), k.bind(py).readonly())),
            output_norms: l
                .output_norms
                .as_ref()
                .map(|(a, m)| (a.bind(py).readonly(), m.bind(py).readonly())),
            linears: std::array::from_fn(|i| l.linears[i].borrow(py)),
        })
        .collect()
}

/// `CpuLoraStack(layers)`: an engine's stacked LoRA adapters for fused steps (`cpu_lora`'s
/// layout). `layers[i]` holds four entries, qkv, o_proj, gate_up, down, each None or
/// `(a, b_t, width, b_cols)`: float32 `a` `[blocks * width, k]` and `b_t` `[blocks * width,
/// n]`, int32 `b_cols` `[blocks * width, 2]` (each row of `b_t`'s nonzero columns `lo..hi`),
/// all C-contiguous. Referenced, not copied (as `CpuDecoderStack`'s weights); their shapes are
/// checked against the model on every step that uses them.
#[pyclass(name = "CpuLoraStack", module = "ferrobatch._scheduler", frozen)]
pub struct PyCpuLoraStack {
    views: Vec<LoraLayer<'static>>,
    _arrays: Vec<[Option<LoraArrays>; 4]>,
}

/// One module's arrays as Python gave them: `(a, b_t, width, b_cols)`.
type LoraArrays = (F32Array, F32Array, usize, Py<PyArrayDyn<i32>>);

#[pymethods]
impl PyCpuLoraStack {
    #[new]
    fn new(py: Python<'_>, layers: Vec<Vec<Option<LoraArrays>>>) -> PyResult<Self> {
        let mut arrays = Vec::with_capacity(layers.len());
        let mut views = Vec::with_capacity(layers.len());
        for (i, layer) in layers.into_iter().enumerate() {
            let Ok(layer) = <[Option<LoraArrays>; 4]>::try_from(layer) else {
                return Err(PyValueError::new_err(format!(
                    "LoRA layer {i}: need 4 entries (qkv, o_proj, gate_up, down)"
                )));
            };
            let mut view: LoraLayer<'static> = [None; 4];
            for (m, entry) in layer.iter().enumerate() {
                let Some((a, b_t, width, b_cols)) = entry else {
                    continue;
                };
                let (a, b_t, b_cols) = (
                    a.bind(py).readonly(),
                    b_t.bind(py).readonly(),
                    b_cols.bind(py).readonly(),
                );
                let name = |what: &str| format!("LoRA layer {i} module {m} {what}");
                let (a, b_t, b_cols) = (
                    c_slice(&name("a"), &a)?,
                    c_slice(&name("b_t"), &b_t)?,
                    c_slice(&name("b_cols"), &b_cols)?,
                );
                // SAFETY: as for `CpuDecoderStack`'s views: the arrays are referenced by
                // `_arrays` for as long as `views` lives, a numpy array does not move its data
                // while referenced, and they are not written meanwhile.
                view[m] = Some(unsafe {
                    LoraWeights {
                        a: std::mem::transmute::<&[f32], &'static [f32]>(a),
                        b_t: std::mem::transmute::<&[f32], &'static [f32]>(b_t),
                        width: *width,
                        b_cols: std::mem::transmute::<&[i32], &'static [i32]>(b_cols),
                    }
                });
            }
            arrays.push(layer);
            views.push(view);
        }
        Ok(PyCpuLoraStack {
            views,
            _arrays: arrays,
        })
    }
}

/// The prefill kernel's chunks as numpy arrays: `(q_starts, q_lens, seq_lens, block_tables)`.
type PrefillArrays<'py> = (
    PyReadonlyArray1<'py, i32>,
    PyReadonlyArray1<'py, i32>,
    PyReadonlyArray1<'py, i32>,
    PyReadonlyArray2<'py, i32>,
);

#[pymethods]
impl PyCpuDecoderStack {
    #[new]
    #[pyo3(signature = (hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale,
                        layers, nope_layers = Vec::new(), activation = "silu",
                        windows = None, local_rope_layers = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        hidden: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        intermediate: usize,
        eps: f32,
        scale: f32,
        layers: Vec<Bound<'_, PyTuple>>,
        nope_layers: Vec<usize>,
        activation: &str,
        windows: Option<Vec<Option<usize>>>,
        local_rope_layers: Vec<usize>,
    ) -> PyResult<Self> {
        for (name, list) in [
            ("nope_layers", &nope_layers),
            ("local_rope_layers", &local_rope_layers),
        ] {
            if let Some(&bad) = list.iter().find(|&&i| i >= layers.len()) {
                return Err(PyValueError::new_err(format!(
                    "{name} names layer {bad}; there are {}",
                    layers.len()
                )));
            }
        }
        let windows = windows.unwrap_or_else(|| vec![None; layers.len()]);
        if windows.len() != layers.len() {
            return Err(PyValueError::new_err(format!(
                "{} windows for {} layers",
                windows.len(),
                layers.len()
            )));
        }
        let act = match activation {
            "silu" => GateActivation::Silu,
            "gelu_tanh" => GateActivation::GeluTanh,
            other => {
                return Err(PyValueError::new_err(format!(
                    "activation {other:?}: 'silu' or 'gelu_tanh'"
                )))
            }
        };
        let shape = DecoderShape {
            hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate,
            eps,
            scale,
            act,
        };
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) || num_heads == 0 {
            return Err(PyValueError::new_err(format!(
                "{num_heads} query heads do not group over {num_kv_heads} KV heads"
            )));
        }
        let mut arrays = Vec::with_capacity(layers.len());
        for (i, t) in layers.iter().enumerate() {
            if ![6, 8, 10].contains(&t.len()) {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: need (input_norm, qkv, o_proj, post_norm, gate_up, down[, q_norm, \
                     k_norm[, attn_out_norm, mlp_out_norm]]), got {} items",
                    t.len()
                )));
            }
            let linear = |j: usize| LinearArrays::extract(&t.get_item(j)?);
            arrays.push(LayerArrays {
                input_norm: t.get_item(0)?.extract()?,
                post_norm: t.get_item(3)?.extract()?,
                head_norms: if t.len() >= 8 {
                    Some((t.get_item(6)?.extract()?, t.get_item(7)?.extract()?))
                } else {
                    None
                },
                output_norms: if t.len() == 10 {
                    Some((t.get_item(8)?.extract()?, t.get_item(9)?.extract()?))
                } else {
                    None
                },
                linears: [linear(1)?, linear(2)?, linear(4)?, linear(5)?],
            });
        }
        let mut views = Vec::with_capacity(arrays.len());
        for (i, layer) in borrow_layers(py, &arrays).iter().enumerate() {
            let mut view = layer.view()?;
            view.rope = !nope_layers.contains(&i);
            view.local_rope = local_rope_layers.contains(&i);
            view.window = windows[i];
            view.check(&shape)
                .map_err(|e| PyValueError::new_err(format!("layer {i}: {}", e.0)))?;
            // SAFETY: the slices point into the buffers of numpy arrays that `arrays` holds
            // references to and the stack keeps (`_arrays`) as long as `views`; a numpy array
            // does not move or free its data while referenced, and the arrays are not written
            // while the stack lives (its contract). Only the borrow flags end here.
            views.push(unsafe { std::mem::transmute::<Layer<'_>, Layer<'static>>(view) });
        }
        Ok(PyCpuDecoderStack {
            shape,
            views,
            _arrays: arrays,
        })
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.views.len()
    }

    /// `forward(hidden, cos, sin, caches, slots, block_tables, ctx_lens, num_threads,
    /// decode_rows=None, prefill=None, amx=True, lora=None, local_cos=None, local_sin=None)`:
    /// runs the step's `R` rows through every layer (see `cpu_decoder`): `hidden` `[R, H]`
    /// float32 in place (embeddings in, pre-final-norm states out), `cos` / `sin` `[R, D]` (and
    /// `local_cos` / `local_sin` for the `local_rope_layers`), `caches` one `[2, num_blocks, block_size, Hkv, D]` array
    /// per layer, all float32, all float16, all uint8 (FP8 E4M3 bytes) or all int8 (`[..,
    /// head_dim + 4]`: head rows with their scales) (written at `slots`),
    /// `slots` `[R]` int64; the decode kernel's rows `decode_rows` `[N]` int64 (None: all,
    /// N = R) with `block_tables` `[N, max_blocks]` / `ctx_lens` `[N]` int32; `prefill` None or
    /// the prefill kernel's chunks `(q_starts, q_lens, seq_lens, block_tables)` (int32 `[P]`,
    /// `[P]`, `[P]`, `[P, max_blocks]`); `amx=False` keeps the prompt chunks' attention off AMX;
    /// `lora` None or `(CpuLoraStack, row_blocks)` (int32 `[R]`: each row's block of the stack,
    /// negative for base-model rows).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (hidden, cos, sin, caches, slots, block_tables, ctx_lens, num_threads,
                        decode_rows=None, prefill=None, amx=true, lora=None, local_cos=None,
                        local_sin=None))]
    fn forward(
        &self,
        py: Python<'_>,
        mut hidden: PyReadwriteArray2<'_, f32>,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        caches: &Bound<'_, PyAny>,
        slots: PyReadonlyArray1<'_, i64>,
        block_tables: PyReadonlyArray2<'_, i32>,
        ctx_lens: PyReadonlyArray1<'_, i32>,
        num_threads: usize,
        decode_rows: Option<PyReadonlyArray1<'_, i64>>,
        prefill: Option<PrefillArrays<'_>>,
        amx: bool,
        lora: Option<(Bound<'_, PyCpuLoraStack>, PyReadonlyArray1<'_, i32>)>,
        local_cos: Option<PyReadonlyArray2<'_, f32>>,
        local_sin: Option<PyReadonlyArray2<'_, f32>>,
    ) -> PyResult<()> {
        let s = self.shape;
        let caches = LayerCaches::extract(caches)?;
        let first = caches.first_shape();
        let [two, num_blocks, block_size, kv_heads, dim] = dims::<5>("caches[0]", &first)?;
        let row = s.head_dim + caches.row_extra();
        if two != 2 || kv_heads != s.num_kv_heads || dim != row {
            return Err(PyValueError::new_err(format!(
                "caches must be [2, num_blocks, block_size, {}, {row}], got {first:?}",
                s.num_kv_heads
            )));
        }
        let max_blocks_per_seq = block_tables.shape()[1];
        let layers = &self.views;
        let rows = StepRows {
            cos: c_slice("cos", &cos)?,
            sin: c_slice("sin", &sin)?,
            local_cos: local_cos
                .as_ref()
                .map_or(Ok(&[][..]), |t| c_slice("local_cos", t))?,
            local_sin: local_sin
                .as_ref()
                .map_or(Ok(&[][..]), |t| c_slice("local_sin", t))?,
            slots: c_slice("slots", &slots)?,
            block_tables: c_slice("block_tables", &block_tables)?,
            max_blocks_per_seq,
            ctx_lens: c_slice("ctx_lens", &ctx_lens)?,
            decode_rows: decode_rows
                .as_ref()
                .map(|d| c_slice("decode_rows", d))
                .transpose()?,
            prefill: match &prefill {
                None => None,
                Some((starts, lens, seq_lens, tables)) => Some(PrefillChunks {
                    q_starts: c_slice("prefill q_starts", starts)?,
                    q_lens: c_slice("prefill q_lens", lens)?,
                    seq_lens: c_slice("prefill seq_lens", seq_lens)?,
                    block_tables: c_slice("prefill block_tables", tables)?,
                    max_blocks_per_seq: tables.shape()[1],
                }),
            },
        };
        let lora_step = match &lora {
            None => None,
            Some((stack, row_blocks)) => Some(StepLora {
                layers: &stack.get().views,
                row_blocks: c_slice("lora row_blocks", row_blocks)?,
            }),
        };
        let hidden_c = hidden.is_c_contiguous();
        let hidden = match (hidden_c, hidden.as_slice_mut()) {
            (true, Ok(h)) => h,
            _ => return Err(PyValueError::new_err("hidden must be C-contiguous")),
        };
        let cache = CacheShape {
            num_blocks,
            block_size,
        };
        // the same steps for either element type, each compiled for its own
        macro_rules! run_with {
            ($list:expr) => {
                run_with!($list, |views| views)
            };
            ($list:expr, |$views:ident| $as_kv:expr) => {{
                let mut guards = borrow_caches($list)?;
                let $views = cache_slices(&mut guards)?;
                let mut views = $as_kv;
                py.detach(|| {
                    forward_step(
                        &s,
                        layers,
                        &mut views,
                        &cache,
                        hidden,
                        &rows,
                        num_threads,
                        amx,
                        lora_step.as_ref(),
                    )
                })
                .map_err(|e| PyValueError::new_err(e.0))
            }};
        }
        match &caches {
            LayerCaches::F32(list) => run_with!(list),
            LayerCaches::F16(list) => run_with!(list),
            LayerCaches::Fp8(list) => run_with!(list, |bytes| bytes
                .into_iter()
                .map(as_fp8_mut)
                .collect::<Vec<&mut [F8E4M3]>>()),
            LayerCaches::Q8(list) => run_with!(list, |bytes| bytes
                .into_iter()
                .map(as_q8_mut)
                .collect::<Vec<&mut [Q8]>>()),
        }
    }
}

/// Switches the fused step's phase accounting (`cpu_step_timing`) on or off.
#[pyfunction]
#[pyo3(name = "set_decoder_phase_timing")]
pub fn py_set_decoder_phase_timing(on: bool) {
    crate::cpu_step_timing::STEP_PHASES.set_enabled(on);
}

/// The fused steps' phase totals since the last call, then zeroed: a dict of `linear_ns`,
/// `attention_ns`, `other_ns` and `steps`.
#[pyfunction]
#[pyo3(name = "take_decoder_phase_times")]
pub fn py_take_decoder_phase_times(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let t = crate::cpu_step_timing::STEP_PHASES.take();
    let d = pyo3::types::PyDict::new(py);
    d.set_item("linear_ns", t.linear_ns)?;
    d.set_item("attention_ns", t.attention_ns)?;
    d.set_item("other_ns", t.other_ns)?;
    d.set_item("steps", t.steps)?;
    Ok(d)
}
