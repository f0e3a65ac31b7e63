"""ModelConfig: the architecture hyper-parameters every loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3", "gemma3")
# the MLP's gate activations: SiLU (SwiGLU) and GELU's tanh form (GeGLU, Gemma)
HIDDEN_ACTS = ("silu", "gelu_tanh")
# architectures whose GGUF converter permutes the Q / K rows for llama.cpp's interleaved RoPE
GGUF_PERMUTED_QK = ("llama", "granite", "smollm3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3,
    Phi-3 / Phi-4: the same layers, its checkpoints fuse q/k/v and gate/up as ferrobatch does;
    Granite 3: four scalars more; SmolLM3: no RoPE in some layers; Gemma 3: sliding-window
    layers with a RoPE base of their own, RMSNorms on the attention and MLP outputs too, GeGLU,
    scaled embeddings: ``model.gemma3``).

    `qk_norm`: each head's query and key are RMS-normed (own weights per layer, over
    `head_dim`) before the rotary embedding, as in Qwen3. `rotary_dim`: RoPE over part of each
    head; the model keeps q and k in the order of ``model.partial_rotary``."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rotary_dim: int | None = None   # RoPE over the first this-many dims of a head (None: all)
    # Granite's scalars (1.0 and None elsewhere): the embeddings are multiplied by
    # `embedding_multiplier`, each layer's attention and MLP outputs by `residual_multiplier`
    # before their residual add, the logits divided by `logits_scaling`; `attention_multiplier`
    # replaces head_dim ** -0.5 as the attention scale. model_layout folds all but the last
    # into the weights.
    # layers whose attention takes no RoPE at all (SmolLM3: every fourth, "NoPE")
    nope_layers: tuple[int, ...] = ()
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # Gemma 3: the layers in `sliding_layers` attend to the last `sliding_window` positions
    # (their own included) with RoPE base `local_rope_theta` (None: `rope_theta`), the others to
    # the whole context; `sandwich_norms`: each layer RMS-norms its attention and MLP outputs
    # before their residual adds too; `embedding_scale`: token embeddings times this as they are
    # looked up (not folded: the table is also the tied LM head).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embedding_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"model config: hidden_act {self.hidden_act!r} is not one of "
                             f"{', '.join(HIDDEN_ACTS)}")
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("model config: sliding_layers need a positive sliding_window")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"model config: sliding_layers {self.sliding_layers} outside the "
                             f"{self.num_layers} layers")
        if self.rotary_dim is not None and not (
                0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
                and (self.head_dim - self.rotary_dim) % 2 == 0):
            raise ValueError(f"model config: rotary_dim {self.rotary_dim} must be even, positive "
                             f"and at most head_dim {self.head_dim}, leaving an even rest")

    @property
    def attention_scale(self) -> float:
        """The factor of q . k in attention: ``attention_multiplier`` or ``head_dim ** -0.5``."""
        return self.head_dim ** -0.5 if self.attention_multiplier is None \
            else self.attention_multiplier

    def window_of(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (None: the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def rope_dim(self) -> int:
        """Dims of each head that RoPE rotates (all of them but for partial rotary, Phi-4-mini)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size
