"""EngineCore: the Rust scheduler, the model runner and the sampler, glued into one `step()`.

`step()` runs on the step thread only. Everything else here (`submit`, `abort`, `forget`) runs on
the asyncio thread and touches only the scheduler's thread-safe intake or swaps whole dicts
(copy-on-write), so the two threads never share a mutable Python structure.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ferrobatch.config import KV_CACHE_TORCH_DTYPES, EngineConfig
from ferrobatch.engine.errors import LoraSlotsBusyError, QueueFullError
from ferrobatch.engine.pooling import PoolingState, pooled_embeddings, pooling_rows
from ferrobatch.engine.step_rows import rows_of_requests
from ferrobatch.model import generation_defaults
from ferrobatch.runtime.cpu_threads import torch_single_threaded
from ferrobatch.runtime.logits_processors import (
    apply_logits_processors,
    request_processors,
    resolve_factories,
)
from ferrobatch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192
_EMPTY_I32 = np.zeros(0, dtype=np.int32)


@dataclass
class StepResult:
    """One step's whole output, handed to the asyncio loop in one piece (plain lists)."""

    req_ids: list[int]
    seq_indices: list[int]
    token_ids: list[int]
    finish_reasons: list[int]
    error_messages: dict[int, str]
    scheduled_req_ids: list[int]
    stats: dict[str, Any]
    step_time_s: float
    failed_req_ids: list[int] = field(default_factory=list)   # e.g. non-finite logits
    # (req id, seq index) -> [(token id, logprob, [(top id, top logprob), ...]), ...], one per
    # sampled row in order (the k-th token of the sequence this step has the k-th), for
    # requests that asked for logprobs; None when no row did
    logprobs: dict[tuple[int, int], list[tuple[int, float, list[tuple[int, float]]]]] | None = None
    # req id -> [(prompt position, (token id, logprob, top))] for the prompt tokens this step
    # computed, for requests that asked for prompt logprobs; None when none did
    prompt_logprobs: dict[int, list[tuple[int, tuple[int, float, list]]]] | None = None
    # why each of failed_req_ids failed, when not non-finite logits (e.g. a guided request
    # whose grammar no token can continue)
    failure_messages: dict[int, str] = field(default_factory=dict)
    num_batched_tokens: int = 0      # tokens the step computed (prompt chunks, decodes, drafts)
    # per entry of scheduled_req_ids: the tokens of that sequence computed (or found in the
    # prefix cache) before this step; for a request's first step, its cached prompt tokens
    seq_start_positions: list[int] = field(default_factory=list)
    # req id -> its embedding (float32), for the pooling requests this step completed
    embeddings: dict[int, Any] | None = None


def _seq_start_positions(batch: Any) -> list[int]:
    """Per scheduled sequence: its context before this step (context length after the step
    minus the tokens the step computes for it)."""
    n = batch.num_seqs
    if n == 0:
        return []
    qsl = batch.query_start_loc
    return (batch.seq_lens[:n] - (qsl[1:n + 1] - qsl[:n])).tolist()


def rows_all_finite(logits: torch.Tensor) -> bool:
    """True when every logit is finite. A NaN or an infinity anywhere in a row makes that row's
    sum non-finite, so one reduction (~20x cheaper than `isfinite` on CPU) proves the common
    case; only a non-finite sum (a bad row, or a finite overflow) needs the exact check.

    On the CPU the sum runs on one thread: torch's OpenMP workers have slept through the
    forward (the Rust kernels own the cores), and waking them cost more than the sum itself
    (SmolLM2's logits after a 2 ms idle: 230-300 us on two threads, 54-123 us on one, 1-16
    rows; in single-stream decoding 0.138-0.143 -> 0.101-0.109 ms per step)."""
    with torch_single_threaded() if logits.device.type == "cpu" else nullcontext():
        return bool(torch.isfinite(logits.sum(dim=-1, dtype=torch.float32)).all())


