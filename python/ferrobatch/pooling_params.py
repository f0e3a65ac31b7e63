"""PoolingParams and the outputs of `LLM.embed` / `AsyncEngine.embed` (vLLM's names).

An embedding is the model's final-normed hidden state of the prompt, pooled: the last token's
("last", how decoder-only embedding models such as Qwen3-Embedding and e5-mistral are read) or
the mean over every prompt token ("mean"); then cut to its first `dimensions` values
(Matryoshka models) and scaled to unit length when `normalize`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How one prompt becomes an embedding (see the module docstring)."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}")


@dataclass
class EmbeddingOutput:
    """`embedding`: the pooled vector as floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (`outputs.embedding`), as vLLM's `LLM.embed` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def of(cls, out: Any) -> "EmbeddingRequestOutput":
        """From the final `RequestOutput` of an embedding request; RuntimeError when it
        failed or carries no embedding."""
        if out is None or out.error or out.embedding is None:
            why = out.error if out is not None and out.error else "no embedding came back"
            raise RuntimeError(f"embedding failed: {why}")
        return cls(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.embedding))
