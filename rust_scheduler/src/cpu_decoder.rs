//! A step through every decoder layer of a Llama-family model on the CPU, in one call.
//!
//! Per layer: RMSNorm -> fused QKV projection -> (Qwen3: each head of q and of k RMS-normed by
//! the layer's `q_norm` / `k_norm`) -> RoPE of q and k (not in SmolLM3's NoPE layers: `rope`
//! false) -> the step's K/V written into
//! the layer's paged cache -> paged attention -> output projection, added to the
//! residual -> RMSNorm -> fused gate/up projection -> SiLU-and-mul -> down projection, added to
//! the residual. These are the kernels the Python modules call one at a time (`cpu_elementwise`,
//! `cpu_linear` / `cpu_quant_linear`, `cpu_attention`, `cpu_prefill_attention`), so the
//! arithmetic is theirs (SiLU aside: the modules use torch's); what goes away is ~15 Python
//! calls and torch ops per layer.
//!
//! Gemma 3 adds to this: the attention and MLP outputs RMS-normed before their residual adds
//! (`attn_out_norm` / `mlp_out_norm`), GELU-tanh-and-mul (`DecoderShape::act`), and
//! sliding-window layers (`window`: each query row attends its last `window` positions only)
//! whose RoPE tables are their own (`local_rope`: `StepRows::local_cos` / `local_sin`).
//!
//! The step: `R` query rows. Row `r` is `hidden[r]` `[H]`, rotated by `cos[r]` / `sin[r]`
//! `[D]`, and writes its K/V at slot `slots[r]` (block `slot / block_size`, offset
//! `slot % block_size`); every row's K/V is written before any attention. Each row is attended
//! by exactly one kernel: the decode kernel for the rows `decode_rows` names (all rows when
//! `None`: decodes, speculative drafts, short chunks), the i-th of them attending the first
//! `ctx_lens[i]` positions of block-table row `i`; the prefill kernel for each chunk of
//! `prefill` (rows `q_starts[s] .. + q_lens[s]`, causal over its `seq_lens[s]` keys; in a
//! sliding-window layer over the last `window` of them).
//! A layer's cache is `[2, num_blocks, block_size, Hkv, D]` (0 = K, 1 = V), as in Python, of
//! f32, f16 or FP8 E4M3 (`cpu_kv`, `cpu_kv_fp8`: K/V rows are rounded to it when written; the
//! math stays f32).
//!
//! Invariants checked by [`forward_step`] before anything is read or written: every weight has
//! its layer's shape ([`Layer::check`]), one cache per layer of the shape's size, whole rows of
//! `hidden`, `cos`, `sin`, one slot per row inside the cache, every row attended exactly once
//! ([`validate`]), and the attention kernels' own checks (block tables, context lengths, chunk
//! rows) on the step's buffers. A failed check leaves `hidden` and every cache untouched.
//!
//! With LoRA adapters (`cpu_lora`), each linear layer's output then gets the step's adapter
//! rows' low-rank updates; their weights and row blocks are checked with the rest.

use crate::cpu_amx_linear::{self, linear_amx_f32, AmxShape, AmxTiles};
use crate::cpu_attention::{paged_decode_attention_f32, DecodeShape};
use crate::cpu_elementwise::{gate_and_mul_f32, rms_norm_f32, rotary_f32, GateActivation};
use crate::cpu_error::KernelInputError;
use crate::cpu_kv::KvElement;
use crate::cpu_linear::{linear_f32, LinearShape, PANEL_WIDTH};
use crate::cpu_lora::{add_lora_rows, check_row_blocks, LoraWeights, StepLora};
use crate::cpu_prefill_attention::{paged_prefill_attention_f32, PrefillShape};
use crate::cpu_quant_linear::{linear_quant_f32, QuantShape, QuantWeight, MAX_ROWS};
use crate::cpu_quant_panels::{self, linear_quant_panels_f32, QuantPanelShape, QuantPanels};
use crate::cpu_step_timing::{Phase, STEP_PHASES};
use crate::cpu_tile_rows::linear_tile_rows_f32;

/// The model's sizes, shared by every layer.
#[derive(Clone, Copy, Debug)]
pub struct DecoderShape {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    /// RMSNorm's epsilon
    pub eps: f32,
    /// attention's softmax scale (`head_dim ** -0.5` for Llama)
    pub scale: f32,
    /// the MLP gate's activation (SiLU; Gemma's GELU-tanh)
    pub act: GateActivation,
}

impl DecoderShape {
    fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }
    fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    fn qkv_size(&self) -> usize {
        self.q_size() + 2 * self.kv_size()
    }
}

/// A linear layer `y = x @ W^T + bias` (`W` `[n, k]`): panel-packed float32 (`cpu_linear`'s
/// layout) and, if the model came from GGUF, also its blocks, read for steps of at most
/// [`MAX_ROWS`] rows, and their AMX tiles, read for steps of at least
/// `cpu_amx_linear::min_rows(k)` where AMX is available, or the blocks as panels, read for steps
/// of at least `cpu_quant_panels::min_rows()` where it is not, and for every step where the
/// blocks themselves are not kept (Q8G16 layers; the AMX tiles of wide layers, whose smaller
/// steps go to `cpu_tile_rows`; as `PanelLinear` does in Python).
#[derive(Clone, Copy)]
pub struct Linear<'a> {
    pub n: usize,
    pub k: usize,
    pub panels: &'a [f32],
    /// empty for none
    pub bias: &'a [f32],
    pub blocks: Option<QuantWeight<'a>>,
    /// the same blocks packed for the AMX kernel (`cpu_amx_linear::pack`), read for steps of at
    /// least `cpu_amx_linear::min_rows(k)` rows where AMX is available
    pub tiles: Option<AmxTiles<'a>>,
    /// the same blocks packed as panels (`cpu_quant_panels::pack`), read for steps of at least
    /// `cpu_quant_panels::min_rows()` rows where the AMX tiles are not
    pub qpanels: Option<QuantPanels<'a>>,
}

impl Linear<'_> {
    /// `out[rows, n] = x[rows, k] @ W^T + bias` on up to `threads` threads.
    pub fn apply(
        &self,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        threads: usize,
    ) -> Result<(), KernelInputError> {
        let (n, k) = (self.n, self.k);
        let amx = self.tiles.filter(|_| cpu_amx_linear::available());
        match (self.blocks, amx, self.qpanels) {
            (_, Some(tiles), _) if rows >= cpu_amx_linear::min_rows(k) => {
                let shape = AmxShape { m: rows, n, k };
                linear_amx_f32(&shape, x, tiles, self.bias, out, threads)
            }
            // the tiles alone (no blocks kept): fewer rows through their few-row kernel
            (None, Some(tiles), _) => {
                let shape = AmxShape { m: rows, n, k };
                linear_tile_rows_f32(&shape, x, tiles, self.bias, out, threads)
            }
            (blocks, None, Some(qpanels))
                if rows >= cpu_quant_panels::min_rows() || blocks.is_none() =>
            {
                let shape = QuantPanelShape { m: rows, n, k };
                linear_quant_panels_f32(&shape, x, qpanels, self.bias, out, threads)
            }
            (Some(w), _, _) if rows <= MAX_ROWS => {
                let shape = QuantShape { m: rows, n, k };
                linear_quant_f32(&shape, x, w, self.bias, out, threads)
            }
            _ => linear_f32(
                &LinearShape { m: rows, n, k },
                x,
                self.panels,
                self.bias,
                out,
                threads,
            ),
        }
    }

    /// No float32 panels are needed when the blocks take every step below the `MIN_ROWS` rows
    /// and their AMX tiles (where AMX is available) or their quantized panels every other, or
    /// when quantized panels or AMX tiles come without blocks (they take every step then, the
    /// tiles' smaller steps through `cpu_tile_rows`): `apply` never reaches the float32 panels.
    fn blocks_cover_every_step(&self) -> bool {
        const { assert!(cpu_amx_linear::MIN_ROWS <= MAX_ROWS + 1) };
        const { assert!(cpu_quant_panels::MIN_ROWS <= MAX_ROWS + 1) };
        const { assert!(cpu_quant_panels::MIN_ROWS_AVX2 <= MAX_ROWS + 1) };
        self.qpanels.is_some() || (self.tiles.is_some() && cpu_amx_linear::available())
    }

    fn check(&self, name: &str, n: usize, k: usize) -> Result<(), KernelInputError> {
        let panels_len = n.div_ceil(PANEL_WIDTH) * k * PANEL_WIDTH;
        let no_panels = self.panels.is_empty() && self.blocks_cover_every_step();
        if self.n != n || self.k != k || (self.panels.len() != panels_len && !no_panels) {
            return bad(format!(
                "{name}: weight is [{}, {}] with {} packed elements; the model needs [{n}, {k}] \
                 ({panels_len} packed, or none with blocks and AMX tiles or quantized panels)",
                self.n,
                self.k,
                self.panels.len()
            ));
        }
        if !self.bias.is_empty() && self.bias.len() != n {
            return bad(format!(
                "{name}: bias has {} elements, not {n}",
                self.bias.len()
            ));
        }
        if let Some(w) = self.blocks {
            // the quantized kernel's own check of the weight arrays (a call of no rows)
            QuantShape { m: 0, n, k }
                .validate(&[], &w, self.bias, &[])
                .map_err(|e| KernelInputError(format!("{name} blocks: {}", e.0)))?;
        }
        if let Some(tiles) = &self.tiles {
            // the AMX kernel's own check of the packed tiles (a call of no rows)
            AmxShape { m: 0, n, k }
                .validate(&[], tiles, self.bias, &[])
                .map_err(|e| KernelInputError(format!("{name} AMX tiles: {}", e.0)))?;
        }
        if let Some(qpanels) = &self.qpanels {
            // the quantized panel kernel's own check of its arrays (a call of no rows)
            QuantPanelShape { m: 0, n, k }
                .validate(&[], qpanels, self.bias, &[])
                .map_err(|e| KernelInputError(format!("{name} quantized panels: {}", e.0)))?;
        }
        Ok(())
    }
}

