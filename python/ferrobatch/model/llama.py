"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Gemma 3) over one flat batch of
tokens.

A step's T tokens (decode tokens and prefill chunks of different sequences) go through every
linear layer together; attention writes the new K/V into the paged cache at ``slot_mapping`` and
reads each sequence's context through its block table (see ``runtime.attention``). Logits are
computed only at ``logits_indices``. Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.rope import ApplyRotary, RotaryEmbedding


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (computed in float32, like the reference implementation)."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def add_then_norm(norm: nn.Module, x: torch.Tensor,
                  delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))``: a residual add and the norm after it. A norm module
    with its own ``add_and_norm`` (``runtime.cuda_elementwise``: one fused kernel) does both."""
    fused = getattr(norm, "add_and_norm", None)
    if fused is not None:
        return fused(x, delta)
    total = x + delta
    return total, norm(total)


class SiluAndMul(nn.Module):
    """``silu(x[..., :I]) * x[..., I:]``: the SwiGLU activation on a fused gate/up output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(x[..., :I]) * x[..., I:]``: the GeGLU activation (Gemma) on a fused gate/up
    output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class LlamaAttention(nn.Module):
    """GQA self-attention with fused QKV projection and RoPE (with ``config.qk_norm``, each
    head's q and k are RMS-normed first: ``q_norm`` / ``k_norm``, Qwen3)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias, device=device, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False, device=device, dtype=dtype)
        self.rope = ApplyRotary()
        self.use_rope = True   # False: a NoPE layer (SmolLM3), q and k attend unrotated
        # keys each query attends, its own included (a sliding-window layer, Gemma 3), or None:
        # the whole context; ``local_rope``: rotates with the model's ``local_rotary`` tables
        self.window: int | None = None
        self.local_rope = False
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device, dtype)
        self.lora = None     # runtime.lora.LayerLora once LoRA is installed

    def project(self, hidden) -> torch.Tensor:
        """The fused QKV projection ``[T, (Hq + 2 Hkv) * D]`` (``split_qkv`` gives its views)."""
        qkv = self.qkv_proj(hidden)
        return qkv if self.lora is None else self.lora.add("qkv_proj", hidden, qkv)

    def output(self, attn_out: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention ``[T, Hq * D]`` -> ``[T, hidden]``."""
        out = self.o_proj(attn_out)
        return out if self.lora is None else self.lora.add("o_proj", attn_out, out)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])`` of a QKV projection (not rotated:
        ``attend`` rotates q and k)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(num_tokens, self.num_heads, self.head_dim),
                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))

    def attend(self, qkv, rope_tables, kv_cache, attn_meta, backend) -> torch.Tensor:
        """Rotates q and k of the projection ``qkv``, writes k / v into the paged cache and
        attends: ``[T, Hq * D]``, before o_proj. When the backend allows it
        (``rotary_with_kv_write``), a rotary module with ``rotate_and_cache``
        (``runtime.cuda_elementwise``: one kernel, in place) rotates and writes together."""
        q, k, v = self.split_qkv(qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.use_rope:
            backend.write_kv(kv_cache, k, v, attn_meta)
            return self._attention(backend, q, kv_cache, attn_meta)
        fused = getattr(self.rope, "rotate_and_cache", None) \
            if getattr(backend, "rotary_with_kv_write", False) else None
        if fused is None or not fused(q, k, v, rope_tables, kv_cache, attn_meta.slot_mapping):
            q, k = self.rope(q, k, rope_tables)
            backend.write_kv(kv_cache, k, v, attn_meta)
        return self._attention(backend, q, kv_cache, attn_meta)

    def _attention(self, backend, q, kv_cache, attn_meta) -> torch.Tensor:
        if self.window is None:
            out = backend.forward(q, kv_cache, attn_meta, self.scale)
        else:   # only backends with ``supports_window`` take it (ModelRunner checks)
            out = backend.forward(q, kv_cache, attn_meta, self.scale, window=self.window)
        return out.reshape(q.shape[0], self.q_size)


class LlamaMLP(nn.Module):
    """SwiGLU (GeGLU with ``config.hidden_act`` "gelu_tanh") feed-forward with fused gate/up
    projection."""

    def __init__(self, config: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False,
                                      device=device, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False,
                                   device=device, dtype=dtype)
        self.act = GeluTanhAndMul() if config.hidden_act == "gelu_tanh" else SiluAndMul()
        self.lora = None     # runtime.lora.LayerLora once LoRA is installed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.down_proj(self.act(self.gate_up_proj(x)))
        hidden = self.act(self.lora.add("gate_up_proj", x, self.gate_up_proj(x)))
        return self.lora.add("down_proj", hidden, self.down_proj(hidden))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + pre-norm MLP, each with a residual connection (with
    ``config.sandwich_norms``, Gemma 3, each output is RMS-normed too before its add:
    ``attn_out_norm`` / ``mlp_out_norm``).

    The residual stream travels between layers as ``(residual, delta)``: the stream before the
    last MLP output is added, and that output. Each residual add is done by the norm after it
    (``add_then_norm``: the next layer's input norm, or the final norm), so with the fused CUDA
    kernels it costs no kernel of its own; the arithmetic is the same, in the same order.
    """

    def __init__(self, config: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = LlamaMLP(config, device, dtype)
        self.attn_out_norm = self.mlp_out_norm = None
        if config.sandwich_norms:
            self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
            self.mlp_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)

    # The layer in three parts; runtime.piecewise_graphs captures begin and finish in CUDA graphs
    # and runs attention (self_attn.attend: rotary, the KV write, attention) between them.
    def forward(self, residual, delta, rope_tables, kv_cache, attn_meta,
                backend) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual, delta)`` in (``delta`` None for the first layer) -> the same out."""
        residual, qkv = self.begin(residual, delta)
        return self.finish(residual, self.self_attn.attend(qkv, rope_tables, kv_cache, attn_meta,
                                                           backend))

    def begin(self, residual, delta) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before attention: the residual stream (``residual + delta``, or
        ``residual`` when ``delta`` is None) and the QKV projection of its norm."""
        if delta is None:
            normed = self.input_layernorm(residual)
        else:
            residual, normed = add_then_norm(self.input_layernorm, residual, delta)
        return residual, self.self_attn.project(normed)

    def finish(self, residual, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after attention (``attn_out [T, Hq * D]``): ``(residual, mlp output)``,
        whose sum is the next residual stream."""
        out = self.self_attn.output(attn_out)
        if self.attn_out_norm is not None:
            out = self.attn_out_norm(out)
        residual, normed = add_then_norm(self.post_attention_layernorm, residual, out)
        out = self.mlp(normed)
        return residual, out if self.mlp_out_norm is None else self.mlp_out_norm(out)


# per thread: id(model) -> the (attention backend, fused layers) its forward runs with
# (LlamaForCausalLM.bound); a module-level local, so that a model stays deep-copyable
_bindings = threading.local()


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; ``attn_backend`` decides how paged attention runs (and
    ``fused_layers``, when set, runs the steps it accepts), unless the calling thread is
    inside ``bound(...)``, which a ModelRunner enters with its own: engines sharing one loaded
    model each keep theirs."""

    def __init__(self, config: ModelConfig, attn_backend=None, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend
        # On the meta device (the loader's: every weight is loaded afterwards) no initialiser
        # runs and no table is computed: ops on meta tensors (nn.Embedding's normal_, the rotary
        # tables' math) go through torch's Python references, whose first call imports
        # torch._dynamo, inductor and sympy: ~1.1 s of start-up (measured) and ~900 more modules
        # for the garbage collector to walk.
        meta = device is not None and torch.device(device).type == "meta"
        weight = torch.empty(config.vocab_size, config.hidden_size, device=device,
                             dtype=dtype) if meta else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device,
                                         dtype=dtype, _weight=weight)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, device, dtype) for _ in range(config.num_layers))
        for i in config.nope_layers:
            self.layers[i].self_attn.use_rope = False
        for i in config.sliding_layers:
            self.layers[i].self_attn.window = config.sliding_window
            self.layers[i].self_attn.local_rope = config.local_rope_theta is not None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        # (on meta the loader makes the tables on the real device, after `_materialize`)
        self.rotary = self.local_rotary = None
        if not meta:
            self.make_rotary(device)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                     device=device, dtype=dtype)
        # A faster module computing the same projection (set by runtime.cpu_linear), or None.
        self.packed_lm_head: nn.Module | None = None
        # Runs every decoder layer of the steps it accepts in one call (set by
        # runtime.cpu_decoder for CPU decode steps), or None.
        self.fused_layers = None
        # Module path -> GGUF blocks (model.block_weights) of the linear modules a loader with
        # gguf_blocks=True left on the meta device, and the tied LM head's: a ModelRunner takes
        # them (runtime.model_runner), packing them for the CPU block kernels or dequantizing
        # them into the modules. None otherwise.
        self.gguf_block_weights: dict | None = None
        # The LoRA adapters the layers can apply (runtime.lora.install_lora), or None.
        self.lora = None
        # Times the weights were replaced in place (runtime.weight_update): what a FusedLayers
        # built earlier (views of the replaced arrays) compares to know it is stale.
        self.weights_generation = 0

    def make_rotary(self, device) -> None:
        """Computes the RoPE tables on ``device``: ``rotary``, and ``local_rotary`` for the
        sliding-window layers where they have a base of their own (Gemma 3), else None."""
        config = self.config
        self.rotary = RotaryEmbedding(config, device)
        local = config.local_rope_theta
        self.local_rotary = None if local is None or local == config.rope_theta else \
            RotaryEmbedding(dataclasses.replace(config, rope_theta=local, rope_scaling=None),
                            device)

    def layer_rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list:
        """Each layer's RoPE tables for ``positions`` (one lookup per table, shared)."""
        tables = self.rotary.tables(positions, dtype)
        if self.local_rotary is None:
            return [tables] * len(self.layers)
        local = self.local_rotary.tables(positions, dtype)
        return [local if layer.self_attn.local_rope else tables for layer in self.layers]

    @contextlib.contextmanager
    def bound(self, attn_backend, fused_layers):
        """This thread's forward passes inside the block run with ``attn_backend`` and
        ``fused_layers`` (None: layer by layer), whatever the model's attributes hold."""
        pairs = _bindings.__dict__.setdefault("pairs", {})
        key = id(self)
        outer = pairs.get(key)
        pairs[key] = (attn_backend, fused_layers)
        try:
            yield
        finally:
            if outer is None:
                del pairs[key]
            else:
                pairs[key] = outer

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection (the embedding matrix when tied)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        if not hasattr(self.embed_tokens, "weight"):    # a QuantizedEmbedding's GGUF rows
            raise RuntimeError("the tied LM head's matrix is kept in GGUF blocks: a ModelRunner "
                               "packs them for the CPU kernels or dequantizes them")
        return self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor | None = None):
        """Runs T tokens -> float32 logits ``[S, vocab]`` at ``logits_indices``; with
        ``hidden_indices``, also the final-normed hidden states ``[E, hidden]`` at those rows
        (their logits cost ``E x vocab`` floats, so the caller computes them in pieces)."""
        pairs = getattr(_bindings, "pairs", None)
        pair = pairs.get(id(self)) if pairs else None
        backend, fused = pair if pair is not None else (self.attn_backend, self.fused_layers)
        if backend is None:
            raise RuntimeError("LlamaForCausalLM.attn_backend is not set")
        lora = None if self.lora is None else self.lora.active
        fused_lora = None if lora is None or fused is None else lora.fused()
        if fused is not None and fused.accepts(attn_meta) and \
                (lora is None or fused_lora is not None):
            hidden = fused.embed_and_run(input_ids, positions, kv_caches, attn_meta,
                                         lora=fused_lora)
            if hidden_indices is None:
                return self.compute_logits(fused.final_norm(hidden, logits_indices))
            return self.logits_from_hidden(hidden, logits_indices, hidden_indices)
        residual, delta = self.embed(input_ids), None
        for layer, kv_cache, rope_tables in zip(self.layers, kv_caches,
                                                self.layer_rope_tables(positions, residual.dtype),
                                                strict=True):
            residual, delta = layer(residual, delta, rope_tables, kv_cache, attn_meta,
                                    backend)
        return self.logits_from_hidden(residual, logits_indices, hidden_indices, delta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ``input_ids`` (times ``config.embedding_scale``, Gemma)."""
        hidden = self.embed_tokens(input_ids)
        scale = self.config.embedding_scale
        return hidden if scale == 1.0 else hidden * scale

    def logits_from_hidden(self, hidden: torch.Tensor, logits_indices: torch.Tensor,
                           hidden_indices: torch.Tensor | None = None,
                           delta: torch.Tensor | None = None):
        """The end of ``forward`` from the last layer's output ``hidden [T, hidden]`` (with
        ``delta``, the output is ``hidden + delta``: added on the chosen rows only, in the final
        norm's kernel)."""
        rows = logits_indices if hidden_indices is None \
            else torch.cat([logits_indices, hidden_indices])
        if delta is None:
            normed = self.norm(hidden[rows])
        else:
            normed = add_then_norm(self.norm, hidden[rows], delta[rows])[1]
        if hidden_indices is None:
            return self.compute_logits(normed)
        num_samples = logits_indices.shape[0]
        return self.compute_logits(normed[:num_samples]), normed[num_samples:]

    def compute_logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` of final-normed hidden states ``[N, hidden]``."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(normed_hidden).float()
        return F.linear(normed_hidden, self.lm_head_weight).float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor],
                           device: torch.device | str | None = None) -> None:
        """Loads weights named as in Hugging Face's LlamaForCausalLM (fuses q/k/v and gate/up),
        taking each out of ``state`` as it goes. A parameter still on the meta device (a model
        built there) becomes the tensor itself, converted to its dtype on ``device`` (no copy
        where it already is that), so loading holds about one copy of the weights at a time,
        not the checkpoint's and the model's; any other parameter is copied into.

        A meta tensor in ``state`` leaves its parameter on the meta device (a linear weight the
        CPU kernels read from GGUF blocks, ``loader.load_model(gguf_blocks=True)``).

        Raises ValueError on a missing tensor or a shape mismatch.
        """
        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"checkpoint lacks tensor {name}")
            return state.pop(name)

        def copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
            if value.is_meta:       # a placeholder: the weight stays unmade (load_gguf_blocks)
                if not param.is_meta:
                    raise ValueError(f"{name}: a placeholder for a weight already loaded")
                return
            if not param.is_meta:
                param.copy_(value)
                return
            module_name, _, attr = name.removeprefix("model.").rpartition(".")
            module = self.get_submodule(module_name) if module_name != "lm_head" else self.lm_head
            module._parameters[attr] = nn.Parameter(
                value.to(device=device, dtype=param.dtype).contiguous(), requires_grad=False)

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            if any(p.is_meta for p in parts):   # placeholders (torch.cat of meta tensors runs
                rows = sum(p.shape[0] for p in parts)   # Python refs that import dynamo: ~2 s)
                return torch.empty(rows, *parts[0].shape[1:], device="meta")
            return torch.cat(parts)

        copy(self.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        copy(self.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if self.lm_head is not None:
            copy(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            copy(attn.qkv_proj.weight, cat(qkv), f"{p}self_attn.qkv_proj.weight")
            if attn.qkv_proj.bias is not None:
                bias = [take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
                copy(attn.qkv_proj.bias, torch.cat(bias), f"{p}self_attn.qkv_proj.bias")
            copy(attn.o_proj.weight, take(f"{p}self_attn.o_proj.weight"), f"{p}self_attn.o_proj.weight")
            if attn.q_norm is not None:
                for norm, n in ((attn.q_norm, "q_norm"), (attn.k_norm, "k_norm")):
                    copy(norm.weight, take(f"{p}self_attn.{n}.weight"), f"{p}self_attn.{n}.weight")
            gate_up = cat([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")])
            copy(mlp.gate_up_proj.weight, gate_up, f"{p}mlp.gate_up_proj.weight")
            copy(mlp.down_proj.weight, take(f"{p}mlp.down_proj.weight"), f"{p}mlp.down_proj.weight")
            copy(layer.input_layernorm.weight, take(f"{p}input_layernorm.weight"), f"{p}input_layernorm.weight")
            copy(layer.post_attention_layernorm.weight, take(f"{p}post_attention_layernorm.weight"),
                 f"{p}post_attention_layernorm.weight")
            for norm, n in ((layer.attn_out_norm, "attn_out_norm"),
                            (layer.mlp_out_norm, "mlp_out_norm")):
                if norm is not None:     # Gemma 3's (model_layout.model_name)
                    copy(norm.weight, take(f"{p}{n}.weight"), f"{p}{n}.weight")
