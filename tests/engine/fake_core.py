"""FakeCore: an in-test stand-in for EngineCore (no model, no Rust), for fast engine/server tests.

It speaks EngineCore's interface and honours the scheduler contract: every sequence of every
accepted request gets exactly one terminal event (1 stop, 2 length, 3 abort, 4 error), aborts
are applied at the next step, and `update` semantics are mimicked in `step()`.

The "model" echoes its prompt: sequence `i` of a request emits the prompt's tokens cyclically,
starting `i` tokens in. The tokenizer is one character per token (ids = code points < 512);
token 3 is EOS. A request that asks for logprobs gets `fake_logprob(k)` for its k-th token of a
sequence and N alternatives: the token itself, then the next ids with one nat less each. An
embedding request gets `fake_embedding(prompt)` (pooled as its PoolingParams say) with its
prompt's step.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrobatch.engine.core import StepResult
from ferrobatch.engine.pooling import finish_embedding

EOS = 3


def fake_logprob(k: int) -> float:
    """The logprob FakeCore reports for a sequence's k-th token (k from 0)."""
    return -0.5 - 0.25 * k


def fake_prompt_logprob(position: int) -> float:
    """The logprob FakeCore reports for prompt token `position` + 1."""
    return -1.0 - 0.125 * position


FAKE_HIDDEN = 8


def fake_embedding(prompt: list[int]) -> np.ndarray:
    """FakeCore's pooled hidden state of a prompt, before `dimensions` / `normalize`."""
    return np.array([len(prompt), *prompt[-(FAKE_HIDDEN - 1):]]
                    + [0] * max(0, FAKE_HIDDEN - 1 - len(prompt)), dtype=np.float64)


def fake_top(token: int, k: int, n: int, first: float | None = None) -> list[tuple[int, float]]:
    """N alternatives: `token` with `first` (default fake_logprob(k)), then the next ids with
    one nat less each."""
    first = fake_logprob(k) if first is None else first
    return [((token + j) % 512, first - j) for j in range(n)]


class CharTokenizer:
    bos_token_id = None
    eos_token_ids = [EOS]
    vocab_size = 512

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(ord(c), 511) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))

    def apply_chat_template(self, messages, /, add_generation_prompt: bool = True,
                            **extra) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    n: int
    stop_ids: tuple
    produced: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    scheduled: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    pooling: Any = None


class NoGrammars:
    """FakeCore's grammar compiler: it compiles none (nor applies one), so a guided request runs
    unguided here; the real model's tests check guided decoding."""

    def cached_grammar_for(self, params):
        return None

    def grammar_for(self, params):
        return None