def _torch_dtype(name: str | None) -> Any:
    if name is None:
        return None
    import torch

    from ferrobatch.config import DTYPES
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, DTYPES[name])


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: Any, scheduler: Any, runner: Any,
                 sampler: Any, max_model_len: int) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.scheduler = scheduler
        self.intake = scheduler.intake()
        self.runner = runner
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.vocab_size = int(loaded.config.vocab_size)
        self.hidden_size = int(loaded.config.hidden_size)      # an embedding's length
        self.model_name = config.model
        self.num_blocks = int(runner.num_blocks)
        self.speculation = "off"              # set by build(): Speculation.describe()
        # SamplingParams fields a request leaves unset take (model/generation_defaults.py)
        self.default_sampling: dict[str, Any] = {}
        bos = self.tokenizer.bos_token_id
        self.ready_token_id = int(bos) if bos is not None else 0
        self._extras: dict[int, Any] = {}     # copy-on-write: replaced, never mutated in place
        self.plain_greedy_steps = 0           # steps sampled by _plain_greedy's one read-back
        self._guided: Any = None              # GuidedCompiler, made on the first guided request
        # LoRA: the registry (asyncio thread) and each request's (slot, adapter id), copy-on-write
        self.loras: Any = None                # LoraRegistry when config.enable_lora
        self._lora_of: dict[int, tuple[int, int]] = {}
        # weight updates so far (update_weights): the scheduler's cache epoch
        self.weights_version = 0
        # engine-wide logits processor factories (config.logits_processors), asked per request
        self.processor_factories = resolve_factories(config.logits_processors)
        from ferrobatch._scheduler import QueueFullError
        self._rust_queue_full = QueueFullError

    @classmethod
    def build(cls, config: EngineConfig, loaded: Any = None) -> "EngineCore":
        """Load the model (unless given), size the KV cache, create scheduler, runner, sampler."""
        from ferrobatch._scheduler import Scheduler
        from ferrobatch.model.loader import load_model
        from ferrobatch.runtime.kv_cache import (
            EXTRA_KV_CACHE_DTYPES,
            check_cpu_kv_fits,
            check_kv_cache_dtype,
            kv_block_bytes,
            kv_cache_dtype_flag,
            num_blocks_for_budget,
        )
        from ferrobatch.runtime.model_runner import ModelRunner, num_kv_blocks
        from ferrobatch.runtime.sampler import Sampler

        device = config.resolved_device()
        if loaded is None:
            from ferrobatch.runtime.cpu_linear import packing_unsupported
            dtype = _torch_dtype(config.dtype)
            # a GGUF's block-format linears straight to the CPU block kernels, never float32
            gguf_blocks = config.gguf_blocks and packing_unsupported(
                torch.device(device), dtype or torch.float32) is None
            loaded = load_model(config.model, device=device, dtype=dtype,
                                require_tokenizer=config.tokenizer is None,
                                max_model_len=config.max_model_len, gguf_blocks=gguf_blocks)
        if config.tokenizer is not None:          # another tokenizer (and its template)
            loaded = _with_tokenizer(loaded, config.tokenizer)
        if loaded.tokenizer is None:
            raise ValueError(f"model {config.model!r} has no tokenizer; it cannot be served "
                             "(--tokenizer names one)")
        if config.chat_template is not None:      # the operator's template replaces the model's
            import copy
            import dataclasses
            tokenizer = copy.copy(loaded.tokenizer)   # (a shared loaded model keeps its own)
            tokenizer.chat_template = config.chat_template
            loaded = dataclasses.replace(loaded, tokenizer=tokenizer,
                                         chat_template=config.chat_template)
        build_table = getattr(loaded.tokenizer, "token_byte_table", None)
        if build_table is not None:
            build_table(True)     # the detokenizer's fast path, built and checked up front
        device = str(loaded.device)
        mcfg = loaded.config
        kv_dtype = check_kv_cache_dtype(
            None if config.kv_cache_dtype == "auto"
            else getattr(torch, KV_CACHE_TORCH_DTYPES[config.kv_cache_dtype]),
            loaded.dtype, loaded.device)
        max_model_len = min(int(mcfg.max_position_embeddings), DEFAULT_MAX_MODEL_LEN)
        if config.max_model_len is not None:
            if config.max_model_len > mcfg.max_position_embeddings:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                                 f"context of {mcfg.max_position_embeddings} tokens")
            max_model_len = config.max_model_len
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif loaded.device.type == "cuda" and config.kv_cache_gb is None:
            num_blocks = num_kv_blocks(
                loaded, block_size=config.block_size,
                max_num_batched_tokens=config.step_token_budget("cuda"),
                gpu_memory_fraction=config.gpu_memory_utilization,
                attn_backend=config.attn_backend,
                reserve_bytes=_gpu_reserve_bytes(config, mcfg, loaded.dtype),
                kv_cache_dtype=kv_dtype, flash_prefill=config.flash_prefill)
        else:
            num_blocks = num_blocks_for_budget(mcfg, config.block_size, kv_dtype,
                                               config.kv_budget_bytes_cpu())
        # one sequence holds at most this many tokens (its last sampled one is never computed)
        kv_tokens = (num_blocks - 1) * config.block_size + 1
        if kv_tokens < max_model_len:
            smaller = [kv_cache_dtype_flag(d) for d in
                       EXTRA_KV_CACHE_DTYPES.get((loaded.device.type, loaded.dtype), ())
                       if d.itemsize < kv_dtype.itemsize]
            logger.warning("max_model_len lowered from %d to %d tokens: one sequence cannot "
                           "hold more in a KV cache of %d blocks of %d (more KV memory, "
                           "e.g. --kv-cache-gb%s, allows longer contexts)", max_model_len,
                           kv_tokens, num_blocks, config.block_size,
                           f", or fewer bytes per token, --kv-cache-dtype "
                           f"{' / '.join(smaller)}"
                           if smaller else "")
            max_model_len = kv_tokens
        if loaded.device.type == "cpu":
            check_cpu_kv_fits(num_blocks * kv_block_bytes(mcfg, config.block_size, kv_dtype))
            if config.cpu_threads is not None:    # the runner's kernels take torch's count
                torch.set_num_threads(config.cpu_threads)
        runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=config.block_size,
                             device=device, attn_backend=config.attn_backend,
                             gguf_blocks=config.gguf_blocks, amx_tiles=config.amx_tiles,
                             fused_decode=config.fused_decode, kv_cache_dtype=kv_dtype,
                             flash_prefill=config.flash_prefill)
        if config.enable_lora:     # before the decode graphs: LoRA steps get graphs of their own
            runner.enable_lora(config.max_loras, config.max_lora_rank)
        if loaded.device.type == "cuda":
            _maybe_capture_decode_graphs(config, runner, max_model_len)
            _maybe_capture_piecewise_graphs(config, runner)
        eos = list(loaded.tokenizer.eos_token_ids)
        sampler = Sampler(int(mcfg.vocab_size), eos, loaded.device, seed=config.seed,
                          cpu_threads=getattr(runner, "kernel_threads", None))
        device_type = loaded.device.type
        spec = config.speculation(device_type)
        spec = spec._replace(
            num_tokens=min(spec.num_tokens, config.step_token_budget(device_type) - 1))
        scheduler = Scheduler(
            num_blocks, block_size=config.block_size,
            max_num_seqs=config.step_seq_limit(loaded.device.type),
            max_num_batched_tokens=config.step_token_budget(loaded.device.type),
            max_model_len=max_model_len,
            vocab_size=int(mcfg.vocab_size), eos_token_ids=eos,
            enable_prefix_caching=config.enable_prefix_caching, policy=config.scheduling_policy,
            max_preemptions=config.max_preemptions, intake_capacity=config.intake_capacity,
            num_speculative_tokens=spec.num_tokens,
            speculative_ngram_min=config.speculative_ngram_min,
            speculative_ngram_max=config.speculative_ngram_max,
            speculative_max_running=spec.max_running,
            speculative_max_step_tokens=spec.max_step_tokens,
            speculative_adaptive=spec.adaptive,
            admission_batch=min(config.admission_batch,
                                config.step_seq_limit(loaded.device.type)),
            admission_max_wait_steps=config.admission_max_wait_steps)
        core = cls(config, loaded, scheduler, runner, sampler, max_model_len)
        core.speculation = spec.describe()
        core.default_sampling = generation_defaults.resolve(
            loaded.source, config.generation_config, config.override_generation_config)
        if config.logits_processors:
            logger.info("engine-wide logits processors (asked per request): %s",
                        ", ".join(e if isinstance(e, str) else getattr(e, "__qualname__", repr(e))
                                  for e in config.logits_processors))
        if core.default_sampling:
            logger.info("sampling defaults for fields a request leaves unset (generation_config "
                        "%r; 'vllm' turns them off): %s", config.generation_config,
                        ", ".join(f"{k}={v}" for k, v in core.default_sampling.items()))
        if config.enable_lora:
            core.loras = _lora_registry(config, loaded, runner)
        logger.info("speculative decoding: %s", core.speculation)
        return core

    # -- asyncio thread --------------------------------------------------------------------------

    def new_detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        from ferrobatch.model.detokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=params.stop,
                                      skip_special_tokens=params.skip_special_tokens,
                                      min_tokens=params.min_tokens)

    @property
    def guided(self) -> Any:
        """The `GuidedCompiler` of this model's vocabulary (made on first use)."""
        if self._guided is None:
            from ferrobatch.guided.compiler import GuidedCompiler
            table = getattr(self.tokenizer, "token_byte_table", None)
            self._guided = GuidedCompiler(table(True) if table is not None else None,
                                          self.vocab_size, self.tokenizer.eos_token_ids)
        return self._guided

    def submit(self, req_id: int, ids: list[int], p: SamplingParams, max_tokens: int,
               state: Any, *, lora_queue: bool = False) -> None:
        """Hands a validated request to the scheduler (ValueError for one it cannot serve).
        A LoRA request raises LoraSlotsBusyError, holding nothing, when its adapter finds no
        slot, or at once with ``lora_queue`` (the engine keeps it waiting, in order)."""
        guides = self.guided.sequences(p) if p.is_guided else None   # ValueError if unusable
        thinking = getattr(state, "reasoning_parser", None)
        if guides and thinking is not None:            # the grammar applies after the reasoning
            guides = self.guided.after_reasoning(guides, thinking)
        lora = getattr(state, "lora", None)            # a LoRARequest
        if lora is not None and self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (start it with "
                             "enable_lora=True / --enable-lora)")
        processors = request_processors(p, self.processor_factories) \
            if p.logits_processors or self.processor_factories else ()   # ValueError: refused
        stop_masked = bool(p.min_tokens and p.stop_token_ids)
        pooling = getattr(state, "pooling", None)      # an embedding request
        if p.needs_token_history or p.logit_bias or p.logprobs is not None \
                or p.prompt_logprobs is not None or guides or stop_masked \
                or p.allowed_token_ids is not None or pooling is not None \
                or processors:
            from ferrobatch.runtime.sampler import RequestExtras
            from ferrobatch.runtime.token_restrictions import allowed_mask, bad_word_sequences
            history = [[] for _ in range(p.n)] if p.needs_token_history or processors else None
            state.extras = RequestExtras(
                ids, history, p.logit_bias, p.logprobs, p.prompt_logprobs, guides, p.min_tokens,
                tuple(p.stop_token_ids) if stop_masked else (),
                allowed_mask=(allowed_mask(p.allowed_token_ids, self.vocab_size)
                              if p.allowed_token_ids is not None else None),
                bad_word_ids=bad_word_sequences(self.tokenizer, p.bad_words),
                pooling=PoolingState(pooling, len(ids)) if pooling is not None else None,
                logits_processors=processors)
            self._extras = {**self._extras, req_id: state.extras}
        salt = None if p.cache_salt is None else f"tenant/{p.cache_salt}"
        if lora is not None:        # KV computed with an adapter serves only that adapter
            salt = f"lora/{lora.lora_int_id}" + ("" if salt is None else f"/{salt}")
        # a prompt-logprobs request must compute every prompt token: a salt of its own keeps
        # other requests' cached blocks from standing in for them
        if p.prompt_logprobs is not None:
            salt = f"prompt-logprobs/{req_id}"
        if pooling is not None and pooling.pooling == "mean":   # every prompt row is needed
            salt = f"pooling/{req_id}"
        try:
            if lora is not None:    # ValueError / LoraSlotsBusyError: nothing held
                if lora_queue:
                    raise LoraSlotsBusyError("requests wait for a LoRA slot ahead of this one")
                slot = self.loras.acquire(lora)
                self._lora_of = {**self._lora_of, req_id: (slot, lora.lora_int_id)}
            self.intake.submit(
                req_id, ids, max_tokens=max_tokens, min_tokens=p.min_tokens,
                ignore_eos=p.ignore_eos, stop_token_ids=list(p.stop_token_ids), n=p.n,
                priority=p.priority, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                min_p=p.min_p, repetition_penalty=p.repetition_penalty,
                presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                seed=p.seed, cache_salt=salt,
                speculate=p.allows_speculation and not processors)
        except self._rust_queue_full as exc:
            self.forget(req_id)
            raise QueueFullError(f"the engine's intake queue is full: {exc}") from None
        except BaseException:
            self.forget(req_id)
            raise

    def abort(self, req_id: int, seq_index: int, reason: str) -> None:
        self.intake.abort(req_id, seq_index, reason)

    def forget(self, req_id: int) -> None:
        if req_id in self._extras:
            extras = dict(self._extras)
            del extras[req_id]
            self._extras = extras
        held = self._lora_of.get(req_id)
        if held is not None:
            self._lora_of = {r: v for r, v in self._lora_of.items() if r != req_id}
            self.loras.release(held[1])

    def num_tracked(self) -> int:
        """Requests the core still keeps anything for (extras or a held LoRA adapter)."""
        return len(self._extras.keys() | self._lora_of.keys())

    def wake(self) -> None:
        self.intake.notify()

    def all_blocks_free(self, stats: dict[str, Any]) -> bool:
        """No block owned by a request (prefix-cached blocks are reusable, hence free)."""
        return stats.get("num_used_blocks", 0) == 0

    def check_integrity(self) -> None:
        """The scheduler's invariant check; step thread only (see StepLoop.call)."""
        self.scheduler.check_integrity()

    def reset_prefix_cache(self) -> int:
        """Forgets the prefix cache's free blocks (used ones stay shared by their sequences);
        returns how many. Step thread only (see StepLoop.call)."""
        return int(self.scheduler.reset_prefix_cache())

    def update_weights(self, weights: list) -> dict[str, Any]:
        """Replaces the named weights (``ModelRunner.update_weights``), then keeps KV computed
        with the old ones from serving any sequence admitted after: the scheduler starts cache
        epoch ``weights_version`` (salted into the block hashes of every sequence admitted
        from now on, even one submitted before) and drops the free cached blocks. Step thread
        only (see StepLoop.call)."""
        summary = self.runner.update_weights(weights)
        self.weights_version += 1
        self.scheduler.set_cache_epoch(self.weights_version)
        summary["prefix_blocks_dropped"] = self.reset_prefix_cache()
        summary["weights_version"] = self.weights_version
        return summary

    def stats(self) -> dict[str, Any]:
        s = dict(self.scheduler.stats())
        s.setdefault("num_blocks", self.num_blocks)
        return s

    # -- step thread -----------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def wait_for_work(self, timeout_s: float) -> bool:
        return self.intake.wait_for_work(timeout_s)

    def step(self) -> StepResult | None:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        extras = self._extras
        lora_of = self._lora_of
        # per scheduled sequence its LoRA slot, for the runner (only when some request has one)
        lora = {"lora_slots": [lora_of.get(r, (0,))[0] for r in batch.seq_req_ids.tolist()]} \
            if lora_of and batch.num_tokens > 0 else {}
        failed: list[int] = []
        processor_failures: dict[int, str] = {}
        logprobs = prompt_logprobs = embeddings = None
        scored = pooled = None          # the rows prompt logprobs / embeddings need
        if extras and batch.num_tokens > 0:
            scored = _prompt_logprob_rows(batch, extras)
            pooled = pooling_rows(batch, extras)
        wanted = scored is not None or pooled is not None
        if wanted:
            rows = np.concatenate([w[0] for w in (scored, pooled) if w is not None])
            logits, hidden = self.runner.execute(batch, hidden_rows=rows, **lora)
            num_scored = 0 if scored is None else len(scored[0])
            if scored is not None:
                prompt_logprobs = self._prompt_logprobs(hidden[:num_scored], scored, extras)
            if pooled is not None:
                embeddings = pooled_embeddings(hidden[num_scored:].float().cpu().numpy(),
                                               pooled, extras)
        if batch.num_samples > 0:
            if not wanted:
                logits = self.runner.execute(batch, **lora)
            sampled = self._plain_greedy(batch, extras, logits) if not wanted else None
        else:
            if batch.num_tokens > 0 and not wanted:
                # a prefill chunk that samples nothing yet
                self.runner.execute(batch, **lora)
            sampled = _EMPTY_I32
        if sampled is None:
            if not rows_all_finite(logits):
                finite = torch.isfinite(logits).all(dim=-1)
                failed = self._fail_rows(batch, finite)
                logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
            if any(e.logits_processors for e in extras.values()):
                logits, processor_failures = self._run_logits_processors(logits, batch, extras)
                failed = sorted(set(failed) | processor_failures.keys())
            sample = self.sampler.sample(logits, batch, extras)
            sampled = np.ascontiguousarray(sample.token_ids, dtype=np.int32)
            if sample.logprobs is not None:
                logprobs = _logprobs_by_sequence(batch, sample, extras)
        out = self.scheduler.update(sampled)
        req_ids = out.req_ids
        failure_messages: dict[int, str] = {}
        if extras and len(req_ids):
            self._record_history(extras, out)
            failure_messages = self._advance_guides(extras, out, failed)
        failure_messages.update(processor_failures)
        if not len(req_ids) and batch.num_seqs == 0:
            return None
        return StepResult(req_ids.tolist(), out.seq_indices.tolist(), out.token_ids.tolist(),
                          out.finish_reasons.tolist(), dict(out.error_messages),
                          batch.seq_req_ids.tolist(), self.stats(), time.perf_counter() - t0,
                          failed, logprobs, prompt_logprobs, failure_messages,
                          int(batch.num_tokens),
                          # a request's first step computes prompt tokens: decode-only steps
                          # have no first step in them, and skip the arrays
                          _seq_start_positions(batch) if batch.num_prefill_tokens else [],
                          embeddings)

    def _plain_greedy(self, batch: Any, extras: dict[int, Any], logits: Any) -> np.ndarray | None:
        """A plain greedy step (``Sampler.is_plain_greedy``) whose logits are all finite: its
        tokens, read back with the finite check in one transfer (``ModelRunner.greedy_rows``;
        on CUDA this saves a host sync per step). None: take the general path (a non-finite
        row fails its request there)."""
        greedy_rows = getattr(self.runner, "greedy_rows", None)
        if greedy_rows is None or not self.sampler.is_plain_greedy(batch, extras):
            return None
        rows = greedy_rows(logits)
        if rows is None:
            return None
        rows = rows.cpu().numpy()
        if not rows[:, 1].all():
            return None
        self.plain_greedy_steps += 1
        return np.ascontiguousarray(rows[:, 0], dtype=np.int32)

    def _run_logits_processors(self, logits: Any, batch: Any, extras: dict[int, Any]
                               ) -> tuple[Any, dict[int, str]]:
        """The step's logits (float32) after the requests' logits processors; a request whose
        processor failed is aborted with "error" (its message returned with it)."""
        logits = logits.float()
        failures = apply_logits_processors(logits, batch, extras)
        for rid in failures:
            self.intake.abort(rid, -1, "error")
        return logits, failures

    def _prompt_logprobs(self, hidden: Any, wanted: tuple, extras: dict[int, Any]) -> dict:
        """Logprobs of the next prompt token at each wanted row, with each request's top-N,
        computed PROMPT_LOGITS_CHUNK rows at a time (a row's logits are vocab floats)."""
        rows, req_ids, positions, targets = wanted
        top_n = max(extras[r].prompt_logprobs for r in set(req_ids.tolist()))
        out: dict[int, list[tuple[int, tuple[int, float, list]]]] = {}
        for lo in range(0, len(rows), PROMPT_LOGITS_CHUNK):
            hi = min(lo + PROMPT_LOGITS_CHUNK, len(rows))
            logits = self.runner.logits_of(hidden[lo:hi])
            cpu_logprobs = getattr(self.sampler, "cpu_logprobs", None)
            fast = cpu_logprobs(logits, targets[lo:hi], top_n) if cpu_logprobs else None
            if fast is not None:        # the CPU kernel: no [rows, vocab] log_softmax
                chosen, top_ids, top_values = fast
            else:
                logprobs = logits.log_softmax(dim=-1)
                target = torch.from_numpy(targets[lo:hi].astype(np.int64)).to(logprobs.device)
                chosen = logprobs.gather(1, target[:, None])[:, 0].cpu().numpy()
                if top_n:
                    top_values, top_ids = (t.cpu().numpy() for t in logprobs.topk(top_n, dim=-1))
            for k in range(hi - lo):
                rid = int(req_ids[lo + k])
                n = extras[rid].prompt_logprobs
                top = list(zip(top_ids[k, :n].tolist(), top_values[k, :n].tolist())) if n else []
                out.setdefault(rid, []).append(
                    (int(positions[lo + k]), (int(targets[lo + k]), float(chosen[k]), top)))
        return out

    def _fail_rows(self, batch: Any, finite: Any) -> list[int]:
        """Rows with NaN/inf logits fail their request only: abort it with "error" (the row is
        zeroed for the sampler and its token dropped on the asyncio side)."""
        bad = (~finite).cpu().numpy()
        failed = sorted(set(np.asarray(batch.sample_req_ids)[bad].tolist()))
        for rid in failed:
            self.intake.abort(rid, -1, "error")
        return failed

    def _advance_guides(self, extras: dict[int, Any], out: Any, failed: list[int]) -> dict:
        """Moves each guided sequence past the token it just sampled. A token its grammar does
        not allow, or a state no token can continue, fails the request (appended to `failed`,
        its message returned); neither happens while the sampler applies the masks."""
        guided = [rid for rid, e in extras.items() if e.guides]
        messages: dict[int, str] = {}
        if not guided:
            return messages
        mask = np.isin(out.req_ids, np.asarray(guided, dtype=np.uint64)) & (out.token_ids >= 0)
        for rid, si, tok in zip(out.req_ids[mask].tolist(), out.seq_indices[mask].tolist(),
                                out.token_ids[mask].tolist()):
            if rid in messages or rid in failed:
                continue
            guide = extras[rid].guides[si]
            if not guide.advance(tok):
                messages[rid] = f"guided decoding: token {tok} is not allowed by the grammar"
            elif not guide.is_finished and guide.num_allowed == 0:
                messages[rid] = ("guided decoding: no token of the vocabulary can continue the "
                                 "output")
        for rid in messages:
            self.intake.abort(rid, -1, "error")
            failed.append(rid)
        return messages

    @staticmethod
    def _record_history(extras: dict[int, Any], out: Any) -> None:
        """Token history for the sampler's penalties, kept only for requests that use them."""
        keep = [rid for rid, e in extras.items() if e.output_token_ids is not None]
        if not keep:
            return
        mask = np.isin(out.req_ids, np.asarray(keep, dtype=np.uint64)) & (out.token_ids >= 0)
        for rid, si, tok in zip(out.req_ids[mask].tolist(), out.seq_indices[mask].tolist(),
                                out.token_ids[mask].tolist()):
            extras[rid].output_token_ids[si].append(tok)


