"""LLM: the synchronous, vLLM-style Python entry point.

    llm = LLM(model="smollm2")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)

It runs an AsyncEngine on a private event loop in a background thread, so it works from plain
scripts, from threads and from notebooks that already run an event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from ferrobatch.config import EngineConfig
from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.outputs import RequestOutput
from ferrobatch.sampling_params import SamplingParams

PROGRESS_MIN_PROMPTS = 8
CANCEL_WAIT_S = 10.0      # how long an interrupted call waits for its requests to be aborted


class LLM:
    def __init__(self, model: str = "smollm2", *, loaded_model: Any = None,
                 **engine_options: Any) -> None:
        self.config = EngineConfig.from_options(model=model, **engine_options)
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

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a string or a list of token ids."""
        if prompts is None:
            raise ValueError("generate needs a prompt (text or token ids) or a list of them")
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = _params_list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        plist = [p.replace(output_kind="final") for p in plist]
        return self._run(self._generate_all(prompts, plist, None,
                                            use_tqdm and len(prompts) >= PROGRESS_MIN_PROMPTS))

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             params: SamplingParams | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Chat completion(s): one conversation (a list of messages) or a list of them.

        As vLLM's: `continue_final_message` (with `add_generation_prompt=False`) ends the
        prompt inside the last assistant message, for the model to go on with it; `tools` and
        `chat_template_kwargs` are passed to the chat template."""
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams (one for every conversation)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        p = (params or SamplingParams(max_tokens=None)).replace(output_kind="final")
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
        return self._run(self._generate_all([None] * len(convs), [p] * len(convs), convs,
                                            use_tqdm and len(convs) >= PROGRESS_MIN_PROMPTS,
                                            options or None))

    async def _generate_all(self, prompts: list[Any], plist: list[SamplingParams],
                            convs: list[Any] | None, progress: bool,
                            chat_options: dict[str, Any] | None = None) -> list[RequestOutput]:
        engine = self.engine
        streams = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                # Validate everything first, so one bad prompt fails the call before any work.
                streams.append(engine.add_request(prompt, p,
                                                  messages=convs[i] if convs else None,
                                                  chat_options=chat_options))
            bar = None
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=len(streams), desc="Processed prompts", dynamic_ncols=True)

            async def one(s: Any) -> RequestOutput:
                last = None
                async for out in s:
                    last = out
                if bar is not None:
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
