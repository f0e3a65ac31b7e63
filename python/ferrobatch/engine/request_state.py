"""RequestState: the asyncio-side life of one request, from submit to its last terminal event.

Invariants:
- Each of the request's `n` sequences receives exactly one terminal event from the scheduler
  (`terminal`); the request leaves the engine's tables once all of them have (`all_terminal`).
- A sequence may finish *locally* earlier (a stop string matched, a detokenizer error): its stream
  ends at once and tokens that still arrive for it are dropped; the scheduler is told to abort it.
- Text goes through the incremental detokenizer, which holds back any suffix that could be the
  start of a stop string, so no prefix of a stop string ever reaches a stream.
- With `params.logprobs` set, each sequence keeps one `TokenLogprob` per token, appended with
  the token (so a delta's logprobs are the slice of its tokens); a token arriving without them
  fails its request (`LogprobMismatch`), it is never silently misaligned.
- With `params.prompt_logprobs` set, prompt position p + 1's entry arrives from the step that
  computed position p; a recomputed position (after a preemption) keeps its first entry. The
  outputs carry the list once every prompt position has its entry.
- A request whose consumer sees only the final output and that has no stop strings defers its
  text (`defer_text`): tokens are only appended per step and detokenized in one call when the
  text is next needed (its finish, or an output being built). Same text, one call per request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ferrobatch.outputs import CompletionOutput, RequestOutput, TokenLogprob
from ferrobatch.sampling_params import SamplingParams

FINISH_NAMES = {1: "stop", 2: "length", 3: "abort", 4: "error"}
FINISH_STOP = 1       # the scheduler's finish code for EOS / a stop token id (and stop aborts)


class LogprobMismatch(RuntimeError):
    """A token reached a request that asked for logprobs without its sampler row's logprobs."""


class SeqState:
    __slots__ = ("index", "detok", "token_ids", "text", "sent_tokens", "sent_text",
                 "finish_reason", "stop_reason", "terminal", "reported", "num_detokenized",
                 "logprobs", "cumulative_logprob")

    def __init__(self, index: int, detok: Any, with_logprobs: bool = False) -> None:
        self.index = index
        self.detok = detok
        self.token_ids: list[int] = []
        self.text = ""
        self.sent_tokens = 0          # delta bookkeeping: how much the consumer has seen
        self.sent_text = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.terminal = False         # the scheduler reported this sequence's terminal event
        self.reported = False         # the consumer has seen the finish
        self.num_detokenized = 0      # token_ids[:num_detokenized] are in `text` (defer_text)
        self.logprobs: list[TokenLogprob] | None = [] if with_logprobs else None
        self.cumulative_logprob = 0.0