PROMPT_LOGITS_CHUNK = 256


def _prompt_logprob_rows(batch: Any, extras: dict[int, Any]) -> tuple | None:
    """The token rows of this step whose logits score a prompt token: a row at prompt
    position p < len(prompt) - 1 of a request that asked for prompt logprobs predicts prompt
    token p + 1. Returns (rows, req ids, positions, target tokens) arrays, or None."""
    asking = [rid for rid, e in extras.items() if e.prompt_logprobs is not None]
    rows, rids, pos, targets = [], [], [], []
    for rid, span, p in rows_of_requests(batch, asking):
        prompt = np.asarray(extras[rid].prompt_token_ids, dtype=np.int64)
        keep = p < len(prompt) - 1
        if keep.any():
            rows.append(span[keep])
            pos.append(p[keep])
            targets.append(prompt[p[keep] + 1])
            rids.append(np.full(int(keep.sum()), rid, dtype=np.uint64))
    if not rows:
        return None
    return (np.concatenate(rows), np.concatenate(rids), np.concatenate(pos),
            np.concatenate(targets))


def _logprobs_by_sequence(batch: Any, sample: Any, extras: dict[int, Any]) -> dict:
    """The sampler's logprob arrays, cut to each asking request's own top-N and keyed by
    (request id, sequence index), one entry per sampled row in row order: a drafted sequence
    has several, and its k-th token this step came from its k-th row (``update()`` keeps
    rows 0, 1, ... while the drafts agree)."""
    out: dict[tuple[int, int], list[tuple[int, float, list[tuple[int, float]]]]] = {}
    req_ids = np.asarray(batch.sample_req_ids).tolist()
    seq_indices = np.asarray(batch.sample_seq_indices).tolist()
    for row, (rid, si) in enumerate(zip(req_ids, seq_indices)):
        ext = extras.get(rid)
        if ext is None or ext.logprobs is None:
            continue
        n = ext.logprobs
        top = list(zip(sample.top_logprob_ids[row, :n].tolist(),
                       sample.top_logprobs[row, :n].tolist()))
        out.setdefault((rid, si), []).append(
            (int(sample.token_ids[row]), float(sample.logprobs[row]), top))
    return out


