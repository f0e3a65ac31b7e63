"""Request outputs, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from dataclasses import dataclass, field
from typing import Any, NamedTuple

FINISH_REASONS = ("stop", "length", "abort", "error")


class Logprob(NamedTuple):
    """One token's entry in a `TokenLogprob` read as vLLM's dict: its log-probability, its rank
    (1 = most likely; None when it is not among the `top` and its rank was not computed) and
    its text (None: not decoded here, use the tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprob:
    """Log-probabilities at one generated position (``SamplingParams.logprobs`` asked for them).

    Taken from the model's raw distribution at that position (``log_softmax`` of the logits
    before temperature, penalties, logit bias or top-k/p), whatever the sampling settings.
    `top` holds the `logprobs` most likely tokens, most likely first, as (token id, logprob).

    It also reads as vLLM's per-position dict, token id -> `Logprob`, over the chosen token and
    the `top` ones: ``out.logprobs[i][out.token_ids[i]].logprob``, ``.items()``, ``len()``.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def _as_dict(self) -> dict[int, Logprob]:
        table = {tok: Logprob(lp, rank) for rank, (tok, lp) in enumerate(self.top, start=1)}
        if self.token_id not in table:
            table[self.token_id] = Logprob(self.logprob, None)
        return table

    def __getitem__(self, token_id: int) -> Logprob:
        return self._as_dict()[token_id]

    def __contains__(self, token_id: object) -> bool:
        return token_id in self._as_dict()

    def __iter__(self) -> Iterator[int]:
        return iter(self._as_dict())

    def __len__(self) -> int:
        return len(self._as_dict())

    def keys(self) -> KeysView[int]:
        return self._as_dict().keys()

    def values(self) -> ValuesView[Logprob]:
        return self._as_dict().values()

    def items(self) -> ItemsView[int, Logprob]:
        return self._as_dict().items()

    def get(self, token_id: int, default: Any = None) -> Any:
        return self._as_dict().get(token_id, default)


@dataclass
class CompletionOutput:
    """One of a request's `n` sequences.

    `text`/`token_ids` are the whole output so far ("cumulative"/"final") or only what is new
    since the previous yield ("delta"). `finish_reason` is None while running, else one of
    "stop", "length", "abort", "error". `stop_reason` is the stop string or stop token id that
    ended the sequence, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int = 0   # tokens generated so far by this sequence (not just this delta)
    # one entry per token of `token_ids` (same cumulative / delta slice) when logprobs were asked
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None   # sum over every token so far (not just this delta)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What `AsyncEngine.generate` yields and `LLM.generate` returns, one per request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None           # set when finish_reason is "error"
    metrics: dict[str, float] = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which
    # nothing predicts), once the whole prompt has been computed; a "delta" stream gets it once
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # prompt tokens found in the prefix cache when the request was first scheduled (as vLLM's
    # field); None until then
    num_cached_tokens: int | None = None
    # an embedding request's pooled vector (`AsyncEngine.embed`), once its prompt is computed
    embedding: list[float] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