/// One decoder layer's weights.
#[derive(Clone, Copy)]
pub struct Layer<'a> {
    pub input_norm: &'a [f32],
    /// `[q; k; v]` stacked: `n = (Hq + 2 Hkv) D`
    pub qkv: Linear<'a>,
    pub o_proj: Linear<'a>,
    pub post_norm: &'a [f32],
    /// `[gate; up]` stacked: `n = 2 I`
    pub gate_up: Linear<'a>,
    pub down: Linear<'a>,
    /// per-head RMSNorm weights `[D]` of q and k before RoPE (Qwen3), or both empty
    pub q_norm: &'a [f32],
    pub k_norm: &'a [f32],
    /// false for a NoPE layer (SmolLM3): q and k attend unrotated
    pub rope: bool,
    /// RMSNorm weights `[hidden]` of the attention and MLP outputs before their residual adds
    /// (Gemma 3), or both empty
    pub attn_out_norm: &'a [f32],
    pub mlp_out_norm: &'a [f32],
    /// a sliding-window layer's window: each query attends its last `window` positions
    pub window: Option<usize>,
    /// rotates with the step's local tables (`StepRows::local_cos` / `local_sin`, Gemma 3's
    /// sliding layers) instead of `cos` / `sin`
    pub local_rope: bool,
}

impl Layer<'_> {
    /// Every weight's shape against the model's.
    pub fn check(&self, s: &DecoderShape) -> Result<(), KernelInputError> {
        let output_norms = (self.attn_out_norm.len(), self.mlp_out_norm.len());
        if output_norms != (0, 0) && output_norms != (s.hidden, s.hidden) {
            return bad(format!(
                "attn_out_norm and mlp_out_norm have {} and {} elements: both {} or both none",
                output_norms.0, output_norms.1, s.hidden
            ));
        }
        if self.window == Some(0) {
            return bad("a sliding window of 0 positions".into());
        }
        for (name, norm) in [
            ("input_norm", self.input_norm),
            ("post_norm", self.post_norm),
        ] {
            if norm.len() != s.hidden {
                return bad(format!(
                    "{name} has {} elements, not {}",
                    norm.len(),
                    s.hidden
                ));
            }
        }
        let head_norms = (self.q_norm.len(), self.k_norm.len());
        if head_norms != (0, 0) && head_norms != (s.head_dim, s.head_dim) {
            return bad(format!(
                "q_norm and k_norm have {} and {} elements: both {} or both none",
                head_norms.0, head_norms.1, s.head_dim
            ));
        }
        self.qkv.check("qkv", s.qkv_size(), s.hidden)?;
        self.o_proj.check("o_proj", s.hidden, s.q_size())?;
        self.gate_up
            .check("gate_up", 2 * s.intermediate, s.hidden)?;
        self.down.check("down", s.hidden, s.intermediate)
    }
}

/// The step's rows: RoPE angles, KV slots, and what each row attends (module header).
#[derive(Clone, Copy)]
pub struct StepRows<'a> {
    /// `[R, D]` each
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// `[R, D]` each for the layers with `local_rope`, else empty
    pub local_cos: &'a [f32],
    pub local_sin: &'a [f32],
    /// `[R]`
    pub slots: &'a [i64],
    /// the decode kernel's rows `[N]` (`None`: every row, N = R)
    pub decode_rows: Option<&'a [i64]>,
    /// `[N, max_blocks_per_seq]`
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
    /// `[N]`
    pub ctx_lens: &'a [i32],
    /// the prefill kernel's chunks
    pub prefill: Option<PrefillChunks<'a>>,
}

/// Chunks of prompt rows for the prefill kernel (`cpu_prefill_attention`'s layout).
#[derive(Clone, Copy)]
pub struct PrefillChunks<'a> {
    /// `[P]` each
    pub q_starts: &'a [i32],
    pub q_lens: &'a [i32],
    pub seq_lens: &'a [i32],
    /// `[P, max_blocks_per_seq]`
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
}

impl StepRows<'_> {
    /// Rows the decode kernel attends.
    fn num_decode_rows(&self, r: usize) -> usize {
        self.decode_rows.map_or(r, <[i64]>::len)
    }
}

/// The paged caches' geometry (every layer alike).
#[derive(Clone, Copy, Debug)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
}

fn bad<T>(msg: String) -> Result<T, KernelInputError> {
    Err(KernelInputError(msg))
}

