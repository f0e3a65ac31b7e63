"""Request outputs, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class TokenLogprob:
    """Log-probabilities at one generated position (``SamplingParams.logprobs`` asked for them).

    Taken from the model's raw distribution at that position (``log_softmax`` of the logits
    before temperature, penalties, logit bias or top-k/p), whatever the sampling settings.
    `top` holds the `logprobs` most likely tokens, most likely first, as (token id, logprob).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
