"""LLM: the synchronous, vLLM-style Python entry point.

    llm = LLM(model="smollm2")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)

It runs an AsyncEngine on a private event loop in a background thread, so it works from plain
scripts, from threads and from notebooks that already run an event loop. A vLLM script ports by
its import: vLLM's spellings (`sampling_params=`, `{"prompt": ...}` / `{"prompt_token_ids":
...}` prompts, request ids "0", "1", ..., `get_tokenizer()`, `LLM(dtype="auto", seed=0,
enforce_eager=True, tensor_parallel_size=1, trust_remote_code=True)`) are taken as vLLM means
them, and what cannot be honoured is an error, never silently different.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from typing import Any

from ferrobatch.config import EngineConfig
from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.engine.beam_search import BeamSearchOutput, BeamSearchParams
from ferrobatch.engine.scoring import ScoringRequestOutput
from ferrobatch.lora_request import LoRARequest
from ferrobatch.outputs import RequestOutput
from ferrobatch.pooling_params import EmbeddingRequestOutput, PoolingParams
from ferrobatch.sampling_params import SamplingParams

PROGRESS_MIN_PROMPTS = 8
CANCEL_WAIT_S = 10.0      # how long an interrupted call waits for its requests to be aborted
# vLLM options that cannot change what is generated here (no remote code is ever run, stats
# and swap space are the engine's own business): accepted and ignored
_VLLM_NO_OPS = frozenset({"trust_remote_code", "disable_log_stats", "swap_space",
                          "tokenizer_mode", "disable_custom_all_reduce"})


def _engine_options(model: str, options: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `LLM(...)` options as EngineConfig fields (ValueError for one that cannot be
    honoured); the rest pass through for EngineConfig to check."""
    out = dict(options)
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if name in out and out.pop(name) not in (1, None):
            raise ValueError(f"{name}={options[name]!r}: ferrobatch runs a model on one device")
    if "enforce_eager" in out:
        eager = out.pop("enforce_eager")
        if not isinstance(eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {eager!r}")
        if "cuda_graphs" in out and out["cuda_graphs"] == eager:
            raise ValueError("enforce_eager and cuda_graphs disagree")
        out["cuda_graphs"] = not eager
    if out.get("dtype") is not None and not isinstance(out["dtype"], str):
        out["dtype"] = str(out["dtype"]).removeprefix("torch.")     # a torch.dtype
    if out.get("tokenizer") in (None, model):      # the model's own: nothing to replace
        out.pop("tokenizer", None)
    if out.pop("quantization", None) is not None:
        raise ValueError("quantization is not supported (a GGUF model's Q4_1 / Q8_0 weights are "
                         "read as they are stored)")
    for name in _VLLM_NO_OPS:
        out.pop(name, None)
    return out


def _prompt_of(prompt: Any) -> Any:
    """A prompt as text or token ids; vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`
    dicts are unwrapped (ValueError for other keys, which this engine would ignore; a
    `cache_salt` beside them is taken by `_salted`)."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) - {"cache_salt"}
    if keys not in ({"prompt"}, {"prompt_token_ids"}):
        raise ValueError(f"a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids' "
                         f"(besides 'cache_salt', no other keys are supported), got "
                         f"{sorted(map(str, keys))}")
    return prompt.get("prompt", prompt.get("prompt_token_ids"))


def _salted(prompts: list[Any], plist: list[SamplingParams]) -> list[SamplingParams]:
    """vLLM's `{"prompt": ..., "cache_salt": ...}`: the salt moves into that prompt's params."""
    return [p.replace(cache_salt=prompt["cache_salt"])
            if isinstance(prompt, dict) and "cache_salt" in prompt else p
            for prompt, p in zip(prompts, plist)]


def _one_params(sampling_params: Any, params: Any) -> Any:
    if params is not None:
        if sampling_params is not None:
            raise TypeError("pass sampling_params or params, not both")
        return params
    return sampling_params


class LLM:
    def __init__(self, model: str = "smollm2", *, loaded_model: Any = None,
                 **engine_options: Any) -> None:
        """`engine_options`: EngineConfig fields, and vLLM's names for them."""
        self.config = EngineConfig.from_options(model=model,
                                                **_engine_options(model, engine_options))
        self._request_ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ferrobatch-llm",
                                        daemon=True)
        self._thread.start()
        self.engine = AsyncEngine(self.config, loaded_model=loaded_model)
        try:
            self._run(self.engine.start())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Any) -> Any:
        if self._loop.is_closed():
            coro.close()                        # never awaited: no "never awaited" warning
            raise RuntimeError("this LLM is closed; create a new one")
        finished = threading.Event()

        async def run() -> Any:
            try:
                return await coro
            finally:
                finished.set()

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return fut.result()
        except BaseException:
            # e.g. Ctrl-C in the caller's thread: cancel the work and wait for its cleanup, so
            # its requests are aborted instead of running on to max_tokens
            fut.cancel()
            finished.wait(CANCEL_WAIT_S)
            raise

    def reset_prefix_cache(self) -> int:
        """The prefix cache forgets every block no running request holds (`AsyncEngine.
        reset_prefix_cache`); returns how many blocks it dropped."""
        return self._run(self.engine.reset_prefix_cache())

    def apply_model(self, func: Any) -> list[Any]:
        """vLLM's: ``[func(model)]`` (one model here, vLLM's list of one per worker), run
        between two steps; see `AsyncEngine.apply_model`."""
        return [self._run(self.engine.apply_model(func))]

    def update_weights(self, weights: Any) -> dict[str, Any]:
        """Replaces the model's weights in place from ``(Hugging Face name, tensor)`` pairs or
        a dict (`AsyncEngine.update_weights`: any subset, all checked before any is written;
        later requests never reuse KV computed with the old weights)."""
        return self._run(self.engine.update_weights(weights))

    def update_weights_from_disk(self, path: str) -> dict[str, Any]:
        """`update_weights` from a checkpoint on disk (a model directory or a .gguf file of
        the same shape)."""
        return self._run(self.engine.update_weights_from_disk(path))

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` runs with when given no params: the model's sampling defaults
        (`generation_config`: its generation_config.json or GGUF general.sampling.*) over
        SamplingParams' own."""
        return self.engine.default_sampling_params()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (`encode`, `decode`, `apply_chat_template`; unlike
        transformers', `encode` adds no special tokens and `apply_chat_template` returns text
        unless `tokenize=True`)."""
        return self.engine.tokenizer

    def generate(self, prompts: Any = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, params: Any = None,
                 prompt_token_ids: Any = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a string, a list of token ids, or
        vLLM's `{"prompt": ...}` / `{"prompt_token_ids": [...]}`; `params` is another name for
        `sampling_params`, `prompt_token_ids` vLLM's old way to pass token-id prompts.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (`enable_lora`);
        `priority`: one per prompt (vLLM's; lower runs first under the "priority" policy),
        replacing the params' own."""
        params = _one_params(sampling_params, params)
        if prompt_token_ids is not None:
            if prompts is not None:
                raise TypeError("pass prompts or prompt_token_ids, not both")
            prompts = prompt_token_ids
        if prompts is None:
            raise ValueError("generate needs a prompt (text or token ids) or a list of them")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            plist = [params or self.get_default_sampling_params()] * len(prompts)
        else:
            plist = _params_list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        plist = [p.replace(output_kind="final") for p in _salted(prompts, plist)]
        if priority is not None:
            if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence) or \
                    len(priority) != len(prompts):
                raise ValueError(f"priority must be a list of one integer per prompt "
                                 f"({len(prompts)})")
            plist = [p.replace(priority=k) for p, k in zip(plist, priority)]
        loras = _loras_list(lora_request, len(prompts))
        prompts = [_prompt_of(p) for p in prompts]
        return self._run(self._generate_all(prompts, plist, None,
                                            use_tqdm and len(prompts) >= PROGRESS_MIN_PROMPTS,
                                            loras=loras))

    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None, *,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: one `EmbeddingRequestOutput` per prompt (a string, token ids or
        a prompt dict), in order; `outputs.embedding` is the pooled vector (`PoolingParams`:
        last-token pooling, normalized, by default). All prompts are checked before any runs."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError("pooling_params must be a PoolingParams")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        loras = _loras_list(lora_request, len(prompts))
        prompts = [_prompt_of(p) for p in prompts]
        pooling = pooling_params or PoolingParams()
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind="final",
                                truncate_prompt_tokens=truncate_prompt_tokens)

        async def run() -> list[EmbeddingRequestOutput]:
            outs = await self._generate_all(
                prompts, [params] * len(prompts), None,
                use_tqdm and len(prompts) >= PROGRESS_MIN_PROMPTS, pooling=pooling, loras=loras)
            return [EmbeddingRequestOutput.of(out) for out in outs]

        return self._run(run())

    def score(self, text_1: Any, text_2: Any, pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score` for embedding models: one `ScoringRequestOutput` per pair,
        `outputs.score` the cosine similarity of the two texts' embeddings. `text_1` is one
        text (scored against each of `text_2`) or a list as long as `text_2` (pairwise); a
        text is a string or token ids."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError("pooling_params must be a PoolingParams")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError("lora_request must be a LoRARequest")
        return self._run(self.engine.score(text_1, text_2, pooling_params,
                                           truncate_prompt_tokens=truncate_prompt_tokens,
                                           lora_request=lora_request))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads a LoRA adapter now (vLLM's `llm.llm_engine.add_lora`); see
        `AsyncEngine.add_lora`."""
        return self._run(_call(self.engine.add_lora, lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Frees a LoRA adapter's slot (vLLM's `remove_lora`); see `AsyncEngine.remove_lora`."""
        return self._run(_call(self.engine.remove_lora, lora_int_id))

    def list_loras(self) -> set[int]:
        """The ids of the loaded LoRA adapters (vLLM's `list_loras`)."""
        return self._run(_call(self.engine.list_loras))

    def beam_search(self, prompts: Any, params: BeamSearchParams, *,
                    use_tqdm: bool = False,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: one `BeamSearchOutput` per prompt (a string, token ids or
        a prompt dict), its `sequences` the best `params.beam_width` beams, best first. The
        searches run side by side; transformers' rules (`engine/beam_search.py`)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError("params must be a BeamSearchParams")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        loras = _loras_list(lora_request, len(prompts)) or [None] * len(prompts)
        prompts = [_prompt_of(p) for p in prompts]

        async def run() -> list[BeamSearchOutput]:
            bar = None
            if use_tqdm:
                from tqdm import tqdm
                bar = tqdm(total=len(prompts), desc="Beam search", dynamic_ncols=True)

            async def one(prompt: Any, lora: LoRARequest | None) -> BeamSearchOutput:
                out = await self.engine.beam_search(prompt, params, lora_request=lora)
                if bar is not None:
                    bar.update(1)
                return out

            tasks = [asyncio.ensure_future(one(p, r)) for p, r in zip(prompts, loras)]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:
                    t.cancel()
                if bar is not None:
                    bar.close()

        return self._run(run())

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None, params: Any = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Chat completion(s): one conversation (a list of messages) or a list of them.

        As vLLM's: `continue_final_message` (with `add_generation_prompt=False`) ends the
        prompt inside the last assistant message, for the model to go on with it; `tools` and
        `chat_template_kwargs` are passed to the chat template; `chat_template` (Jinja text)
        replaces the model's for these conversations. Without params a reply takes the
        model's sampling defaults (`get_default_sampling_params`) and may fill the context
        (`max_tokens=None`, unless the model caps it; vLLM's default is 16 tokens). `lora_request`: the
        LoRA adapter of every conversation, or one per conversation."""
        params = _one_params(sampling_params, params)
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if params is None or isinstance(params, SamplingParams):
            plist = [params or self.engine.default_sampling_params(max_tokens=None)] * len(convs)
        else:
            plist = _params_list(params)
            if len(plist) != len(convs):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(convs)} conversations")
        plist = [p.replace(output_kind="final") for p in plist]
        options: dict[str, Any] = {}
        for name, value, default in (("add_generation_prompt", add_generation_prompt, True),
                                     ("continue_final_message", continue_final_message, False)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool")
            if value != default:
                options[name] = value
        if tools is not None:
            options["tools"] = tools
        if chat_template_kwargs:
            options["template_kwargs"] = chat_template_kwargs
        if chat_template is not None:
            options["chat_template"] = chat_template
        loras = _loras_list(lora_request, len(convs))
        return self._run(self._generate_all([None] * len(convs), plist, convs,
                                            use_tqdm and len(convs) >= PROGRESS_MIN_PROMPTS,
                                            options or None, loras=loras))

    async def _generate_all(self, prompts: list[Any], plist: list[SamplingParams],
                            convs: list[Any] | None, progress: bool,
                            chat_options: dict[str, Any] | None = None,
                            pooling: PoolingParams | None = None,
                            loras: list[LoRARequest | None] | None = None
                            ) -> list[RequestOutput]:
        engine = self.engine
        streams = []
        distinct = {r.lora_int_id: r for r in loras or () if r is not None}
        # adapters not loaded yet are read from their files off the engine's event loop
        await asyncio.gather(*(engine.prepare(None, lora_request=r) for r in distinct.values()))
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                # Validate everything first, so one bad prompt fails the call before any work.
                streams.append(engine.add_request(prompt, p, str(next(self._request_ids)),
                                                  messages=convs[i] if convs else None,
                                                  chat_options=chat_options, pooling=pooling,
                                                  lora_request=loras[i] if loras else None))
            bar = None
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=len(streams), desc="Processed prompts", dynamic_ncols=True)

            done_tokens = [0, 0]        # prompt, output tokens of the finished requests

            async def one(s: Any) -> RequestOutput:
                last = None
                async for out in s:
                    last = out
                if bar is not None:
                    done_tokens[0] += len(last.prompt_token_ids or ())
                    done_tokens[1] += sum(len(o.token_ids) for o in last.outputs)
                    elapsed = bar.format_dict["elapsed"]
                    if elapsed > 0:             # as vLLM's bar says it
                        bar.set_postfix_str(f"est. speed input: {done_tokens[0] / elapsed:.1f} "
                                            f"toks/s, output: {done_tokens[1] / elapsed:.1f} "
                                            f"toks/s", refresh=False)
                    bar.update(1)
                return last

            try:
                return list(await asyncio.gather(*(one(s) for s in streams)))
            finally:
                if bar is not None:
                    bar.close()
        finally:
            for s in streams:
                s.abort()

    def close(self) -> None:
        """Stop the engine and its loop thread (also done at interpreter exit)."""
        if self._loop.is_closed():
            return
        if self.engine is not None and getattr(self.engine, "_core", None) is not None:
            try:
                self._run(self.engine.shutdown())
            except Exception:  # noqa: BLE001 - best effort during teardown
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _call(fn: Any, *args: Any) -> Any:
    """`fn(*args)` on the engine's event loop thread (where the LoRA registry lives)."""
    return fn(*args)


def _loras_list(lora_request: Any, count: int) -> list[LoRARequest | None] | None:
    """One LoRARequest (or None) per prompt from vLLM's `lora_request` argument."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return None if lora_request is None else [lora_request] * count
    if isinstance(lora_request, (str, bytes, dict)) or not isinstance(lora_request, Sequence):
        raise TypeError("lora_request must be a LoRARequest or a list of them")
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
    if not all(r is None or isinstance(r, LoRARequest) for r in loras):
        raise TypeError("lora_request must be a LoRARequest or a list of them")
    return loras


def _params_list(params: Any) -> list[SamplingParams]:
    """`params` as a list of SamplingParams; TypeError for anything else (e.g. a dict)."""
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Sequence):
        raise TypeError("params must be a SamplingParams or a list of them, got "
                        f"{type(params).__name__}")
    plist = list(params)
    for p in plist:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got a {type(p).__name__} in the list")
    return plist