/// Checks the module header's invariants but the attention kernels' (which `forward_step`
/// checks on its own buffers before the first write); returns the row count `R`.
pub fn validate<E: KvElement>(
    shape: &DecoderShape,
    layers: &[Layer<'_>],
    caches: &[&mut [E]],
    cache: &CacheShape,
    hidden: &[f32],
    rows: &StepRows<'_>,
) -> Result<usize, KernelInputError> {
    let s = shape;
    if s.hidden == 0 || s.head_dim == 0 || s.num_kv_heads == 0 || s.intermediate == 0 {
        return bad(format!("every size must be positive: {s:?}"));
    }
    if !hidden.len().is_multiple_of(s.hidden) {
        return bad(format!(
            "hidden has {} elements, not whole rows of {}",
            hidden.len(),
            s.hidden
        ));
    }
    let r = hidden.len() / s.hidden;
    let local = if layers.iter().any(|l| l.local_rope) {
        r * s.head_dim
    } else {
        0
    };
    for (name, len, want) in [
        ("cos", rows.cos.len(), r * s.head_dim),
        ("sin", rows.sin.len(), r * s.head_dim),
        ("local_cos", rows.local_cos.len(), local),
        ("local_sin", rows.local_sin.len(), local),
        ("slots", rows.slots.len(), r),
    ] {
        if len != want {
            return bad(format!("{name} has {len} elements, {r} rows need {want}"));
        }
    }
    if caches.len() != layers.len() {
        return bad(format!(
            "{} caches for {} layers",
            caches.len(),
            layers.len()
        ));
    }
    // a token's K (or V) row: every KV head's values, and a scaled cache's scales (`cpu_kv`)
    let kv_row = s.num_kv_heads * (s.head_dim + E::ROW_EXTRA);
    let cache_len = 2 * cache.num_blocks * cache.block_size * kv_row;
    if let Some((i, c)) = caches
        .iter()
        .enumerate()
        .find(|(_, c)| c.len() != cache_len)
    {
        return bad(format!(
            "cache of layer {i} has {} elements, not {cache_len}",
            c.len()
        ));
    }
    let num_slots = cache.num_blocks * cache.block_size;
    if let Some(&slot) = rows
        .slots
        .iter()
        .find(|&&v| v < 0 || v as usize >= num_slots)
    {
        return bad(format!("slot {slot} outside the cache's 0..{num_slots}"));
    }
    // every row attended by exactly one kernel
    let mut attended_by = vec![0u8; r];
    match rows.decode_rows {
        None => attended_by.fill(1),
        Some(index) => {
            for &i in index {
                if i < 0 || i as usize >= r {
                    return bad(format!("decode row {i} outside the step's 0..{r}"));
                }
                attended_by[i as usize] += 1;
            }
        }
    }
    if let Some(p) = &rows.prefill {
        if p.q_starts.len() != p.q_lens.len() {
            return bad("prefill q_starts and q_lens differ in length".into());
        }
        for (&start, &len) in p.q_starts.iter().zip(p.q_lens) {
            let (start, len) = (start.max(0) as usize, len.max(0) as usize);
            for count in attended_by.iter_mut().skip(start).take(len) {
                *count += 1;
            }
        }
    }
    if let Some(row) = attended_by.iter().position(|&c| c != 1) {
        return bad(format!(
            "row {row} is attended by {} kernels, not exactly one",
            attended_by[row]
        ));
    }

    for layer in layers {
        layer.check(s)?;
    }
    Ok(r)
}

fn attention_shape(
    s: &DecoderShape,
    cache: &CacheShape,
    rows: usize,
    max_blocks: usize,
) -> DecodeShape {
    DecodeShape {
        num_seqs: rows,
        num_heads: s.num_heads,
        num_kv_heads: s.num_kv_heads,
        head_dim: s.head_dim,
        num_blocks: cache.num_blocks,
        block_size: cache.block_size,
        max_blocks_per_seq: max_blocks,
    }
}

/// Runs the step's rows through every layer: `hidden` `[R, H]` in (the embeddings) and out
/// (before the final norm), each layer's K/V written into `caches[layer]`. Linear layers and
/// attention use up to `threads` threads of the kernels' pool; prompt chunks may use AMX
/// where `amx` (`paged_prefill_attention_f32`). Errors, touching nothing, unless the module
/// header's invariants hold.
#[allow(clippy::too_many_arguments)]
pub fn forward_step<E: KvElement>(
    shape: &DecoderShape,
    layers: &[Layer<'_>],
    caches: &mut [&mut [E]],
    cache: &CacheShape,
    hidden: &mut [f32],
    rows: &StepRows<'_>,
    threads: usize,
    amx: bool,
    lora: Option<&StepLora<'_>>,
) -> Result<(), KernelInputError> {
    // opt-in phase accounting (`cpu_step_timing`): a no-op unless switched on
    let mut clock = STEP_PHASES.clock();
    let r = validate(shape, layers, caches, cache, hidden, rows)?;
    if let Some(l) = lora {
        validate_lora(shape, layers.len(), l, r)?;
    }
    if r == 0 {
        return Ok(());
    }
    let s = shape;
    // after linear layer `m` (0 qkv, 1 o_proj, 2 gate_up, 3 down) of layer `i`: its LoRA rows
    let add_lora = |i: usize, m: usize, k: usize, n: usize, x: &[f32], out: &mut [f32]| {
        if let Some(w) = lora.and_then(|l| l.layers[i][m].as_ref()) {
            add_lora_rows(w, k, n, lora.map_or(&[], |l| l.row_blocks), x, out, threads);
        }
    };
    let (d, q_size, kv_size, qkv_size) = (s.head_dim, s.q_size(), s.kv_size(), s.qkv_size());
    let kv_row = s.num_kv_heads * (d + E::ROW_EXTRA); // a token's cache row (`cpu_kv`)
    let num_decode = rows.num_decode_rows(r);
    let attn = attention_shape(s, cache, num_decode, rows.max_blocks_per_seq);
    let prefill_shape = rows.prefill.map(|p| PrefillShape {
        num_tokens: r,
        num_seqs: p.q_starts.len(),
        num_heads: s.num_heads,
        num_kv_heads: s.num_kv_heads,
        head_dim: d,
        num_blocks: cache.num_blocks,
        block_size: cache.block_size,
        max_blocks_per_seq: p.max_blocks_per_seq,
    });
    let mut normed = vec![0f32; r * s.hidden];
    let mut qkv = vec![0f32; r * qkv_size];
    let mut q = vec![0f32; r * q_size];
    let mut head_normed = vec![0f32; q_size]; // one row's q (or k) after its head norms
    let mut attended = vec![0f32; r * q_size];
    let mut projected = vec![0f32; r * s.hidden];
    let mut gate_up = vec![0f32; r * 2 * s.intermediate];
    let mut activated = vec![0f32; r * s.intermediate];
    // the decode kernel's rows gathered when they are not all of them
    let gathered = if rows.decode_rows.is_some() {
        num_decode * q_size
    } else {
        0
    };
    let (mut q_decode, mut attended_decode) = (vec![0f32; gathered], vec![0f32; gathered]);
    if let Some(first) = caches.first() {
        // the attention kernels' own checks (block tables, context lengths, chunk rows),
        // before any write
        let (k, v) = first.split_at(first.len() / 2);
        if num_decode > 0 {
            let (q_in, out) = match rows.decode_rows {
                None => (&q, &attended),
                Some(_) => (&q_decode, &attended_decode),
            };
            attn.validate(q_in, k, v, rows.block_tables, rows.ctx_lens, out)?;
        }
        if let (Some(shape), Some(p)) = (&prefill_shape, &rows.prefill) {
            let chunks = (p.q_starts, p.q_lens, p.seq_lens);
            shape.validate(&q, k, v, p.block_tables, chunks, &attended)?;
        }
    }
    // each sliding window's first keys of the decode rows, made at its first layer
    let mut starts_by_window: Vec<(usize, Option<Vec<i32>>)> = Vec::new();
    for (li, (layer, layer_cache)) in layers.iter().zip(caches.iter_mut()).enumerate() {
        let (k_cache, v_cache) = layer_cache.split_at_mut(layer_cache.len() / 2);
        rms_norm_f32(hidden, layer.input_norm, s.eps, &mut normed)?;
        clock.lap(Phase::Other);
        layer.qkv.apply(&normed, r, &mut qkv, threads)?;
        add_lora(li, 0, s.hidden, qkv_size, &normed, &mut qkv);
        clock.lap(Phase::Linear);
        let (cos_table, sin_table) = if layer.local_rope {
            (rows.local_cos, rows.local_sin)
        } else {
            (rows.cos, rows.sin)
        };
        for (i, row) in qkv.chunks_exact_mut(qkv_size).enumerate() {
            let (cos, sin) = (&cos_table[i * d..][..d], &sin_table[i * d..][..d]);
            let (q_row, kv) = row.split_at_mut(q_size);
            let (k_row, v_row) = kv.split_at_mut(kv_size);
            if !layer.q_norm.is_empty() {
                for (part, weight) in [(&mut *q_row, layer.q_norm), (&mut *k_row, layer.k_norm)] {
                    let out = &mut head_normed[..part.len()];
                    rms_norm_f32(part, weight, s.eps, out)?;
                    part.copy_from_slice(out);
                }
            }
            if layer.rope {
                rotary_f32(q_row, d, cos, sin)?;
                rotary_f32(k_row, d, cos, sin)?;
            }
            q[i * q_size..][..q_size].copy_from_slice(q_row);
            let at = rows.slots[i] as usize * kv_row;
            E::store_heads(&mut k_cache[at..at + kv_row], k_row, d);
            E::store_heads(&mut v_cache[at..at + kv_row], v_row, d);
        }
        let (bt, ctx) = (rows.block_tables, rows.ctx_lens);
        let starts = layer
            .window
            .and_then(|w| window_starts(&mut starts_by_window, ctx, w));
        clock.lap(Phase::Other);
        match rows.decode_rows {
            _ if num_decode == 0 => {}
            None => paged_decode_attention_f32(
                &attn,
                &q,
                k_cache,
                v_cache,
                bt,
                ctx,
                starts,
                &mut attended,
                s.scale,
                threads,
            )?,
            Some(index) => {
                for (dst, &i) in q_decode.chunks_exact_mut(q_size).zip(index) {
                    dst.copy_from_slice(&q[i as usize * q_size..][..q_size]);
                }
                paged_decode_attention_f32(
                    &attn,
                    &q_decode,
                    k_cache,
                    v_cache,
                    bt,
                    ctx,
                    starts,
                    &mut attended_decode,
                    s.scale,
                    threads,
                )?;
                for (src, &i) in attended_decode.chunks_exact(q_size).zip(index) {
                    attended[i as usize * q_size..][..q_size].copy_from_slice(src);
                }
            }
        }
        if let (Some(shape), Some(p)) = (&prefill_shape, &rows.prefill) {
            paged_prefill_attention_f32(
                shape,
                &q,
                k_cache,
                v_cache,
                p.block_tables,
                p.q_starts,
                p.q_lens,
                p.seq_lens,
                &mut attended,
                s.scale,
                threads,
                amx,
                layer.window,
            )?;
        }
        clock.lap(Phase::Attention);
        layer.o_proj.apply(&attended, r, &mut projected, threads)?;
        add_lora(li, 1, q_size, s.hidden, &attended, &mut projected);
        clock.lap(Phase::Linear);
        add_normed_into(hidden, &projected, layer.attn_out_norm, s.eps, &mut normed)?;
        rms_norm_f32(hidden, layer.post_norm, s.eps, &mut normed)?;
        clock.lap(Phase::Other);
        layer.gate_up.apply(&normed, r, &mut gate_up, threads)?;
        add_lora(li, 2, s.hidden, 2 * s.intermediate, &normed, &mut gate_up);
        clock.lap(Phase::Linear);
        gate_and_mul_f32(&gate_up, s.intermediate, &mut activated, s.act)?;
        clock.lap(Phase::Other);
        layer.down.apply(&activated, r, &mut projected, threads)?;
        add_lora(li, 3, s.intermediate, s.hidden, &activated, &mut projected);
        clock.lap(Phase::Linear);
        add_normed_into(hidden, &projected, layer.mlp_out_norm, s.eps, &mut normed)?;
    }
    clock.lap(Phase::Other);
    clock.finish();
    Ok(())
}

/// The first key each decode row attends in a layer of window `window` (`ctx - window`, at
/// least 0), or `None` where every row sees its whole context; computed once per window and
/// step (`cache`).
fn window_starts<'c>(
    cache: &'c mut Vec<(usize, Option<Vec<i32>>)>,
    ctx_lens: &[i32],
    window: usize,
) -> Option<&'c [i32]> {
    let at = match cache.iter().position(|(w, _)| *w == window) {
        Some(at) => at,
        None => {
            let w = i32::try_from(window).unwrap_or(i32::MAX);
            let starts = ctx_lens
                .iter()
                .any(|&c| c > w)
                .then(|| ctx_lens.iter().map(|&c| (c - w).max(0)).collect());
            cache.push((window, starts));
            cache.len() - 1
        }
    };
    cache[at].1.as_deref()
}