def _with_tokenizer(loaded: Any, name: str) -> Any:
    """``loaded`` with the tokenizer ``name`` (``loader.load_tokenizer``) and its chat
    template; ValueError when its token ids reach past the model's vocabulary."""
    import dataclasses

    from ferrobatch.model.loader import load_tokenizer
    tokenizer = load_tokenizer(name)
    if tokenizer.vocab_size > int(loaded.config.vocab_size):
        raise ValueError(f"tokenizer {name!r} has {tokenizer.vocab_size} tokens, more than "
                         f"the model's {loaded.config.vocab_size}-token vocabulary")
    logger.info("tokenizer: %s (%d tokens) in place of the model's", name,
                tokenizer.vocab_size)
    return dataclasses.replace(loaded, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def _lora_registry(config: EngineConfig, loaded: Any, runner: Any) -> Any:
    """The LoRA registry of an engine: ``config.max_loras`` slots in the runner, adapters read
    as the model's dtype onto its device."""
    from ferrobatch.engine.lora_registry import LoraRegistry
    from ferrobatch.model.lora_adapter import read_lora_adapter

    def load(request: Any) -> Any:
        return read_lora_adapter(request.lora_path, loaded.config,
                                 max_rank=config.max_lora_rank, dtype=loaded.dtype,
                                 device=loaded.device)

    logger.info("LoRA: up to %d adapters at once, ranks up to %d", config.max_loras,
                config.max_lora_rank)
    return LoraRegistry(runner.enable_lora(config.max_loras, config.max_lora_rank), load)


def _gpu_reserve_bytes(config: EngineConfig, model_config: Any,
                       dtype: torch.dtype = torch.bfloat16) -> int:
    """GPU memory kept out of the KV cache besides the warm-up's activation peak: a full batch's
    sampler working set (float32 logits, their copies and a sort's values + int64 indices: ~32
    bytes per logit), with decode graphs every bucket's float32 logits output, with piecewise
    graphs their static buffers and pool (``piecewise_graphs.pool_bytes_estimate``), and with
    LoRA the adapters the slots can hold (``runtime.lora.reserve_bytes``: loaded after the KV
    cache is sized, so kept out of it) and, with decode graphs, the LoRA graphs' static weights
    (``runtime.lora_graphs``; their outputs are the plain graphs')."""
    from ferrobatch.runtime.cuda_graphs import decode_buckets
    from ferrobatch.runtime.piecewise_graphs import pool_bytes_estimate

    seqs, vocab = config.step_seq_limit("cuda"), int(model_config.vocab_size)
    graph_rows = sum(decode_buckets(seqs)) if config.cuda_graphs else 0
    pieces = config.piecewise_token_limit("cuda")
    pool = pool_bytes_estimate(model_config, pieces, dtype) if pieces else 0
    lora = 0
    if config.enable_lora:
        from ferrobatch.runtime.lora import reserve_bytes
        lora = reserve_bytes(model_config, config.max_loras, config.max_lora_rank, dtype,
                             graphs=config.cuda_graphs)
    return seqs * vocab * 32 + graph_rows * vocab * 4 + pool + lora


def _maybe_capture_piecewise_graphs(config: EngineConfig, runner: Any) -> None:
    """On CUDA: capture the model between its attention calls for the steps decode graphs do
    not serve, unless switched off. A failed capture is logged and those steps run eagerly."""
    limit = config.piecewise_token_limit(torch.device(runner.device).type)
    if not limit:
        logger.info("piecewise CUDA graphs: off (%s)", "cuda_graphs=False / --enforce-eager"
                    if not config.cuda_graphs else "piecewise_max_tokens=0")
        return
    t0 = time.perf_counter()
    free_before = torch.cuda.mem_get_info(runner.device)[0]
    try:
        from ferrobatch.runtime.piecewise_graphs import piecewise_buckets

        logger.info("piecewise CUDA graphs: capturing %d token buckets up to %d tokens...",
                    len(piecewise_buckets(limit)), limit)

        def progress(done: int, total: int) -> None:
            logger.info("piecewise CUDA graphs: %d/%d buckets, %.1f s", done, total,
                        time.perf_counter() - t0)

        buckets = runner.capture_piecewise_graphs(limit, progress=progress)
    except Exception as exc:  # noqa: BLE001 - any capture failure: those steps run eagerly
        runner.piecewise_graphs = runner.lora_piecewise_graphs = None
        torch.cuda.empty_cache()
        logger.warning("piecewise CUDA graphs: capture failed, prefill and mixed steps run "
                       "eagerly: %s: %s", type(exc).__name__, exc)
        return
    used = free_before - torch.cuda.mem_get_info(runner.device)[0]
    logger.info("piecewise CUDA graphs: %d token buckets up to %d (%d graphs each) captured in "
                "%.1f s (%.0f MiB)", len(buckets), buckets[-1], runner.config.num_layers + 1,
                time.perf_counter() - t0, used / 2**20)


def _maybe_capture_decode_graphs(config: EngineConfig, runner: Any, max_model_len: int) -> None:
    """On CUDA: capture the decode-step graphs unless switched off or the backend cannot. A
    failed capture is logged and the engine runs eagerly (slower, still correct)."""
    if not config.cuda_graphs:
        logger.info("decode CUDA graphs: off (cuda_graphs=False / --enforce-eager)")
        return
    if not runner.attn_backend.supports_decode_graphs:
        logger.warning("decode CUDA graphs: off (attention backend %r cannot be captured)",
                       runner.attn_backend.name)
        return
    t0 = time.perf_counter()
    on_cuda = torch.device(runner.device).type == "cuda"
    free_before = torch.cuda.mem_get_info(runner.device)[0] if on_cuda else 0
    try:
        buckets = runner.capture_decode_graphs(config.step_seq_limit("cuda"), max_model_len)
    except Exception as exc:  # noqa: BLE001 - any capture failure: fall back to eager steps
        runner.decode_graphs = runner.lora_decode_graphs = runner.graph_lora = None
        logger.warning("decode CUDA graphs: capture failed, every step runs eagerly: %s: %s",
                       type(exc).__name__, exc)
        return
    used = free_before - torch.cuda.mem_get_info(runner.device)[0] if on_cuda else 0
    logger.info("decode CUDA graphs: %d buckets %s captured in %.1f s (%.0f MiB)", len(buckets),
                list(buckets), time.perf_counter() - t0, used / 2**20)
