"""The ferrobatch systems of the offline benchmark: `ferrobatch` and `ferrobatch-static`.

Both drive the real `ferrobatch.AsyncEngine` (Rust scheduler, model runner, sampler, step thread,
incremental detokenization — the engine as shipped) with token-id prompts and
`SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)`.

- `ferrobatch`: every request is submitted at once; the engine re-forms the batch every step
  (up to `max_num_seqs` sequences, `max_num_batched_tokens` tokens per step).
- `ferrobatch-static`: the same engine, same options, but the bench hands it `max_num_seqs`
  requests at a time and waits until the whole group has finished before submitting the next
  group: freed slots stay empty until the longest request of the group is done. The engine has no
  static mode of its own, so this is the ablation of iteration-level refill, all else equal.

Per-step batch occupancy comes from the engine's public observer hook (`on_step_tokens`: tokens
sampled in that step = sequences that produced a token) and `AsyncEngine.stats()` (scheduler
snapshot taken after the step: `num_running`).
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Callable

from bench_models import model_ref
from workloads import Request, Workload

class StepRecorder:
    """EngineObserver that records, per step that sampled tokens: time, tokens, running seqs."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.t: list[float] = []
        self.tokens: list[int] = []
        self.running: list[int] = []
        self.enabled = False

    # EngineObserver hooks (duck-typed; the engine calls only the ones it knows)
    def on_scheduled(self, queue_time_s, num_prompt_tokens):
        pass

    def on_first_token(self, ttft_s):
        pass

    def on_finished(self, finish_reason, e2e_s, num_prompt_tokens, num_generated):
        pass

    def on_step_tokens(self, num_tokens, inter_token_latencies):
        if self.enabled:
            self.t.append(time.perf_counter())
            self.tokens.append(num_tokens)
            self.running.append(int(self.engine.stats().get("num_running", -1)))

    def reset(self) -> None:
        self.t, self.tokens, self.running = [], [], []


class FerrobatchRunner:
    """Owns one AsyncEngine (and its event loop) for a sequence of measured runs."""

    def __init__(self, w: Workload, max_num_seqs: int, **extra_options) -> None:
        import ferrobatch  # noqa: F401  (fail early with a clear import error)
        from ferrobatch.engine.async_engine import AsyncEngine

        self.w = w
        self.options = dict(model=model_ref(w), device=w.device, dtype=w.dtype,
                            max_num_seqs=max_num_seqs, **w.engine_options, **extra_options)
        self.loop = asyncio.new_event_loop()
        self.engine = AsyncEngine(**self.options)
        t0 = time.perf_counter()
        self.loop.run_until_complete(self.engine.start())
        self.load_s = time.perf_counter() - t0
        self.recorder = StepRecorder(self.engine)   # duck-typed EngineObserver
        self.engine.add_observer(self.recorder)
        self.max_num_seqs = max_num_seqs

    async def _one(self, r: Request, check: bool = True) -> int:
        from ferrobatch.sampling_params import SamplingParams
        p = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0,
                           output_kind="final")
        last = None
        async for out in self.engine.generate(list(r.prompt_ids), p):
            last = out
        if last is None or last.error:
            raise RuntimeError(f"ferrobatch request failed: {getattr(last, 'error', None)}")
        o = last.outputs[0]
        if check and (o.finish_reason != "length" or o.num_output_tokens != r.output_len):
            raise RuntimeError(f"ferrobatch generated {o.num_output_tokens} tokens "
                               f"({o.finish_reason}), expected {r.output_len}")
        return o.num_output_tokens

    async def _run(self, reqs: list[Request], static: bool,
                   progress: Callable[[int], None] | None) -> float:
        async def tracked(r: Request) -> int:
            n = await self._one(r)
            if progress:
                progress(1)
            return n

        t0 = time.perf_counter()
        if static:
            for i in range(0, len(reqs), self.max_num_seqs):
                await asyncio.gather(*(tracked(r) for r in reqs[i:i + self.max_num_seqs]))
        else:
            await asyncio.gather(*(tracked(r) for r in reqs))
        return time.perf_counter() - t0

    def run(self, reqs: list[Request], static: bool = False,
            progress: Callable[[int], None] | None = None) -> dict:
        self.recorder.reset()
        self.recorder.enabled = True
        steps0 = self._num_steps()
        try:
            elapsed = self.loop.run_until_complete(self._run(reqs, static, progress))
        finally:
            self.recorder.enabled = False
        total = sum(r.output_len for r in reqs)
        rec = self.recorder
        steps = self._num_steps() - steps0 if steps0 is not None else None
        return {"elapsed_s": elapsed, "output_tokens": total, "generated_tokens": total,
                "wasted_tokens": 0, "num_steps": steps,
                "num_sampling_steps": len(rec.tokens),
                "occupancy": list(rec.tokens), "running": list(rec.running),
                "step_times": [b - a for a, b in zip(rec.t, rec.t[1:])],
                "params": {"mode": "static (group of max_num_seqs, wait, next)" if static
                           else "continuous", **{k: v for k, v in self.options.items()
                                                 if k != "model"},
                           "model": self.w.model}}

    def _num_steps(self) -> int | None:
        lt = getattr(self.engine, "_loop_thread", None)
        return getattr(lt, "num_steps", None)

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.engine.shutdown())
        finally:
            self.loop.close()
            self.engine = None
            gc.collect()
            try:
                import torch
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except ImportError:
                pass