/// `hidden += out`, or with a norm weight (Gemma 3's output norms) `hidden += rms_norm(out)`
/// (`scratch` `[R, H]` holds the normed rows).
fn add_normed_into(
    hidden: &mut [f32],
    out: &[f32],
    norm: &[f32],
    eps: f32,
    scratch: &mut [f32],
) -> Result<(), KernelInputError> {
    if norm.is_empty() {
        add_into(hidden, out);
    } else {
        rms_norm_f32(out, norm, eps, scratch)?;
        add_into(hidden, scratch);
    }
    Ok(())
}

/// The step's LoRA weights against the model's linear layers, and its row blocks against the
/// step's `r` rows and every module's blocks.
fn validate_lora(
    s: &DecoderShape,
    num_layers: usize,
    lora: &StepLora<'_>,
    r: usize,
) -> Result<(), KernelInputError> {
    if lora.layers.len() != num_layers {
        return bad(format!(
            "LoRA weights for {} layers, the model has {num_layers}",
            lora.layers.len()
        ));
    }
    // (name, n, k) of qkv, o_proj, gate_up, down
    let dims = [
        ("qkv", s.qkv_size(), s.hidden),
        ("o_proj", s.hidden, s.q_size()),
        ("gate_up", 2 * s.intermediate, s.hidden),
        ("down", s.hidden, s.intermediate),
    ];
    let mut blocks = usize::MAX;
    for (i, layer) in lora.layers.iter().enumerate() {
        for (w, (name, n, k)) in layer.iter().zip(dims) {
            if let Some(w) = w {
                let here = LoraWeights::check(w, &format!("layer {i} {name}"), n, k)?;
                blocks = blocks.min(here);
            }
        }
    }
    check_row_blocks(lora.row_blocks, r, blocks)
}