class FakeCore:
    model_name = "fake"
    guided = NoGrammars()
    vocab_size = 512
    hidden_size = FAKE_HIDDEN
    ready_token_id = ord("r")

    def __init__(self, *, max_model_len: int = 256, step_delay_s: float = 0.002,
                 max_running: int = 64, num_blocks: int = 64) -> None:
        self.tokenizer = CharTokenizer()
        self.max_model_len = max_model_len
        self.step_delay_s = step_delay_s
        self.max_running = max_running
        self.num_blocks = num_blocks
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._reqs: dict[int, _Req] = {}
        self._order: list[int] = []
        self.fail_next_step: BaseException | None = None
        self.fail_submit: BaseException | None = None
        self.submitted = 0
        self.drop_logprobs = False      # test hook: report tokens without their logprobs
        self.aborts: list[tuple[int, int, str]] = []

    # asyncio side
    def new_detokenizer(self, prompt_ids, params):
        from ferrobatch.model.detokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=params.stop,
                                      skip_special_tokens=params.skip_special_tokens,
                                      min_tokens=params.min_tokens)

    def submit(self, req_id, ids, p, max_tokens, state) -> None:
        if self.fail_submit is not None:
            exc, self.fail_submit = self.fail_submit, None
            raise exc
        self.submitted += 1
        self._inbox.put(("submit", _Req(req_id, list(ids), max_tokens, p.ignore_eos, p.n,
                                        tuple(p.stop_token_ids), [0] * p.n, [False] * p.n,
                                        logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
                                        pooling=getattr(state, "pooling", None))))
        self._wake.set()

    def abort(self, req_id, seq_index, reason) -> None:
        self.aborts.append((req_id, seq_index, reason))
        self._inbox.put(("abort", (req_id, seq_index, reason)))
        self._wake.set()

    def forget(self, req_id) -> None:
        pass

    def num_tracked(self) -> int:
        return 0

    def wake(self) -> None:
        self._wake.set()

    def check_integrity(self) -> None:
        pass

    def all_blocks_free(self, stats) -> bool:
        return stats["num_free_blocks"] == self.num_blocks - 1

    def stats(self) -> dict[str, Any]:
        running = sum(1 for r in self._reqs.values() if r.scheduled)
        return {"num_running": running, "num_waiting": len(self._reqs) - running,
                "num_free_blocks": self.num_blocks - 1 - len(self._reqs),
                "num_blocks": self.num_blocks, "kv_cache_usage": len(self._reqs) / self.num_blocks,
                "num_preemptions_total": 0, "prefix_cache_queries_total": 0,
                "prefix_cache_hits_total": 0}

    # step thread
    def has_unfinished(self) -> bool:
        return bool(self._reqs) or not self._inbox.empty()

    def wait_for_work(self, timeout_s: float) -> bool:
        got = self._wake.wait(timeout_s)
        self._wake.clear()
        return got

    def step(self) -> StepResult | None:
        if self.fail_next_step is not None:
            exc, self.fail_next_step = self.fail_next_step, None
            raise exc
        ev: list[tuple[int, int, int, int]] = []
        errors: dict[int, str] = {}
        while True:
            try:
                kind, x = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._reqs[x.rid] = x
                self._order.append(x.rid)
            else:
                rid, si, reason = x
                r = self._reqs.get(rid)
                if r is None:
                    continue
                code = {"abort": 3, "stop": 1, "error": 4}[reason]
                for i in range(r.n) if si < 0 else [si]:
                    if not r.done[i]:
                        r.done[i] = True
                        ev.append((rid, i, -1, code))
                        if code == 4:
                            errors[rid] = "aborted with error"
        scheduled = []
        computed = 0                            # tokens this step computes
        logprobs: dict = {}
        prompt_logprobs: dict = {}
        embeddings: dict = {}
        for rid in list(self._order):
            r = self._reqs[rid]
            if not r.scheduled and len(scheduled) >= self.max_running:
                continue
            if not r.scheduled and r.prompt_logprobs is not None:   # the whole prompt at once
                prompt_logprobs[rid] = [
                    (p, (r.prompt[p + 1], fake_prompt_logprob(p),
                         fake_top(r.prompt[p + 1], p, r.prompt_logprobs,
                                  fake_prompt_logprob(p))))
                    for p in range(len(r.prompt) - 1)]
            if not r.scheduled and r.pooling is not None:
                embeddings[rid] = finish_embedding(fake_embedding(r.prompt), r.pooling)
            if not r.scheduled:
                computed += len(r.prompt)       # the whole prompt in its first step
            r.scheduled = True
            scheduled.append(rid)
            for i in range(r.n):
                if r.done[i]:
                    continue
                k = r.produced[i]
                tok = r.prompt[(k + i) % len(r.prompt)]
                if r.logprobs is not None and not self.drop_logprobs:
                    logprobs[(rid, i)] = [(tok, fake_logprob(k), fake_top(tok, k, r.logprobs))]
                r.produced[i] += 1
                computed += k > 0                # a decode (the first token came with the prompt)
                code = 0
                if (tok == EOS and not r.ignore_eos) or tok in r.stop_ids:
                    code = 1
                elif r.produced[i] >= r.max_tokens:
                    code = 2
                if code:
                    r.done[i] = True
                ev.append((rid, i, tok, code))
        for rid in [rid for rid in self._order if all(self._reqs[rid].done)]:
            self._order.remove(rid)
            del self._reqs[rid]
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if not ev and not scheduled:
            return None
        return StepResult([e[0] for e in ev], [e[1] for e in ev], [e[2] for e in ev],
                          [e[3] for e in ev], errors, scheduled, self.stats(), self.step_delay_s,
                          logprobs=logprobs or None, prompt_logprobs=prompt_logprobs or None,
                          num_batched_tokens=computed, embeddings=embeddings or None)
