"""The ferrobatch systems of the offline benchmark: `ferrobatch`, `-static`, `-eager`,
`-decodegraphs`, `-nativeprefill`, `-splitmixed`, `-rotaryapart`, `-reducepass`,
`-refill4`, `-torchops`, `-nodraft`, `-kv16`, `-kv8`, `-kvi8`, `-f32panels`.

Both drive the real engine through `ferrobatch.LLM.generate` (Rust scheduler, model runner,
sampler, step thread, incremental detokenization — the engine as shipped) with token-id prompts and
`SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)`.

- `ferrobatch`: every request is submitted at once; the engine re-forms the batch every step
  (up to `max_num_seqs` sequences, `max_num_batched_tokens` tokens per step).
- `ferrobatch-static`: the same engine, same options, but the bench hands it `max_num_seqs`
  requests at a time and waits until the whole group has finished before submitting the next
  group: freed slots stay empty until the longest request of the group is done. The engine has no
  static mode of its own, so this is the ablation of iteration-level refill, all else equal.
- `ferrobatch-eager`: `ferrobatch` with `cuda_graphs=False` (on a GPU every decode step runs
  eagerly instead of replaying a captured graph; on the CPU nothing differs).
- `ferrobatch-decodegraphs`: `ferrobatch` with `piecewise_max_tokens=0` (on a GPU prefill and
  mixed steps run eagerly instead of replaying the model's pieces between attention calls; on the
  CPU nothing differs).
- `ferrobatch-nativeprefill`: `ferrobatch` with `flash_prefill=False` (on a GPU in bf16/fp16
  prefill attention runs on ferrobatch's own kernel instead of torch's FlashAttention-2; on the
  CPU nothing differs).
- `ferrobatch-splitmixed`: `ferrobatch` with `FERROBATCH_FLASH_WHOLE_STEP=0` (on a GPU a mixed
  step's decode rows stay on the decode kernel and only its prefill sequences go to
  FlashAttention, as before session 31; on the CPU nothing differs).
- `ferrobatch-rotaryapart`: `ferrobatch` with `FERROBATCH_ROTARY_CACHE=0` (on a GPU rotary and
  the K/V write into the paged cache stay two kernels per layer instead of one; the choice is
  per engine, so it may run in any order; on the CPU nothing differs).
- `ferrobatch-reducepass`: `ferrobatch` with `FERROBATCH_DECODE_FUSED_REDUCE=0` (on a GPU the
  decode kernel's KV splits are combined by a second kernel, the reduce pass, instead of by the
  last split to finish; per engine; on the CPU nothing differs).
- `ferrobatch-refill4`: `ferrobatch` with `admission_batch=4` (while sequences run, waiting
  requests join only when four of them find free slots, or after 8 held steps: a refill's
  prefill step serves several; on a GPU a refill is a mixed step costing several decode steps).
- `ferrobatch-torchops`: `ferrobatch` with `FERROBATCH_CUDA_FUSED_OPS=0` (on a GPU torch's
  elementwise modules instead of the fused RMSNorm / SiLU-and-mul / rotary kernels; the other
  systems swap the shared model's modules, so it runs first; on the CPU nothing differs).
- `ferrobatch-nodraft`: `ferrobatch` with `num_speculative_tokens=0` (no prompt-lookup drafts;
  the CPU default drafts, the GPU default does not). Every run records the drafted and accepted
  tokens: with drafts a step can yield several tokens of a sequence, so steps can fall below the
  workload's ideal decode steps.
- `ferrobatch-kv16`: `ferrobatch` with `kv_cache_dtype="float16"` (CPU: a float16 KV cache, half
  the bytes per token; greedy tokens may differ from the float32 cache's).
- `ferrobatch-kv8`: `ferrobatch` with `kv_cache_dtype="fp8"` (CPU: an FP8 E4M3 KV cache, a
  quarter of the bytes per token; greedy replies differ from the float32 cache's within a few
  dozen tokens, `benches/kv_cache_quality.py`).
- `ferrobatch-kvi8`: `ferrobatch` with `kv_cache_dtype="int8"` (CPU: an int8 KV cache with a
  scale per token and KV head, 68 / 256 of float32's bytes per token at head_dim 64; closer to
  the float32 cache's replies than FP8, `benches/kv_cache_quality.py`).
- `ferrobatch-f32panels`: `ferrobatch` with `FERROBATCH_QUANT_PANELS=0` (CPU without AMX: the
  linear layers' steps of 6 or more rows read float32 panels instead of the GGUF blocks packed
  as quantized panels; the same outputs, bit for bit).

Per-step batch occupancy comes from the engine's public observer hook (`on_step_tokens`: tokens
sampled in that step = sequences that produced a token) and `AsyncEngine.stats()` (scheduler
snapshot taken after the step: `num_running`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from bench_models import ferrobatch_loaded_model, model_ref
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

    def on_step(self, num_batched_tokens):
        pass

    def on_finished(self, request):
        pass

    def on_step_tokens(self, num_tokens, inter_token_latencies):
        if self.enabled:
            self.t.append(time.perf_counter())
            self.tokens.append(num_tokens)
            self.running.append(int(self.engine.stats().get("num_running", -1)))

    def reset(self) -> None:
        self.t, self.tokens, self.running = [], [], []


class FerrobatchRunner:
    """Owns one `ferrobatch.LLM` (engine + its loop thread) for a sequence of measured runs."""

    def __init__(self, w: Workload, max_num_seqs: int, **extra_options) -> None:
        from ferrobatch import LLM

        self.w = w
        # Prefix caching off: every system replays the *same* requests on this one engine, so
        # with it on, the second system (e.g. ferrobatch-static after ferrobatch) would find
        # every full prompt block of the first still cached and skip most of its prefill.
        # Within one run the workloads' random prompts share no prefix, so nothing else changes.
        options = {"enable_prefix_caching": False, **w.engine_options, **extra_options}
        self.options = dict(device=w.device, dtype=w.dtype, max_num_seqs=max_num_seqs, **options)
        t0 = time.perf_counter()
        self.llm = LLM(model_ref(w), loaded_model=ferrobatch_loaded_model(w), **self.options)
        self.load_s = time.perf_counter() - t0
        self.engine = self.llm.engine
        self.recorder = StepRecorder(self.engine)   # duck-typed EngineObserver
        self.engine.add_observer(self.recorder)
        self.max_num_seqs = max_num_seqs

    def _generate(self, reqs: list[Request], use_tqdm: bool) -> None:
        from ferrobatch import SamplingParams
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
                  for r in reqs]
        outs = self.llm.generate([list(r.prompt_ids) for r in reqs], params, use_tqdm=use_tqdm)
        for r, out in zip(reqs, outs):
            o = out.outputs[0] if out.outputs else None
            if out.error or o is None or o.finish_reason != "length" \
                    or len(o.token_ids) != r.output_len:
                raise RuntimeError(
                    f"ferrobatch request {out.request_id}: error={out.error!r}, "
                    f"finish={getattr(o, 'finish_reason', None)}, "
                    f"{len(o.token_ids) if o else 0} tokens, expected {r.output_len}")

    def run(self, reqs: list[Request], static: bool = False,
            progress: Callable[[int], None] | None = None) -> dict:
        self.recorder.reset()
        self.recorder.enabled = True
        steps0 = self._num_steps()
        graph_steps0, piecewise_steps0 = self._graph_steps(), self._graph_steps("piecewise_steps")
        stats0 = self.engine.stats()
        t0 = time.perf_counter()
        try:
            if static:
                for i in range(0, len(reqs), self.max_num_seqs):
                    group = reqs[i:i + self.max_num_seqs]
                    self._generate(group, use_tqdm=False)
                    if progress:
                        progress(len(group))
            else:
                self._generate(reqs, use_tqdm=progress is not None)
        finally:
            elapsed = time.perf_counter() - t0
            self.recorder.enabled = False
        total = sum(r.output_len for r in reqs)
        stats1 = self.engine.stats()
        drafted, accepted = (stats1.get(k, 0) - stats0.get(k, 0)
                             for k in ("num_draft_tokens_total", "num_accepted_tokens_total"))
        rec = self.recorder
        steps = self._num_steps() - steps0 if steps0 is not None else None
        return {"elapsed_s": elapsed, "output_tokens": total, "generated_tokens": total,
                "wasted_tokens": 0, "num_steps": steps,
                "cuda_paths": self._cuda_paths(),
                "decode_graph_steps": self._graph_steps() - graph_steps0,
                "piecewise_graph_steps": self._graph_steps("piecewise_steps") - piecewise_steps0,
                "drafted_tokens": drafted, "accepted_drafts": accepted,
                "num_sampling_steps": len(rec.tokens),
                "occupancy": list(rec.tokens), "running": list(rec.running),
                "step_times": [b - a for a, b in zip(rec.t, rec.t[1:])],
                "params": {"mode": "static (groups of max_num_seqs, wait for the whole group)"
                           if static else "continuous", "model": self.w.model,
                           "api": "ferrobatch.LLM.generate", **self.options}}

    def _graph_steps(self, counter: str = "graph_steps") -> int:
        """Steps the model runner served by replaying a decode CUDA graph (``piecewise_steps``:
        the piecewise graphs); 0 on the CPU."""
        core = getattr(self.engine, "_core", None)
        return int(getattr(getattr(core, "runner", None), counter, 0))

    def _cuda_paths(self) -> dict:
        """On the CUDA backend, which of its optional paths this engine ran: FlashAttention
        prefill (on, off, or the start-up check's verdict) and the fused elementwise kernels;
        empty elsewhere."""
        runner = getattr(getattr(self.engine, "_core", None), "runner", None)
        backend = getattr(runner, "attn_backend", None)
        if getattr(backend, "name", None) != "cuda":
            return {}
        from ferrobatch.runtime.cuda_elementwise import CudaRMSNorm
        verdicts = set(getattr(backend, "_flash_verdicts", {}).values())
        flash = "off" if not backend.flash_prefill else \
            "check failed" if False in verdicts else "on" if verdicts else "on, not used yet"
        fused = any(isinstance(m, CudaRMSNorm) for m in runner.model.modules())
        return {"flash_prefill": flash,
                "flash_whole_steps": "on" if getattr(backend, "flash_whole_steps", False)
                else "off",
                "fused_elementwise": "on" if fused else "off",
                "rotary_with_kv_write": "on" if getattr(backend, "rotary_with_kv_write", False)
                else "off",
                "decode_fused_reduce": "on" if getattr(backend, "fused_reduce", False) else "off"}

    def _num_steps(self) -> int | None:
        lt = getattr(self.engine, "_loop_thread", None)
        return getattr(lt, "num_steps", None)

    def close(self) -> None:
        self.llm.close()
        self.llm = self.engine = None
        gc.collect()
        try:
            import torch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()   # the next engine sizes its KV cache afresh
        except ImportError:
            pass
