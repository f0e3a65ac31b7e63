"""Scoring text pairs with an embedding model (vLLM's `LLM.score` / `/score` / `/rerank` for
embedding models): a pair's score is the cosine similarity of its two texts' embeddings.

`pairs_of(text_1, text_2)` pairs the inputs as vLLM does: one text against each of a list, or
two lists of the same length pairwise. `score(engine, pairs, pooling)` embeds every distinct
text once (all of them batched with the engine's other traffic) and returns one
`ScoringRequestOutput` per pair, in order. The pooling is the engine's embedding pooling
(`PoolingParams`: last token by default, as decoder embedding models such as Qwen3-Embedding
are read), always normalized, so the score is the dot product of two unit vectors.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferrobatch.pooling_params import PoolingParams

MAX_PAIRS = 1024


@dataclass
class ScoringOutput:
    """`score`: the cosine similarity of the pair's embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (`outputs.score`), as vLLM's `LLM.score` returns it; `prompt_token_ids`
    are both texts' tokens, the first's then the second's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


Text = str | list[int]


def _texts(value: Any, name: str) -> list[Text]:
    if isinstance(value, str) or (isinstance(value, list) and value and
                                  all(isinstance(t, int) and not isinstance(t, bool)
                                      for t in value)):
        return [value]
    if isinstance(value, (list, tuple)) and value:
        return list(value)
    raise ValueError(f"{name} must be a text, a list of token ids or a non-empty list of them")


def pairs_of(text_1: Any, text_2: Any) -> list[tuple[Text, Text]]:
    """vLLM's pairing: one `text_1` against each `text_2`, or equal-length lists pairwise.
    ValueError for anything else, or for more than MAX_PAIRS pairs."""
    first, second = _texts(text_1, "text_1"), _texts(text_2, "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one "
                         f"text_1, or as many as text_2")
    if len(first) > MAX_PAIRS:
        raise ValueError(f"at most {MAX_PAIRS} pairs per call, got {len(first)}")
    return list(zip(first, second))


async def score(engine: Any, pairs: list[tuple[Text, Text]],
                pooling: PoolingParams | None = None, *,
                truncate_prompt_tokens: int | None = None,
                lora_request: Any = None) -> list[ScoringRequestOutput]:
    """One ScoringRequestOutput per pair, in order (see the module docstring). ValueError for a
    bad text; cancelling the call aborts its embedding requests."""
    pooling = dataclasses.replace(pooling or PoolingParams(), normalize=True)
    distinct: dict[Any, Text] = {}
    for pair in pairs:
        for text in pair:
            distinct.setdefault(_key(text), text)
    tasks = {key: asyncio.ensure_future(engine.embed(
                 text, pooling, truncate_prompt_tokens=truncate_prompt_tokens,
                 lora_request=lora_request)) for key, text in distinct.items()}
    try:
        await asyncio.gather(*tasks.values())
    finally:
        for t in tasks.values():
            t.cancel()
    embedded = {key: t.result() for key, t in tasks.items()}
    outs = []
    for k, (a, b) in enumerate(pairs):
        ea, eb = embedded[_key(a)], embedded[_key(b)]
        value = float(np.dot(np.asarray(ea.outputs.embedding, dtype=np.float64),
                             np.asarray(eb.outputs.embedding, dtype=np.float64)))
        outs.append(ScoringRequestOutput(f"score-{k}", ea.prompt_token_ids + eb.prompt_token_ids,
                                         ScoringOutput(value)))
    return outs


def _key(text: Text) -> Any:
    return text if isinstance(text, str) else ("ids", tuple(text))
