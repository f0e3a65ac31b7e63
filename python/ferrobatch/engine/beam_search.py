"""Beam search on top of the engine (vLLM's `LLM.beam_search` and `use_beam_search`), with
transformers' rules, so that it returns what `generate(num_beams=k, do_sample=False)` returns.

Each step sends every live beam to the engine as its own one-token request (its prompt + its
tokens so far; the prefix cache holds the shared blocks) asking for the top `keep` log-
probabilities of the raw distribution, so the beams of one search and of many searches are
batched with all other traffic. `BeamState` is the pure bookkeeping, one step at a time:

- candidates: every beam's top tokens, scored by the beam's summed log-probability plus the
  token's; the best `keep = max(2, 1 + #EOS ids) * k` of them over all beams are kept (so at
  least `k` of them can continue);
- a candidate among the best `k` that ends in EOS (or reaches `max_tokens`) is a finished
  hypothesis scored `sum / generated_len ** length_penalty` (its EOS counted); the `k` best
  finished ones are kept; the best `k` others are the next live beams;
- the search stops at `max_tokens`, when every candidate finished, or once `k` hypotheses are
  finished and either `early_stopping` is True or no live beam can still beat the worst of them
  (False: the best live beam's score at its current length; "never": at `max_tokens` when
  `length_penalty > 0`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrobatch.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from ferrobatch.engine.async_engine import AsyncEngine

EARLY_STOPPING = (True, False, "never")
MAX_BEAM_TOKENS = 1 << 16


@dataclass(frozen=True)
class BeamSearchParams:
    """How to run one beam search: `beam_width` beams, at most `max_tokens` generated tokens
    (None: as many as the context window leaves), transformers' `length_penalty` and
    `early_stopping` (True, False or "never").
    `ignore_eos`: EOS is an ordinary token. The search keeps the top `max(2, 1 + #EOS ids) *
    beam_width` tokens per beam, at most 20 (so beam_width <= 10 with one EOS id)."""

    beam_width: int
    max_tokens: int | None = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.max_tokens is not None and (
                isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                or not 1 <= self.max_tokens <= MAX_BEAM_TOKENS):
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_BEAM_TOKENS}], got "
                             f"{self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not -10.0 <= lp <= 10.0:
            raise ValueError(f"length_penalty must be a number in [-10, 10], got {lp!r}")
        object.__setattr__(self, "length_penalty", float(lp))
        if not any(self.early_stopping is e or (isinstance(e, str) and e == self.early_stopping)
                   for e in EARLY_STOPPING):
            raise ValueError(f"early_stopping must be true, false or \"never\", got "
                             f"{self.early_stopping!r}")

    def candidates_per_beam(self, num_eos_ids: int) -> int:
        """How many top tokens each beam needs (transformers' `beams_to_keep`)."""
        eos = 0 if self.ignore_eos else num_eos_ids
        return max(2, 1 + eos) * self.beam_width


@dataclass
class BeamSearchSequence:
    """One returned beam: `tokens` = prompt + generated (vLLM's), `output_token_ids` the
    generated ones (the EOS that ended it included), `text` their text, `cum_logprob` the sum of
    their log-probabilities, `score` that sum over `generated_len ** length_penalty`."""

    tokens: list[int]
    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str                 # "stop" (EOS) or "length"
    text: str = ""


@dataclass
class BeamSearchOutput:
    """The best `beam_width` finished beams, best first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]
    cum: np.float32


class BeamState:
    """The live and finished beams of one search (see the module docstring); `step` takes each
    live beam's top tokens and says whether the search is over."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: Sequence[int]) -> None:
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else (int(t) for t in eos_token_ids))
        self.keep = params.candidates_per_beam(len(self.eos))
        self.running = [_Beam([], np.float32(0.0))]
        self.finished: list[tuple[np.float32, _Beam]] = []      # (score, beam), best first
        self.generated = 0
        self.improvable = True       # transformers' `is_early_stop_heuristic_unsatisfied`
        self.done = False

    def _length_norm(self, length: int) -> np.float32:
        return np.float32(float(length) ** self.params.length_penalty)

    def step(self, tops: Sequence[Sequence[tuple[int, float]]]) -> bool:
        """`tops[i]`: live beam i's best tokens as (token id, log-probability), best first (at
        least `keep` of them, or the whole vocabulary). Returns True when the search is over."""
        if self.done:
            raise RuntimeError("the beam search is over")
        k, p = self.params.beam_width, self.params
        scored = [(beam.cum + np.float32(lp), i, int(tok))
                  for i, beam in enumerate(self.running) for tok, lp in tops[i][:self.keep]]
        scored.sort(key=lambda c: -c[0])                 # stable: ties keep beam / rank order
        cands = scored[:self.keep]
        last = self.generated + 1 >= p.max_tokens
        hits = [last or tok in self.eos for _, _, tok in cands]
        full = len(self.finished) == k
        if self.improvable and not (full and p.early_stopping is True):
            norm = self._length_norm(self.generated + 1)
            for (cum, i, tok), hit in zip(cands[:k], hits[:k]):
                if hit:
                    beam = _Beam(self.running[i].tokens + [tok], cum)
                    self.finished.append((np.float32(cum / norm), beam))
            self.finished.sort(key=lambda f: -f[0])
            del self.finished[k:]
        self.running = [_Beam(self.running[i].tokens + [tok], cum)
                        for (cum, i, tok), hit in zip(cands, hits) if not hit][:k]
        self.generated += 1
        full = len(self.finished) == k
        if full and self.running:
            length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 \
                else self.generated
            best_possible = self.running[0].cum / self._length_norm(length)
            self.improvable = self.improvable and bool(best_possible > self.finished[-1][0])
        self.done = (not self.improvable or (full and p.early_stopping is True)
                     or all(hits) or not self.running)
        return self.done

    def results(self, prompt_ids: list[int]) -> list[BeamSearchSequence]:
        """The finished beams, best first."""
        return [BeamSearchSequence(
            tokens=list(prompt_ids) + beam.tokens, output_token_ids=list(beam.tokens),
            cum_logprob=float(beam.cum), score=float(score),
            finish_reason="stop" if beam.tokens and beam.tokens[-1] in self.eos else "length")
            for score, beam in self.finished]