fn add_into(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, &b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_amx_linear::AmxFormat;
    use crate::cpu_kv::{f16, KvElement};
    use crate::cpu_kv_fp8::F8E4M3;
    use crate::cpu_kv_q8::{dequantize_cache, quantize_cache, quantize_head, Q8, SCALE_BYTES};
    use crate::cpu_linear::pack;
    use crate::test_rng::Lcg;

    const SHAPE: DecoderShape = DecoderShape {
        hidden: 64,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        intermediate: 96,
        eps: 1e-5,
        scale: 0.25,
        act: GateActivation::Silu,
    };
    const CACHE: CacheShape = CacheShape {
        num_blocks: 12,
        block_size: 4,
    };

    /// A weight's dense values, its panels, the Q8_0 blocks it was formed from and their AMX
    /// tiles; plus zeroed panels and block scales of the same sizes (to prove which copy a step
    /// reads).
    struct Weight {
        dense: Vec<f32>,
        panels: Vec<f32>,
        tiles: Vec<u16>,
        qpanels: Vec<u8>,
        zero_panels: Vec<f32>,
        no_panels: Vec<f32>,
        zero_scale: Vec<f32>,
        bias: Vec<f32>,
        scale: Vec<f32>,
        qs: Vec<i8>,
        n: usize,
        k: usize,
    }

    impl Weight {
        fn new(rng: &mut Lcg, n: usize, k: usize, bias: bool) -> Weight {
            let scale: Vec<f32> = (0..n * k / 32)
                .map(|_| 0.002 + 0.002 * rng.next_f32())
                .collect();
            let qs: Vec<i8> = (0..n * k)
                .map(|_| (rng.below(255) as i32 - 127) as i8)
                .collect();
            // w = scale * q, one float32 multiply: what the blocks kernel forms
            let dense: Vec<f32> = (0..n * k).map(|i| scale[i / 32] * qs[i] as f32).collect();
            let bias = if bias { rng.vec(n) } else { vec![] };
            let panels = pack(&dense, n, k).unwrap();
            let blocks = QuantWeight::Q8_0 {
                scale: &scale,
                qs: &qs,
            };
            let tiles = cpu_amx_linear::pack(&blocks, n, k).unwrap();
            let qpanels = cpu_quant_panels::pack(&blocks, n, k).unwrap();
            Weight {
                tiles,
                qpanels,
                zero_panels: vec![0.0; panels.len()],
                no_panels: vec![],
                zero_scale: vec![0.0; scale.len()],
                dense,
                panels,
                bias,
                scale,
                qs,
                n,
                k,
            }
        }

        fn linear(&self, kernels: Kernels) -> Linear<'_> {
            let (panels, blocks, scale) = match kernels {
                Kernels::Panels => (&self.panels, false, &self.scale),
                Kernels::BlocksOnly => (&self.zero_panels, true, &self.scale),
                Kernels::PanelsOnly => (&self.panels, true, &self.zero_scale),
                Kernels::TilesOnly => (&self.zero_panels, true, &self.zero_scale),
                Kernels::NoPanels => (&self.no_panels, true, &self.scale),
                Kernels::QuantPanelsOnly => (&self.zero_panels, true, &self.zero_scale),
                Kernels::NoPanelsQuant => (&self.no_panels, true, &self.scale),
                Kernels::QuantPanelsAlone => (&self.no_panels, false, &self.scale),
                Kernels::TilesAlone => (&self.no_panels, false, &self.scale),
            };
            let quant_panels = matches!(
                kernels,
                Kernels::QuantPanelsOnly | Kernels::NoPanelsQuant | Kernels::QuantPanelsAlone
            );
            Linear {
                n: self.n,
                k: self.k,
                panels,
                bias: &self.bias,
                blocks: blocks.then_some(QuantWeight::Q8_0 {
                    scale,
                    qs: &self.qs,
                }),
                tiles: matches!(
                    kernels,
                    Kernels::TilesOnly | Kernels::NoPanels | Kernels::TilesAlone
                )
                .then_some(AmxTiles {
                    format: AmxFormat::Int8,
                    data: &self.tiles,
                }),
                qpanels: quant_panels.then_some(QuantPanels {
                    format: cpu_quant_panels::PanelFormat::Q8_0,
                    data: &self.qpanels,
                }),
            }
        }

        fn apply(&self, x: &[f64]) -> Vec<f64> {
            (0..self.n)
                .map(|o| {
                    let w = &self.dense[o * self.k..][..self.k];
                    let b = self.bias.get(o).map_or(0.0, |&b| b as f64);
                    b + w.iter().zip(x).map(|(&w, &x)| w as f64 * x).sum::<f64>()
                })
                .collect()
        }
    }

    /// Which copies of the weights a layer gets: panels only; blocks with zeroed panels (a step
    /// of <= 8 rows must read the blocks); panels with zeroed blocks (a step of more rows must
    /// read the panels); AMX tiles with zeroed panels and blocks (a step of more rows must read
    /// the tiles where AMX is available); blocks and tiles without panels (every step size is
    /// covered where AMX is available); quantized panels with zeroed float32 panels and blocks
    /// (a step of more rows must read the quantized panels); blocks and quantized panels
    /// without float32 panels (every step size is covered, on every CPU); quantized panels
    /// alone (every step size reads them); AMX tiles alone (every step size reads them, the
    /// smaller ones through `cpu_tile_rows`).
    #[derive(Clone, Copy, Debug)]
    enum Kernels {
        QuantPanelsAlone,
        TilesAlone,
        Panels,
        BlocksOnly,
        PanelsOnly,
        TilesOnly,
        NoPanels,
        QuantPanelsOnly,
        NoPanelsQuant,
    }

    struct LayerWeights {
        norms: [Vec<f32>; 2],
        /// q / k head norms `[D]` (Qwen3), if the layer has them
        head_norms: Option<[Vec<f32>; 2]>,
        qkv: Weight,
        o: Weight,
        gate_up: Weight,
        down: Weight,
    }

    fn layer_weights(rng: &mut Lcg) -> LayerWeights {
        let s = SHAPE;
        let norm = |rng: &mut Lcg| (0..s.hidden).map(|_| 1.0 + 0.3 * rng.next_f32()).collect();
        LayerWeights {
            norms: [norm(rng), norm(rng)],
            head_norms: None,
            qkv: Weight::new(rng, s.qkv_size(), s.hidden, true),
            o: Weight::new(rng, s.hidden, s.q_size(), false),
            gate_up: Weight::new(rng, 2 * s.intermediate, s.hidden, false),
            down: Weight::new(rng, s.hidden, s.intermediate, false),
        }
    }

    fn rms_norm(x: &[f64], w: &[f32]) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + SHAPE.eps as f64).sqrt();
        x.iter().zip(w).map(|(v, &w)| v * inv * w as f64).collect()
    }

    fn rope(x: &mut [f64], cos: &[f32], sin: &[f32]) {
        let d = SHAPE.head_dim;
        for head in x.chunks_exact_mut(d) {
            let h = head.to_vec();
            for i in 0..d {
                let rotated = if i < d / 2 {
                    -h[i + d / 2]
                } else {
                    h[i - d / 2]
                };
                head[i] = h[i] * cos[i] as f64 + rotated * sin[i] as f64;
            }
        }
    }

    /// The step in f64, written out from the formulas: returns the hidden rows and the caches.
    fn reference(
        weights: &[LayerWeights],
        caches: &[Vec<f32>],
        hidden: &[f32],
        rows: &StepRows<'_>,
    ) -> (Vec<f64>, Vec<Vec<f64>>) {
        reference_rounding_kv(weights, caches, hidden, rows, |_| {})
    }

    /// [`reference`] for a cache that stores each written K/V head row as `round_head` leaves
    /// it.
    fn reference_rounding_kv(
        weights: &[LayerWeights],
        caches: &[Vec<f32>],
        hidden: &[f32],
        rows: &StepRows<'_>,
        round_head: impl Fn(&mut [f64]),
    ) -> (Vec<f64>, Vec<Vec<f64>>) {
        let plain = Gemma {
            act: GateActivation::Silu,
            windows: vec![None; weights.len()],
            out_norms: vec![None; weights.len()],
            local_rope: vec![false; weights.len()],
        };
        reference_of(weights, caches, hidden, rows, round_head, &plain)
    }

    /// What Gemma 3 adds to the layers (module header), per layer.
    struct Gemma {
        act: GateActivation,
        windows: Vec<Option<usize>>,
        /// the attention and MLP output norms
        out_norms: Vec<Option<[Vec<f32>; 2]>>,
        /// rotates with `StepRows::local_cos` / `local_sin`
        local_rope: Vec<bool>,
    }

    /// [`reference_rounding_kv`] with Gemma 3's parts `g`.
    fn reference_of(
        weights: &[LayerWeights],
        caches: &[Vec<f32>],
        hidden: &[f32],
        rows: &StepRows<'_>,
        round_head: impl Fn(&mut [f64]),
        g: &Gemma,
    ) -> (Vec<f64>, Vec<Vec<f64>>) {
        let s = SHAPE;
        let (d, h, kv) = (s.head_dim, s.hidden, s.kv_size());
        let r = hidden.len() / h;
        let mut x: Vec<f64> = hidden.iter().map(|&v| v as f64).collect();
        let mut out_caches = vec![];
        for (li, (w, cache)) in weights.iter().zip(caches).enumerate() {
            let mut c: Vec<f64> = cache.iter().map(|&v| v as f64).collect();
            let half = c.len() / 2;
            let mut queries = vec![];
            for i in 0..r {
                let mut qkv = w.qkv.apply(&rms_norm(&x[i * h..][..h], &w.norms[0]));
                if let Some([qn, kn]) = &w.head_norms {
                    let (q_part, k_part) = qkv.split_at_mut(s.q_size());
                    for (part, weight) in [(q_part, qn), (&mut k_part[..kv], kn)] {
                        for head in part.chunks_exact_mut(d) {
                            let normed = rms_norm(head, weight);
                            head.copy_from_slice(&normed);
                        }
                    }
                }
                let (cos, sin) = if g.local_rope[li] {
                    (&rows.local_cos[i * d..][..d], &rows.local_sin[i * d..][..d])
                } else {
                    (&rows.cos[i * d..][..d], &rows.sin[i * d..][..d])
                };
                rope(&mut qkv[..s.q_size()], cos, sin);
                rope(&mut qkv[s.q_size()..s.q_size() + kv], cos, sin);
                let at = rows.slots[i] as usize * kv;
                for (part, rows) in [(0, s.q_size()), (half, s.q_size() + kv)] {
                    let written = &mut c[part + at..][..kv];
                    written.copy_from_slice(&qkv[rows..][..kv]);
                    written.chunks_exact_mut(d).for_each(&round_head);
                }
                queries.push(qkv[..s.q_size()].to_vec());
            }
            for (i, q) in queries.iter().enumerate() {
                let mut attended = vec![0f64; s.q_size()];
                let ctx = rows.ctx_lens[i] as usize;
                let first = g.windows[li].map_or(0, |w| ctx.saturating_sub(w));
                let slot = |p: usize| {
                    let table = &rows.block_tables[i * rows.max_blocks_per_seq..];
                    table[p / CACHE.block_size] as usize * CACHE.block_size + p % CACHE.block_size
                };
                for head in 0..s.num_heads {
                    let kv_head = head / (s.num_heads / s.num_kv_heads);
                    let qh = &q[head * d..][..d];
                    let key = |p: usize| &c[slot(p) * kv + kv_head * d..][..d];
                    let logits: Vec<f64> = (first..ctx)
                        .map(|p| {
                            s.scale as f64 * qh.iter().zip(key(p)).map(|(a, b)| a * b).sum::<f64>()
                        })
                        .collect();
                    let m = logits.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                    let total: f64 = e.iter().sum();
                    for (p, &ep) in (first..ctx).zip(&e) {
                        let value = &c[half + slot(p) * kv + kv_head * d..][..d];
                        for j in 0..d {
                            attended[head * d + j] += ep / total * value[j];
                        }
                    }
                }
                let mut o = w.o.apply(&attended);
                if let Some([attn_out, _]) = &g.out_norms[li] {
                    o = rms_norm(&o, attn_out);
                }
                x[i * h..][..h].iter_mut().zip(o).for_each(|(a, b)| *a += b);
            }
            for i in 0..r {
                let gu = w.gate_up.apply(&rms_norm(&x[i * h..][..h], &w.norms[1]));
                let act: Vec<f64> = (0..s.intermediate)
                    .map(|j| {
                        let x = gu[j];
                        let z = match g.act {
                            GateActivation::Silu => x,
                            GateActivation::GeluTanh => {
                                2.0 * (2.0 / std::f64::consts::PI).sqrt()
                                    * (x + 0.044715 * x * x * x)
                            }
                        };
                        x / (1.0 + (-z).exp()) * gu[s.intermediate + j]
                    })
                    .collect();
                let mut down = w.down.apply(&act);
                if let Some([_, mlp_out]) = &g.out_norms[li] {
                    down = rms_norm(&down, mlp_out);
                }
                x[i * h..][..h]
                    .iter_mut()
                    .zip(down)
                    .for_each(|(a, b)| *a += b);
            }
            out_caches.push(c);
        }
        (x, out_caches)
    }

    /// Two layers of weights, their caches (random, as if earlier tokens were there), and a
    /// step: three sequences over shuffled blocks, one decode at context 9, one with two query
    /// rows (a decode and its draft: contexts 5 and 6), one first token (context 1), and
    /// `extra` more decode rows of context 3 (enough rows to pass the blocks kernel's limit).
    struct Case {
        weights: Vec<LayerWeights>,
        caches: Vec<Vec<f32>>,
        hidden: Vec<f32>,
        cos: Vec<f32>,
        sin: Vec<f32>,
        slots: Vec<i64>,
        tables: Vec<i32>,
        ctx: Vec<i32>,
    }

    impl Case {
        fn new(seed: u64, extra: usize) -> Case {
            let mut rng = Lcg(seed);
            let weights: Vec<LayerWeights> = (0..2).map(|_| layer_weights(&mut rng)).collect();
            let cache_len = 2 * CACHE.num_blocks * CACHE.block_size * SHAPE.kv_size();
            let caches = (0..2).map(|_| rng.vec(cache_len)).collect();
            let bs = CACHE.block_size;
            let (mut tables, mut slots, mut ctx) = (vec![], vec![], vec![]);
            let mut row = |table: [i32; 3], positions: &[usize]| {
                for &p in positions {
                    tables.extend(table);
                    slots.push(table[p / bs] as i64 * bs as i64 + (p % bs) as i64);
                    ctx.push(p as i32 + 1);
                }
            };
            row([7, 2, 10], &[8]);
            row([5, 11, 0], &[4, 5]);
            row([3, 0, 0], &[0]);
            for e in 0..extra {
                row([1 + (e % 2) as i32, 0, 0], &[2]);
            }
            let d = SHAPE.head_dim;
            let angles: Vec<f32> = (0..ctx.len() * d)
                .map(|j| (j / d) as f32 * 0.7 + (j % (d / 2)) as f32 * 0.1)
                .collect();
            Case {
                weights,
                caches,
                hidden: rng.vec(ctx.len() * SHAPE.hidden),
                cos: angles.iter().map(|a| a.cos()).collect(),
                sin: angles.iter().map(|a| a.sin()).collect(),
                slots,
                tables,
                ctx,
            }
        }

        fn rows(&self) -> StepRows<'_> {
            StepRows {
                cos: &self.cos,
                sin: &self.sin,
                local_cos: &[],
                local_sin: &[],
                slots: &self.slots,
                block_tables: &self.tables,
                max_blocks_per_seq: 3,
                ctx_lens: &self.ctx,
                decode_rows: None,
                prefill: None,
            }
        }

        fn layers(&self, kernels: Kernels) -> Vec<Layer<'_>> {
            self.weights
                .iter()
                .map(|w| Layer {
                    input_norm: &w.norms[0],
                    qkv: w.qkv.linear(kernels),
                    o_proj: w.o.linear(kernels),
                    post_norm: &w.norms[1],
                    gate_up: w.gate_up.linear(kernels),
                    down: w.down.linear(kernels),
                    q_norm: w.head_norms.as_ref().map_or(&[][..], |n| &n[0]),
                    k_norm: w.head_norms.as_ref().map_or(&[][..], |n| &n[1]),
                    rope: true,
                    attn_out_norm: &[],
                    mlp_out_norm: &[],
                    window: None,
                    local_rope: false,
                })
                .collect()
        }

        /// `forward_step` on copies of the caches and hidden rows: the result and the copies.
        fn run(
            &self,
            layers: &[Layer<'_>],
            caches: &mut [&mut [f32]],
            rows: &StepRows<'_>,
            threads: usize,
        ) -> (Result<(), KernelInputError>, Vec<f32>) {
            let mut hidden = self.hidden.clone();
            let result = forward_step(
                &SHAPE,
                layers,
                caches,
                &CACHE,
                &mut hidden,
                rows,
                threads,
                true,
                None,
            );
            (result, hidden)
        }
    }

    fn run_case(kernels: Kernels, extra: usize) {
        let case = Case::new(7 + extra as u64, extra);
        check(&case, &case.rows(), &case.rows(), kernels);
    }

    /// `rows` through `forward_step` against the f64 reference of `per_row` (the same step with
    /// every row a decode-kernel row, which is what each kernel computes).
    fn check(case: &Case, rows: &StepRows<'_>, per_row: &StepRows<'_>, kernels: Kernels) {
        let (want_hidden, want_caches) =
            reference(&case.weights, &case.caches, &case.hidden, per_row);
        let layers = case.layers(kernels);
        for threads in [1, 2, 3] {
            let mut caches = case.caches.clone();
            let mut views: Vec<&mut [f32]> = caches.iter_mut().map(|c| c.as_mut_slice()).collect();
            let (result, hidden) = case.run(&layers, &mut views, rows, threads);
            result.unwrap();
            for (j, (&got, &want)) in hidden.iter().zip(&want_hidden).enumerate() {
                assert!(
                    (got as f64 - want).abs() <= 2e-4 * (1.0 + want.abs()),
                    "{kernels:?} rows={} threads={threads} hidden[{j}]: {got} vs {want}",
                    case.ctx.len()
                );
            }
            for (layer, (got, want)) in caches.iter().zip(&want_caches).enumerate() {
                for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "layer {layer} cache[{j}]: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn matches_an_f64_reference_of_the_layers() {
        run_case(Kernels::Panels, 0);
        run_case(Kernels::BlocksOnly, 0); // 4 rows read the blocks
        run_case(Kernels::PanelsOnly, 6); // 10 rows read the panels although blocks are known
        run_case(Kernels::QuantPanelsOnly, 2); // 6 rows read the quantized panels
        run_case(Kernels::QuantPanelsOnly, 6); // 10 rows
        run_case(Kernels::QuantPanelsOnly, 20); // 24 rows: two row tiles
        run_case(Kernels::NoPanelsQuant, 0); // 4 rows: the blocks
        run_case(Kernels::NoPanelsQuant, 6); // 10 rows: the quantized panels
        run_case(Kernels::QuantPanelsAlone, 0); // 4 rows: the quantized panels, no blocks
        run_case(Kernels::QuantPanelsAlone, 6); // 10 rows
        if cpu_amx_linear::available() {
            run_case(Kernels::TilesOnly, 1); // 5 rows read the AMX tiles
            run_case(Kernels::TilesOnly, 6); // 10 rows
            run_case(Kernels::TilesOnly, 20); // 24 rows: two row tiles
            run_case(Kernels::NoPanels, 0); // 4 rows: the blocks
            run_case(Kernels::NoPanels, 6); // 10 rows: the tiles
            run_case(Kernels::TilesAlone, 0); // 4 rows: the tiles' few-row kernel, no blocks
            run_case(Kernels::TilesAlone, 6); // 10 rows: the tiles
        } else {
            eprintln!("AMX not available here: the decoder's AMX path is not exercised");
        }
    }

    #[test]
    fn gemma3_layers_match_the_reference() {
        // layer 0 a sliding layer (window 4: the rows at contexts 9, 5 and 6 start at keys 5,
        // 1 and 2) with its own RoPE tables, layer 1 global; output norms on both; GELU-tanh;
        // the rows as decode-kernel rows, with two of them a prompt chunk over 6 keys (the
        // prefill kernel's window), and all of them chunks
        let case = Case::new(53, 0);
        let mut rng = Lcg(54);
        let out_norms: Vec<[Vec<f32>; 2]> = (0..2)
            .map(|_| [rng.vec(SHAPE.hidden), rng.vec(SHAPE.hidden)])
            .collect();
        let local_cos: Vec<f32> = case.cos.iter().map(|c| c * 0.8).collect();
        let local_sin: Vec<f32> = case.sin.iter().map(|v| -v).collect();
        let g = Gemma {
            act: GateActivation::GeluTanh,
            windows: vec![Some(4), None],
            out_norms: out_norms.iter().cloned().map(Some).collect(),
            local_rope: vec![true, false],
        };
        let rows = StepRows {
            local_cos: &local_cos,
            local_sin: &local_sin,
            ..case.rows()
        };
        let (want, _) = reference_of(&case.weights, &case.caches, &case.hidden, &rows, |_| {}, &g);
        let (plain_want, _) = reference(&case.weights, &case.caches, &case.hidden, &rows);
        let mut layers = case.layers(Kernels::Panels);
        for (i, layer) in layers.iter_mut().enumerate() {
            layer.attn_out_norm = &out_norms[i][0];
            layer.mlp_out_norm = &out_norms[i][1];
            layer.window = g.windows[i];
            layer.local_rope = g.local_rope[i];
        }
        let shape = DecoderShape {
            act: GateActivation::GeluTanh,
            ..SHAPE
        };
        let arrays = mixed_arrays(&case);
        let (mixed, all_chunks) = (
            mixed_rows(&case, false, &arrays),
            mixed_rows(&case, true, &arrays),
        );
        let steps = [
            rows,
            StepRows {
                local_cos: &local_cos,
                local_sin: &local_sin,
                ..mixed
            },
            StepRows {
                local_cos: &local_cos,
                local_sin: &local_sin,
                ..all_chunks
            },
        ];
        for (n, step) in steps.iter().enumerate() {
            for threads in [1, 2] {
                let mut caches = case.caches.clone();
                let mut views: Vec<&mut [f32]> =
                    caches.iter_mut().map(|c| c.as_mut_slice()).collect();
                let mut hidden = case.hidden.clone();
                forward_step(
                    &shape,
                    &layers,
                    &mut views,
                    &CACHE,
                    &mut hidden,
                    step,
                    threads,
                    true,
                    None,
                )
                .unwrap();
                let close = |want: &[f64]| {
                    hidden
                        .iter()
                        .zip(want)
                        .all(|(&got, &w)| (got as f64 - w).abs() <= 2e-4 * (1.0 + w.abs()))
                };
                assert!(close(&want), "step {n} threads={threads}");
                assert!(!close(&plain_want), "the Gemma parts change the output");
            }
        }
        // what the step refuses: a window of 0, one output norm alone, local RoPE without its
        // tables
        let mut views: Vec<Vec<f32>> = case.caches.clone();
        let mut views: Vec<&mut [f32]> = views.iter_mut().map(|c| c.as_mut_slice()).collect();
        let mut hidden = case.hidden.clone();
        let mut refused = |layers: &[Layer<'_>], rows: &StepRows<'_>| {
            let before = hidden.clone();
            let result = forward_step(
                &shape,
                layers,
                &mut views,
                &CACHE,
                &mut hidden,
                rows,
                1,
                true,
                None,
            );
            assert!(result.is_err() && hidden == before);
        };
        let mut bad = layers.clone();
        bad[1].window = Some(0);
        refused(&bad, &rows);
        let mut bad = layers.clone();
        bad[0].mlp_out_norm = &[];
        refused(&bad, &rows);
        refused(&layers, &case.rows());
    }

    #[test]
    fn lora_rows_match_the_reference_with_the_adapter_merged() {
        // one adapter of width 2 on every linear layer of both layers, every row using it:
        // the fused step with LoRA against the f64 reference of weights W + B A; and with
        // every row a base row, bit for bit the step without LoRA
        let mut case = Case::new(41, 3);
        let mut rng = Lcg(5);
        let width = 2;
        let s = SHAPE;
        let dims = [
            (s.qkv_size(), s.hidden),
            (s.hidden, s.q_size()),
            (2 * s.intermediate, s.hidden),
            (s.hidden, s.intermediate),
        ];
        let arrays: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..2)
            .map(|_| {
                dims.iter()
                    .map(|&(n, k)| {
                        let a: Vec<f32> = rng.vec(width * k).iter().map(|v| v * 0.1).collect();
                        let b_t: Vec<f32> = rng.vec(width * n).iter().map(|v| v * 0.1).collect();
                        (a, b_t)
                    })
                    .collect()
            })
            .collect();
        let lora_layers: Vec<crate::cpu_lora::LoraLayer<'_>> = arrays
            .iter()
            .map(|layer| {
                std::array::from_fn(|m| {
                    Some(LoraWeights {
                        a: &layer[m].0,
                        b_t: &layer[m].1,
                        width,
                        b_cols: &[],
                    })
                })
            })
            .collect();
        let rows = case.ctx.len();
        // the step's success and hidden rows, with every row's block (None: no LoRA)
        let run = |case: &Case, blocks: Option<&[i32]>| {
            let layers = case.layers(Kernels::Panels);
            let mut caches = case.caches.clone();
            let mut views: Vec<&mut [f32]> = caches.iter_mut().map(|c| c.as_mut_slice()).collect();
            let mut hidden = case.hidden.clone();
            let lora = blocks.map(|row_blocks| StepLora {
                layers: &lora_layers,
                row_blocks,
            });
            let r = case.rows();
            let result = forward_step(
                &SHAPE,
                &layers,
                &mut views,
                &CACHE,
                &mut hidden,
                &r,
                2,
                true,
                lora.as_ref(),
            );
            (result.is_ok(), hidden)
        };
        let (ok, plain) = run(&case, None);
        assert!(ok);
        assert_eq!(run(&case, Some(&vec![-1; rows])), (true, plain.clone()));
        let (ok, adapted) = run(&case, Some(&vec![0; rows]));
        assert!(ok && adapted != plain);
        let (ok, hidden) = run(&case, Some(&vec![1; rows])); // only block 0 exists
        let bad = (!ok, hidden == case.hidden);
        assert_eq!(
            bad,
            (true, true),
            "a bad row block is an error that writes nothing"
        );
        // merge: W[o][t] += sum_j B[o][j] A[j][t]
        for (layer, lw) in case.weights.iter_mut().zip(&arrays) {
            for (w, (a, b_t)) in [
                &mut layer.qkv,
                &mut layer.o,
                &mut layer.gate_up,
                &mut layer.down,
            ]
            .into_iter()
            .zip(lw)
            {
                for o in 0..w.n {
                    for t in 0..w.k {
                        let add: f32 = (0..width).map(|j| b_t[j * w.n + o] * a[j * w.k + t]).sum();
                        w.dense[o * w.k + t] += add;
                    }
                }
            }
        }
        let (want, _) = reference(&case.weights, &case.caches, &case.hidden, &case.rows());
        for (j, (&got, &want)) in adapted.iter().zip(&want).enumerate() {
            assert!(
                (got as f64 - want).abs() <= 2e-4 * (1.0 + want.abs()),
                "hidden[{j}]: {got} vs {want}"
            );
        }
    }

    #[test]
    fn qwen3_head_norms_are_applied_to_q_and_k_before_rope() {
        let mut case = Case::new(31, 2);
        let mut rng = Lcg(99);
        let d = SHAPE.head_dim;
        for w in &mut case.weights {
            let norm = |rng: &mut Lcg| (0..d).map(|_| 0.5 + rng.next_f32()).collect();
            w.head_norms = Some([norm(&mut rng), norm(&mut rng)]);
        }
        check(&case, &case.rows(), &case.rows(), Kernels::Panels);
        // a layer with one of the two, or of the wrong width, is refused before any write
        let mut layers = case.layers(Kernels::Panels);
        let half = &case.weights[0].head_norms.as_ref().unwrap()[0][..d / 2];
        for (q_norm, k_norm) in [(layers[0].q_norm, &[][..]), (half, half)] {
            layers[0].q_norm = q_norm;
            layers[0].k_norm = k_norm;
            let mut caches = case.caches.clone();
            let mut views: Vec<&mut [f32]> = caches.iter_mut().map(|c| c.as_mut_slice()).collect();
            let (result, hidden) = case.run(&layers, &mut views, &case.rows(), 2);
            assert!(result.unwrap_err().0.contains("q_norm and k_norm"));
            assert_eq!(hidden, case.hidden);
            assert_eq!(caches, case.caches);
        }
    }

    /// `rows` through `forward_step` over a copy of the case's caches in `E` (f16 or FP8),
    /// against the f64 reference of `per_row` that starts from those values and rounds what it
    /// writes alike (`round`); `ulp`: the element's unit in the last place, relative to a value.
    fn check_rounded<E: KvElement>(
        case: &Case,
        rows: &StepRows<'_>,
        per_row: &StepRows<'_>,
        round: fn(f64) -> f64,
        ulp: f64,
    ) {
        let caches16: Vec<Vec<E>> = case
            .caches
            .iter()
            .map(|c| c.iter().map(|&x| E::from_f32(x)).collect())
            .collect();
        let start: Vec<Vec<f32>> = caches16
            .iter()
            .map(|c| c.iter().map(|x| x.to_f32()).collect())
            .collect();
        let round_head = |head: &mut [f64]| head.iter_mut().for_each(|x| *x = round(*x));
        let (want_hidden, want_caches) =
            reference_rounding_kv(&case.weights, &start, &case.hidden, per_row, round_head);
        let layers = case.layers(Kernels::Panels);
        for threads in [1, 2] {
            let mut caches = caches16.clone();
            let mut views: Vec<&mut [E]> = caches.iter_mut().map(|c| c.as_mut_slice()).collect();
            let mut hidden = case.hidden.clone();
            forward_step(
                &SHAPE,
                &layers,
                &mut views,
                &CACHE,
                &mut hidden,
                rows,
                threads,
                true,
                None,
            )
            .unwrap();
            for (j, (&got, &want)) in hidden.iter().zip(&want_hidden).enumerate() {
                // a rounding may fall the other way from f32 than from f64: a unit of the
                // element's last place in a K/V element, no more
                assert!(
                    (got as f64 - want).abs() <= 2e-3 * (1.0 + want.abs()),
                    "{threads} threads: hidden[{j}]: {got} vs {want}"
                );
            }
            for (layer, (got, want)) in caches.iter().zip(&want_caches).enumerate() {
                for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
                    // the f32 check's 1e-4 (twice: layer 0's roundings feed layer 1) plus a
                    // unit in the element's last place
                    let g = g.to_f32() as f64;
                    assert!(
                        (g - w).abs() <= 2e-4 * (1.0 + w.abs()) + ulp * w.abs(),
                        "layer {layer} cache[{j}]: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn an_f16_cache_is_written_rounded_and_read_as_f32() {
        let case = Case::new(13, 6); // 10 decode-kernel rows
        let f16_round: fn(f64) -> f64 = |x| f16::from_f64(x).to_f64();
        let ulp = 2f64.powi(-10);
        check_rounded::<f16>(&case, &case.rows(), &case.rows(), f16_round, ulp);
        let case = Case::new(11, 0); // a prefill chunk beside gathered decode rows
        let arrays = mixed_arrays(&case);
        let mixed = mixed_rows(&case, false, &arrays);
        check_rounded::<f16>(&case, &mixed, &case.rows(), f16_round, ulp);
    }

    #[test]
    fn an_fp8_cache_is_written_rounded_and_read_as_f32() {
        let fp8_round: fn(f64) -> f64 = |x| F8E4M3::from_f32(x as f32).to_f32() as f64;
        let ulp = 2f64.powi(-3);
        let case = Case::new(13, 6); // 10 decode-kernel rows
        check_rounded::<F8E4M3>(&case, &case.rows(), &case.rows(), fp8_round, ulp);
        let case = Case::new(11, 0); // a prefill chunk beside gathered decode rows
        let arrays = mixed_arrays(&case);
        let mixed = mixed_rows(&case, false, &arrays);
        check_rounded::<F8E4M3>(&case, &mixed, &case.rows(), fp8_round, ulp);
    }

    /// An int8 cache (`cpu_kv_q8`): the step writes each head row quantized with its own scale
    /// and reads every row as its values. Layer 0's inputs do not depend on the cache, so the
    /// rows it writes are exactly `quantize_head` of what the f32 step over the cache's values
    /// writes; the hidden rows and every written row match the f64 reference that quantizes
    /// its writes alike; no other row changes.
    #[test]
    fn an_int8_cache_is_written_per_head_and_read_as_its_values() {
        let d = SHAPE.head_dim;
        let decode = Case::new(13, 6); // 10 decode-kernel rows
        let mixed = Case::new(11, 0); // a prefill chunk beside gathered decode rows
        let arrays = mixed_arrays(&mixed);
        for (case, rows) in [
            (&decode, decode.rows()),
            (&mixed, mixed_rows(&mixed, false, &arrays)),
        ] {
            let start_q: Vec<Vec<Q8>> = case.caches.iter().map(|c| quantize_cache(c, d)).collect();
            let start: Vec<Vec<f32>> = start_q.iter().map(|c| dequantize_cache(c, d)).collect();
            let quantized = |head: &mut [f64]| {
                let values: Vec<f32> = head.iter().map(|&x| x as f32).collect();
                let mut row = vec![Q8(0); d + SCALE_BYTES];
                quantize_head(&mut row, &values);
                let mut back = vec![0f32; d];
                Q8::head_row_to_f32(&row, &mut back);
                head.iter_mut().zip(back).for_each(|(x, y)| *x = y as f64);
            };
            let (reference_hidden, reference_caches) =
                reference_rounding_kv(&case.weights, &start, &case.hidden, &case.rows(), quantized);
            let layers = case.layers(Kernels::Panels);
            let mut want = start_q
                .iter()
                .map(|c| dequantize_cache(c, d))
                .collect::<Vec<_>>();
            let mut views: Vec<&mut [f32]> = want.iter_mut().map(|c| c.as_mut_slice()).collect();
            let (result, _) = case.run(&layers, &mut views, &rows, 2);
            result.unwrap();
            let mut got = start_q.clone();
            let mut views: Vec<&mut [Q8]> = got.iter_mut().map(|c| c.as_mut_slice()).collect();
            let mut hidden = case.hidden.clone();
            let threads = 2;
            forward_step(
                &SHAPE,
                &layers,
                &mut views,
                &CACHE,
                &mut hidden,
                &rows,
                threads,
                true,
                None,
            )
            .unwrap();
            for (j, (&g, &w)) in hidden.iter().zip(&reference_hidden).enumerate() {
                // a rounding may fall the other way from f32 than from f64: a step of int8
                assert!(
                    (g as f64 - w).abs() <= 2e-3 * (1.0 + w.abs()),
                    "hidden[{j}]: {g} vs {w}"
                );
            }
            let dr = d + SCALE_BYTES;
            let half = got[0].len() / 2; // K, then V
            let written: Vec<usize> = rows.slots.iter().map(|&s| s as usize).collect();
            for layer in 0..2 {
                let (g, w, s) = (&got[layer], &want[layer], &start_q[layer]);
                let row_count = half / dr; // (slot, head) rows per half
                for part in 0..2 {
                    for row in 0..row_count {
                        let at = part * half + row * dr;
                        let (g_row, s_row) = (&g[at..at + dr], &s[at..at + dr]);
                        let w_row = &w[(part * row_count + row) * d..][..d];
                        if !written.contains(&(row / SHAPE.num_kv_heads)) {
                            assert_eq!(g_row, s_row, "layer {layer}: an unwritten row changed");
                        } else {
                            if layer == 0 {
                                let mut q = vec![Q8(0); dr];
                                quantize_head(&mut q, w_row);
                                assert_eq!(g_row, &q[..], "layer 0 row {row}");
                            }
                            let mut values = vec![0f32; d];
                            Q8::head_row_to_f32(g_row, &mut values);
                            let step = Q8::head_scale(g_row, d) as f64;
                            let r = &reference_caches[layer][(part * row_count + row) * d..][..d];
                            for (&x, &y) in values.iter().zip(r) {
                                // one step where a rounding fell the other way from f64's
                                let tolerance = step + 2e-3 * (1.0 + y.abs());
                                assert!((x as f64 - y).abs() <= tolerance, "layer {layer}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The case's rows 1-2 (positions 4-5 of one table) as a prefill chunk of 6 keys; rows 0 and
    /// 3 through the decode kernel, or (all_prefill) as chunks of one query too.
    fn mixed_rows<'a>(case: &'a Case, all_prefill: bool, arrays: &'a MixedArrays) -> StepRows<'a> {
        StepRows {
            decode_rows: Some(if all_prefill {
                &[]
            } else {
                &arrays.decode_rows
            }),
            block_tables: if all_prefill {
                &[]
            } else {
                &arrays.decode_tables
            },
            ctx_lens: if all_prefill { &[] } else { &arrays.decode_ctx },
            prefill: Some(PrefillChunks {
                q_starts: if all_prefill {
                    &arrays.all_starts
                } else {
                    &arrays.chunk_start
                },
                q_lens: if all_prefill {
                    &arrays.all_lens
                } else {
                    &arrays.chunk_len
                },
                seq_lens: if all_prefill {
                    &arrays.all_seq_lens
                } else {
                    &arrays.chunk_seq_len
                },
                block_tables: if all_prefill {
                    &case.tables[..]
                } else {
                    &arrays.chunk_table
                },
                max_blocks_per_seq: 3,
            }),
            ..case.rows()
        }
    }

    struct MixedArrays {
        decode_rows: Vec<i64>,
        decode_tables: Vec<i32>,
        decode_ctx: Vec<i32>,
        chunk_start: Vec<i32>,
        chunk_len: Vec<i32>,
        chunk_seq_len: Vec<i32>,
        chunk_table: Vec<i32>,
        all_starts: Vec<i32>,
        all_lens: Vec<i32>,
        all_seq_lens: Vec<i32>,
    }

    fn mixed_arrays(case: &Case) -> MixedArrays {
        let t = &case.tables;
        MixedArrays {
            decode_rows: vec![0, 3],
            decode_tables: [&t[0..3], &t[9..12]].concat(),
            decode_ctx: vec![case.ctx[0], case.ctx[3]],
            chunk_start: vec![1],
            chunk_len: vec![2],
            chunk_seq_len: vec![case.ctx[2]],
            chunk_table: t[3..6].to_vec(),
            // one chunk per row, the two-row chunk's second row as its own chunk of one
            all_starts: vec![0, 1, 2, 3],
            all_lens: vec![1, 1, 1, 1],
            all_seq_lens: case.ctx.clone(),
        }
    }

    #[test]
    fn prefill_chunks_and_gathered_decode_rows_match_the_reference() {
        let case = Case::new(11, 0);
        assert_eq!(case.ctx, [9, 5, 6, 1]); // the layout mixed_rows assumes
        let arrays = mixed_arrays(&case);
        for kernels in [Kernels::Panels, Kernels::BlocksOnly] {
            check(
                &case,
                &mixed_rows(&case, false, &arrays),
                &case.rows(),
                kernels,
            );
            check(
                &case,
                &mixed_rows(&case, true, &arrays),
                &case.rows(),
                kernels,
            );
        }
    }

    #[test]
    fn a_row_attended_twice_or_never_is_an_error() {
        let case = Case::new(3, 0);
        let layers = case.layers(Kernels::PanelsOnly);
        let arrays = mixed_arrays(&case);
        let good = mixed_rows(&case, false, &arrays);
        let twice = [0i64, 1];
        let never = [0i64];
        let outside = [0i64, 4];
        let cases = [
            StepRows {
                decode_rows: Some(&twice),
                ..good
            },
            StepRows {
                decode_rows: Some(&never),
                block_tables: &arrays.decode_tables[..3],
                ctx_lens: &arrays.decode_ctx[..1],
                ..good
            },
            StepRows {
                decode_rows: Some(&outside),
                ..good
            },
            StepRows {
                prefill: None,
                ..good
            },
        ];
        let mut caches = case.caches.clone();
        let mut views: Vec<&mut [f32]> = caches.iter_mut().map(|c| c.as_mut_slice()).collect();
        assert!(case.run(&layers, &mut views, &good, 2).0.is_ok());
        let mut caches = case.caches.clone();
        let mut views: Vec<&mut [f32]> = caches.iter_mut().map(|c| c.as_mut_slice()).collect();
        for rows in &cases {
            let (result, hidden) = case.run(&layers, &mut views, rows, 2);
            assert!(result.is_err());
            assert_eq!(hidden, case.hidden);
        }
        drop(views);
        assert_eq!(caches, case.caches);
    }

    #[test]
    fn rejects_bad_steps_touching_nothing() {
        let case = Case::new(3, 0);
        let layers = case.layers(Kernels::PanelsOnly);
        let good = case.rows();
        let far_slot: Vec<i64> = case.slots.iter().map(|&s| s + 48).collect();
        let zero_ctx: Vec<i32> = case.ctx.iter().map(|_| 0).collect();
        let bad_block: Vec<i32> = (case.tables.iter())
            .map(|&b| if b == 10 { 12 } else { b })
            .collect();
        let cases = [
            StepRows {
                slots: &far_slot,
                ..good
            },
            StepRows {
                ctx_lens: &zero_ctx,
                ..good
            },
            StepRows {
                block_tables: &bad_block,
                ..good
            },
            StepRows {
                cos: &case.cos[1..],
                ..good
            },
        ];
        let mut short = layers.clone(); // a weight of the wrong shape
        short[1].down.panels = &short[1].down.panels[16..];
        let mut caches = case.caches.clone();
        let mut views: Vec<&mut [f32]> = caches.iter_mut().map(|c| c.as_mut_slice()).collect();
        for rows in &cases {
            let (result, hidden) = case.run(&layers, &mut views, rows, 2);
            assert!(result.is_err());
            assert_eq!(hidden, case.hidden);
        }
        let (result, hidden) = case.run(&layers, &mut views[..1], &good, 2); // one cache short
        assert!(result.is_err());
        assert_eq!(hidden, case.hidden);
        let (result, hidden) = case.run(&short, &mut views, &good, 2);
        assert!(result.is_err());
        assert_eq!(hidden, case.hidden);
        let mut no_panels = layers.clone(); // no panels, and no AMX tiles to cover for them
        no_panels[0].gate_up.panels = &[];
        let (result, hidden) = case.run(&no_panels, &mut views, &good, 2);
        assert!(result.is_err());
        assert_eq!(hidden, case.hidden);
        drop(views);
        assert_eq!(caches, case.caches);
    }
}