class RequestState:
    """Per-request bookkeeping, touched only on the asyncio thread."""

    __slots__ = ("req_id", "request_id", "prompt", "prompt_token_ids", "params", "max_tokens",
                 "seqs", "event", "num_terminal", "abort_sent", "error", "arrival_time",
                 "scheduled_time", "first_token_time", "last_token_time", "finish_time",
                 "num_generated", "final_emitted", "extras", "defer_text", "version",
                 "seen_version", "prompt_logprobs", "prompt_logprobs_missing",
                 "prompt_logprobs_sent", "num_cached_tokens", "pooling", "embedding", "lora",
                 "reasoning_parser")

    def __init__(self, req_id: int, request_id: str, prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams, max_tokens: int,
                 detoks: list[Any], now: float) -> None:
        self.req_id = req_id
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens
        self.seqs = [SeqState(i, d, params.logprobs is not None) for i, d in enumerate(detoks)]
        self.event = asyncio.Event()
        self.num_terminal = 0
        self.abort_sent = False
        self.error: str | None = None
        self.arrival_time = now
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_cached_tokens: int | None = None    # prompt tokens the prefix cache held
        self.num_generated = 0
        self.final_emitted = False
        self.extras: Any = None       # the sampler's per-request extras, when it needs them
        self.defer_text = params.output_kind == "final" and not params.stop
        # bumped by every change a consumer can see (tokens, text, a finish); build_output skips
        # its work when nothing changed since the output it last built
        self.version = 0
        self.seen_version = 0
        self.pooling: Any = None      # an embedding request's PoolingParams
        self.lora: Any = None         # the LoRARequest it runs with, or None
        self.reasoning_parser: str | None = None  # guided: the grammar starts after reasoning
        self.embedding: Any = None    # its pooled vector (float32), once computed
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_logprobs_missing = 0
        self.prompt_logprobs_sent = False
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_token_ids)
            self.prompt_logprobs_missing = len(prompt_token_ids) - 1

    def add_prompt_logprobs(self, entries: list[tuple[int, tuple[int, float, list]]]) -> None:
        """Entries ``(position p, (token, logprob, top))`` scoring prompt token p + 1."""
        table = self.prompt_logprobs
        if table is None:
            raise LogprobMismatch("prompt logprobs reached a request that did not ask for them")
        for pos, (token, logprob, top) in entries:
            if not 0 <= pos < len(table) - 1 or token != self.prompt_token_ids[pos + 1]:
                raise LogprobMismatch(f"prompt logprobs for position {pos} do not match the "
                                      f"prompt")
            if table[pos + 1] is None:
                table[pos + 1] = TokenLogprob(token, logprob, top)
                self.prompt_logprobs_missing -= 1
        self.version += 1

    # -- events from the step hand-off ---------------------------------------------------------

    def add_token(self, seq_index: int, token: int, logprob: Any = None,
                  stop_token: bool = False) -> bool:
        """Append one sampled token (and, when asked for, its ``(token, logprob, top)`` from
        the sampler); returns True when a stop string ended the sequence. ``stop_token``: the
        scheduler ended the sequence on this token (EOS or a stop token id); it stays in
        ``token_ids`` but its text is left out unless ``include_stop_str_in_output`` (as vLLM)."""
        seq = self.seqs[seq_index]
        if seq.finish_reason is not None:
            return False                  # locally finished: the abort is on its way
        if seq.logprobs is not None:
            if logprob is None or logprob[0] != token:
                raise LogprobMismatch(f"token {token} of sequence {seq_index} came without its "
                                      f"logprobs ({logprob!r})")
            seq.logprobs.append(TokenLogprob(token, logprob[1], logprob[2]))
            seq.cumulative_logprob += logprob[1]
        hide = stop_token and not self.params.include_stop_str_in_output
        if hide and self.defer_text:
            self._catch_up_text(seq)      # the tokens before it, whose text is kept
        seq.token_ids.append(token)
        self.num_generated += 1
        self.version += 1
        if hide:
            seq.num_detokenized = len(seq.token_ids)
            return False
        if self.defer_text:
            return False
        step = seq.detok.add(token)
        seq.num_detokenized += 1
        if step.text:
            seq.text += step.text
        if step.stopped:
            seq.finish_reason = "stop"
            rest = seq.detok.output_text[len(seq.text):]
            matched = next((s for s in self.params.stop if rest.startswith(s)), None)
            seq.stop_reason = matched
            if matched is not None and self.params.include_stop_str_in_output:
                seq.text += matched
            return True
        return False

    def finish_seq_locally(self, seq_index: int, reason: str, message: str | None = None) -> None:
        seq = self.seqs[seq_index]
        if seq.finish_reason is None:
            seq.finish_reason = reason
            self.version += 1
            if message and self.error is None:
                self.error = message

    def terminal_event(self, seq_index: int, code: int, message: str | None) -> None:
        """The scheduler's one terminal event for this sequence."""
        seq = self.seqs[seq_index]
        if seq.terminal:
            raise RuntimeError(f"request {self.request_id}: sequence {seq_index} reported "
                               f"terminal twice")
        seq.terminal = True
        self.num_terminal += 1
        self.version += 1
        if seq.finish_reason is not None:
            return                        # it already ended locally (stop string, error)
        reason = FINISH_NAMES.get(code, "error")
        if reason in ("stop", "length"):
            try:
                self._catch_up_text(seq)
                tail = seq.detok.flush()  # text held back for a stop string that never came
            except Exception as exc:  # noqa: BLE001 - a detokenizer failure fails this request
                seq.finish_reason = "error"
                if self.error is None:
                    self.error = f"detokenization failed: {exc}"
                return
            if tail:
                seq.text += tail
            if reason == "stop" and seq.token_ids:
                last = seq.token_ids[-1]
                if last in self.params.stop_token_ids:
                    seq.stop_reason = last
        seq.finish_reason = reason
        if reason == "error" and self.error is None:
            self.error = message or "the request failed in the engine"

    def _catch_up_text(self, seq: SeqState) -> None:
        """Detokenize the tokens a deferred sequence has not turned into text yet."""
        if seq.num_detokenized < len(seq.token_ids):
            pending = seq.token_ids[seq.num_detokenized:]
            seq.num_detokenized = len(seq.token_ids)
            seq.text += seq.detok.add_many(pending)

    @property
    def all_terminal(self) -> bool:
        return self.num_terminal == len(self.seqs)

    @property
    def user_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    # -- what the consumer sees ----------------------------------------------------------------

    def wants_wakeup(self) -> bool:
        """Whether the consumer could see something new: a "final" consumer only cares once
        every sequence has finished, so waking it every step would cost a task switch for
        nothing (hundreds per step in offline batches)."""
        if self.params.output_kind != "final":
            return True
        for s in self.seqs:
            if s.finish_reason is None:
                return False
        return True

    def build_output(self) -> RequestOutput | None:
        """Everything new since the last call, shaped by `params.output_kind`; None if nothing."""
        if self.final_emitted or self.version == self.seen_version:
            return None                   # nothing new (the consumer's usual second look)
        kind = self.params.output_kind
        finished = self.user_finished
        if kind == "final" and not finished:
            return None
        self.seen_version = self.version
        if self.defer_text:
            for s in self.seqs:
                try:
                    self._catch_up_text(s)
                except Exception as exc:  # noqa: BLE001 - the text is lost, the tokens are not
                    if self.error is None:
                        self.error = f"detokenization failed: {exc}"
        changed = [len(s.token_ids) != s.sent_tokens or len(s.text) != s.sent_text
                   or (s.finish_reason is not None and not s.reported) for s in self.seqs]
        if not any(changed):
            return None
        outs: list[CompletionOutput] = []
        for s, new in zip(self.seqs, changed):
            if kind == "delta":
                if not new:
                    continue
                out = CompletionOutput(s.index, s.text[s.sent_text:],
                                       s.token_ids[s.sent_tokens:], s.finish_reason,
                                       s.stop_reason, len(s.token_ids))
                if s.logprobs is not None:
                    out.logprobs = s.logprobs[s.sent_tokens:]
            else:
                out = CompletionOutput(s.index, s.text, list(s.token_ids), s.finish_reason,
                                       s.stop_reason, len(s.token_ids))
                if s.logprobs is not None:
                    out.logprobs = list(s.logprobs)
            if s.logprobs is not None:
                out.cumulative_logprob = s.cumulative_logprob
            outs.append(out)
            s.sent_tokens = len(s.token_ids)
            s.sent_text = len(s.text)
            if s.finish_reason is not None:
                s.reported = True
        if finished:
            self.final_emitted = True
        out = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                            finished=finished, error=self.error, metrics=self.timings(),
                            num_cached_tokens=self.num_cached_tokens)
        if self.embedding is not None:
            out.embedding = self.embedding.tolist()
        if self.prompt_logprobs is not None and self.prompt_logprobs_missing == 0 \
                and not (kind == "delta" and self.prompt_logprobs_sent):
            out.prompt_logprobs = self.prompt_logprobs   # complete: never changes again
            self.prompt_logprobs_sent = True
        return out

    def timings(self) -> dict[str, float]:
        m: dict[str, float] = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            m["ttft_s"] = self.first_token_time - self.arrival_time
        if self.scheduled_time is not None:
            m["queue_time_s"] = self.scheduled_time - self.arrival_time
        if self.finish_time is not None:
            m["e2e_s"] = self.finish_time - self.arrival_time
        return m