async def _top_tokens(engine: "AsyncEngine", prompt: Any, params: SamplingParams,
                      **kw: Any) -> tuple[list[int], list[tuple[int, float]]]:
    """One engine request for the next token's top log-probabilities: (prompt ids, top)."""
    stream = engine.add_request(prompt, params, **kw)
    try:
        out = None
        async for last in stream:       # output_kind "final": one output
            out = last
    finally:
        stream.abort()
    seq = out.outputs[0] if out is not None and out.outputs else None
    if seq is None or seq.finish_reason == "error" or not seq.logprobs:
        raise RuntimeError("beam search: the engine returned no log-probabilities for a beam")
    return list(out.prompt_token_ids), list(seq.logprobs[0].top)


async def beam_search(engine: "AsyncEngine", prompt: Any, params: BeamSearchParams, *,
                      messages: Any = None, chat_options: dict[str, Any] | None = None,
                      lora_request: Any = None) -> BeamSearchOutput:
    """Run one beam search on `engine` (a text or token-id prompt, or chat `messages`; with
    `lora_request`, every step runs with that LoRA adapter).

    Raises ValueError for bad input before the first step; cancelling it aborts the step's
    requests."""
    eos = list(engine.tokenizer.eos_token_ids)
    state = BeamState(params, eos)
    if state.keep > MAX_LOGPROBS:
        most = MAX_LOGPROBS // (state.keep // params.beam_width)
        raise ValueError(f"beam_width must be at most {most} for this model (each beam's top "
                         f"{state.keep} tokens are needed; at most {MAX_LOGPROBS} can be asked "
                         "for)")
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=state.keep,
                                 output_kind="final")
    if lora_request is not None:           # its adapter's files read off the event loop
        await engine.prepare(None, lora_request=lora_request)
    prompt_ids, top = await _top_tokens(engine, prompt, step_params, messages=messages,
                                        chat_options=chat_options, lora_request=lora_request)
    room = engine.max_model_len - len(prompt_ids)
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=room)
        state.params = params
    elif params.max_tokens > room:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens})"
                         f" exceeds the context window of {engine.max_model_len} tokens")
    tops = [top]
    while not state.step(tops):
        tasks = [asyncio.ensure_future(_top_tokens(engine, prompt_ids + beam.tokens,
                                                   step_params, lora_request=lora_request))
                 for beam in state.running]
        try:
            tops = [t for _, t in await asyncio.gather(*tasks)]
        finally:
            for task in tasks:          # one failed (or we were cancelled): stop the others
                task.cancel()
    tokenizer = engine.tokenizer
    sequences = state.results(prompt_ids)
    for s in sequences:
        s.text = tokenizer.decode(s.output_token_ids, skip_special_tokens=True)
    text = prompt if isinstance(prompt, str) else None
    return BeamSearchOutput(text, prompt_ids, sequences)
