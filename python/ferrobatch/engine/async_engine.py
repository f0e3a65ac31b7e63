"""AsyncEngine: the asyncio face of the engine.

    async with AsyncEngine(model="smollm2") as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="a"):
            print(out.outputs[0].text)

Accepting a request (`add_request`) validates and tokenizes it, then pushes it onto the Rust
intake; nothing is allocated for a request that fails validation. The step thread hands each
step's output back once (`_on_step`), where tokens are detokenized, stop strings are checked
and each request's stream is woken. A request leaves every table exactly when the scheduler has
reported the terminal event of each of its sequences (`_release`, the one release path).
A LoRA request whose adapter finds no free slot (every one held by running requests) is accepted
and waits here, in order, until a running LoRA request releases one (`_submit_lora_waiting`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ferrobatch.config import EngineConfig
from ferrobatch.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from ferrobatch.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    LoraSlotsBusyError,
    QueueFullError,
)
from ferrobatch.engine.inputs import (
    MAX_PROMPT_CHARS,
    check_prompt_text,
    check_token_ids,
    normalize_messages,
)
from ferrobatch.engine.observer import EngineObserver, FinishedRequest
from ferrobatch.engine.request_state import FINISH_STOP, LogprobMismatch, RequestState
from ferrobatch.engine.scoring import ScoringRequestOutput, pairs_of
from ferrobatch.engine.scoring import score as score_pairs
from ferrobatch.engine.step_loop import StepLoop
from ferrobatch.guided.after_reasoning import PARSERS as REASONING_PARSERS
from ferrobatch.lora_request import LoRARequest
from ferrobatch.model.generation_defaults import under_door_defaults
from ferrobatch.model.tokenizer import LONG_TEXT_CHARS
from ferrobatch.outputs import RequestOutput
from ferrobatch.pooling_params import EmbeddingRequestOutput, PoolingParams
from ferrobatch.sampling_params import SamplingParams

Prompt = str | Sequence[int]
logger = logging.getLogger(__name__)     # DEBUG: a line per request accepted and finished

PRETOKENIZED_KEPT = 8        # long prompts tokenized by prepare() and not yet added


_CHAT_OPTIONS = frozenset({"add_generation_prompt", "continue_final_message", "tools",
                           "template_kwargs", "chat_template"})


def _chat_options(options: Any) -> dict[str, Any]:
    """`render_chat`'s keywords from a request's chat options (TypeError for a bad shape)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError("chat_options must be a dict of render_chat keywords")
    unknown = sorted(set(options) - _CHAT_OPTIONS)
    if unknown:
        raise TypeError(f"unknown chat option(s): {', '.join(map(str, unknown))}")
    return options


def _content_chars(messages: Any) -> int:
    """Characters of a chat's string contents (a cheap lower bound of its rendered length)."""
    if not isinstance(messages, (list, tuple)):
        return 0
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):          # text parts
            total += sum(len(p["text"]) for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


class RequestStream:
    """Async iterator over one request's outputs; `abort()` cancels it."""

    def __init__(self, engine: "AsyncEngine", state: RequestState) -> None:
        self._engine = engine
        self._state = state

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._state.prompt_token_ids

    @property
    def finished(self) -> bool:
        return self._state.final_emitted

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        st = self._state
        while True:
            out = st.build_output()
            if out is not None:
                return out
            if st.final_emitted:
                raise StopAsyncIteration
            st.event.clear()
            await st.event.wait()

    def abort(self) -> None:
        """Cancel the request unless it has already finished (idempotent)."""
        if not self._state.user_finished:
            self._engine._abort_state(self._state, "abort")


# stands in for the final message's text to find where it starts (continue_final_message)
CONTINUE_MARKER = "\x00continue-final-message\x00"
# names the chat template gets from the engine, which chat_template_kwargs may not replace
# names chat_template_kwargs may not set: the template's own inputs, and apply_chat_template's
# keywords (a client's `chat_template` there would replace the operator's template)
TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                               "tools", "chat_template", "tokenize"})


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, *, loaded_model: Any = None,
                 core: Any = None, **options: Any) -> None:
        """`loaded_model`: an already loaded model to share; `core`: a prebuilt object with
        EngineCore's interface (embedding the engine elsewhere, tests)."""
        if config is not None and options:
            raise TypeError("pass either an EngineConfig or keyword options, not both")
        self.config = config if config is not None else EngineConfig.from_options(**options)
        self._loaded = loaded_model
        self._core: Any = core
        self._loop_thread: StepLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests: dict[int, RequestState] = {}
        self._by_name: dict[str, int] = {}
        self._unscheduled: set[int] = set()
        # accepted LoRA requests waiting for a slot (every slot held by running requests),
        # submitted in order as running requests release theirs (_submit_lora_waiting)
        self._lora_waiting: collections.deque[RequestState] = collections.deque()
        self._tasks: set[asyncio.Task] = set()      # background work (_background)
        self._ids = itertools.count(1)
        self._observers: list[EngineObserver] = []
        self._probes: set[int] = set()     # readiness probes: not traffic, observers skip them
        self._dead: BaseException | None = None
        self._stopped = False
        self._stats: dict[str, Any] = {}
        self._compile_lock: asyncio.Lock | None = None     # guided grammars, see prepare()
        # long prompts, see prepare(); keyed by (text, whether special tokens were added)
        self._pretokenized: dict[tuple[str, bool], list[int]] = {}
        # cleared while generation is paused (pause_generation): new requests wait in prepare()
        self._resumed: asyncio.Event | None = None
        self._closing = False      # shutdown() has begun: no new request is accepted
        self.counters = {"accepted": 0, "released": 0, "rejected": 0, "stop": 0, "length": 0,
                         "abort": 0, "error": 0, "guided": 0, "probes": 0,
                         "probe_prompt_tokens": 0}

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> "AsyncEngine":
        if self._loop_thread is not None:
            return self
        self._loop = asyncio.get_running_loop()
        if self._core is None:
            from ferrobatch.engine.core import EngineCore
            self._core = await asyncio.to_thread(EngineCore.build, self.config, self._loaded)
        self._stats = self._core.stats()
        self._loop_thread = StepLoop(self._core, self._loop, self._on_step, self._on_fatal)
        self._loop_thread.start()
        return self

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop the engine: wait up to `drain_timeout_s` for in-flight requests, abort the rest."""
        if self._loop_thread is None or self._stopped:
            return
        if drain_timeout_s > 0 and self._requests and self._dead is None:
            try:
                await asyncio.wait_for(self.wait_idle(), drain_timeout_s)
            except asyncio.TimeoutError:
                pass
        self._closing = True               # drained: nothing new from here on
        self._resume_doors()               # requests waiting for a resume meet a dead engine
        self._loop_thread.set_paused(False)      # (aborts take effect in steps)
        self.abort_all()
        if self._requests and self._dead is None:
            try:
                await asyncio.wait_for(self.wait_idle(), 10.0)
            except asyncio.TimeoutError:
                pass
        self._stopped = True
        await asyncio.to_thread(self._loop_thread.stop)
        self._fail_all("the engine was shut down", "abort")

    async def __aenter__(self) -> "AsyncEngine":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    # -- properties used by the doors ----------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._core.model_name

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def attention_backend(self) -> str:
        """Name of the attention backend the model runs with ("cuda", "cpu" or "torch")."""
        return self._core.runner.attn_backend.name

    @property
    def attention_kernels(self) -> str:
        """What runs attention, in words (the backend's name, or the Rust kernels' instruction
        set and where prompt chunks go)."""
        runner = getattr(self._core, "runner", None)
        return getattr(runner, "attention_kernels", None) or self.attention_backend

    @property
    def linear_kernels(self) -> str:
        """What runs the linear layers, in words ("torch", or the Rust kernels' instruction set
        and whether GGUF blocks serve small steps)."""
        return getattr(getattr(self._core, "runner", None), "linear_kernels", "torch")

    def kv_cache_config(self) -> dict[str, Any] | None:
        """The KV cache's ``block_size``, ``num_blocks``, ``cache_dtype`` (e.g. "float32") and
        ``num_bytes``; None without a model runner (not started, or a stand-in core)."""
        kv = getattr(getattr(self._core, "runner", None), "kv_cache", None)
        if kv is None:
            return None
        return {"block_size": kv.block_size, "num_blocks": kv.num_blocks,
                "cache_dtype": str(kv.dtype).removeprefix("torch."), "num_bytes": kv.num_bytes}

    @property
    def kv_cache(self) -> str:
        """The KV cache in words: blocks, tokens per block, dtype and size."""
        c = self.kv_cache_config()
        if c is None:
            return "unknown"
        return (f"{c['num_blocks']} blocks of {c['block_size']} tokens, {c['cache_dtype']}, "
                f"{c['num_bytes'] / 2**30:.2f} GiB")

    @property
    def speculation(self) -> str:
        """The speculative-decoding setting in words ("off", or drafts and load limit)."""
        return getattr(self._core, "speculation", "off")

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    @property
    def tokenizer(self) -> Any:
        return self._core.tokenizer

    @property
    def default_sampling_fields(self) -> dict[str, Any]:
        """The model's sampling defaults (``EngineConfig.generation_config``; ``{}`` when it has
        none): the fields a request leaves unset take them, except ``max_tokens``, which caps
        the requests that fill the context."""
        return dict(getattr(self._core, "default_sampling", None) or {})

    def default_sampling_params(self, **door: Any) -> SamplingParams:
        """SamplingParams of the model's defaults (vLLM's ``get_default_sampling_params``):
        what a request without params runs with; `door` sets fields over them
        (``generation_defaults.under_door_defaults``; the model's ``max_tokens`` caps requests
        that fill the context, when they are accepted)."""
        return SamplingParams(**under_door_defaults(self.default_sampling_fields, door))

    @property
    def is_running(self) -> bool:
        return (self._core is not None and self._dead is None and not self._stopped
                and self._loop_thread is not None and self._loop_thread.alive)

    @property
    def dead_reason(self) -> str | None:
        if self._dead is not None:
            return f"{type(self._dead).__name__}: {self._dead}"
        return "the engine is stopped" if self._stopped else None

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def stats(self) -> dict[str, Any]:
        """Latest scheduler snapshot (taken on the step thread) plus engine-side counts."""
        s = dict(self._stats)
        s["num_open_requests"] = len(self._requests)
        s["num_unscheduled_requests"] = len(self._unscheduled)
        s["num_lora_waiting_requests"] = len(self._lora_waiting)
        loras = self.loras
        if loras is not None:
            s["lora"] = {"max_loras": loras.max_loras, "loads_total": loras.loads,
                         "evictions_total": loras.evictions,
                         "running": sorted(e["name"] for e in loras.loaded() if e["refs"]),
                         "waiting": sorted({st.lora.lora_name for st in self._lora_waiting})}
        s["num_guided_requests_total"] = self.counters["guided"]
        s["num_probe_prompt_tokens_total"] = self.counters["probe_prompt_tokens"]
        guided = getattr(self._core, "_guided", None)
        s["num_guided_grammars_cached"] = guided.num_cached() if guided is not None else 0
        s["weights_version"] = self.weights_version
        s["generation_paused"] = self.is_paused
        return s

    # -- requests ------------------------------------------------------------------------------

    def render_chat(self, messages: Any, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    chat_template: str | None = None) -> str:
        """A conversation as prompt text through the model's chat template (ValueError for bad
        messages or options). `continue_final_message`: the text ends inside the last
        (assistant) message, for the model to go on with it; `tools` and `template_kwargs`
        are passed to the template (vLLM's `chat_template_kwargs`); `chat_template` (Jinja
        text) is used instead of the model's for this conversation (Python only: the network
        doors refuse a client's template)."""
        msgs = normalize_messages(messages)
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & TEMPLATE_RESERVED)
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if tools is not None:
            extra["tools"] = tools
        if chat_template is not None:
            if not isinstance(chat_template, str) or not chat_template.strip():
                raise ValueError("chat_template must be a non-empty Jinja text")
            extra["chat_template"] = chat_template
        if not continue_final_message:
            return self._core.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, **extra)
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        final = msgs[-1]["content"]
        if msgs[-1]["role"] != "assistant" or not final.strip():
            raise ValueError("continue_final_message needs a last message from the assistant "
                             "with some content")
        render = self._core.tokenizer.apply_chat_template
        text = render(msgs, add_generation_prompt=False, **extra)
        # Where the final text starts: render once more with a marker in its place (the text
        # before it is the same), then cut after the final text, dropping what closes the turn.
        # (Searching for the text itself could find it inside the closing tag, e.g. "end".)
        marked = render(msgs[:-1] + [{**msgs[-1], "content": CONTINUE_MARKER}],
                        add_generation_prompt=False, **extra)
        start = marked.find(CONTINUE_MARKER)
        for piece in (final, final.strip()):          # a template may strip the content
            if start >= 0 and text.startswith(piece, start):
                return text[:start + len(piece)]
        raise ValueError("the chat template does not render the final message's text "
                         "verbatim, so it cannot be continued")

    def add_request(self, prompt: Prompt | None = None, params: SamplingParams | None = None,
                    request_id: str | None = None, *, messages: Any = None,
                    chat_options: dict[str, Any] | None = None,
                    pooling: PoolingParams | None = None,
                    lora_request: LoRARequest | None = None,
                    reasoning_parser: str | None = None,
                    _probe: bool = False) -> RequestStream:
        """Validate, tokenize and submit; raises ValueError (bad input), QueueFullError or
        EngineDeadError before anything is allocated. `messages` are rendered by the chat
        template, with `chat_options` (`render_chat`'s keywords) if given. With `pooling` the
        final output also carries the prompt's embedding (`embed` is the short way). With
        `lora_request` the request runs with that LoRA adapter (`enable_lora`). With
        `reasoning_parser` ("deepseek_r1", "qwen3") a guided request's grammar applies only
        after the reply's reasoning (`guided/after_reasoning.py`)."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not started")
        if self._closing:
            raise EngineDeadError("the engine is shutting down")
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError("lora_request must be a LoRARequest")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: "
                             f"{', '.join(REASONING_PARSERS)}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id
                                       or len(request_id) > 256):
            raise ValueError("request_id must be a non-empty string of at most 256 characters")
        if request_id is not None and request_id in self._by_name:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        if len(self._unscheduled) >= self.config.max_queued_requests:
            self.counters["rejected"] += 1
            raise QueueFullError(f"{len(self._unscheduled)} requests are already waiting; "
                                 "retry later")
        core, cfg = self._core, self.config
        # a text prompt gets the model's BOS if it wants one (as transformers' tokenizer(text)
        # and vLLM); a rendered chat does not: its template writes what it needs
        special = messages is None
        if messages is not None:
            if prompt is not None:
                raise ValueError("pass either a prompt or messages, not both")
            prompt = self.render_chat(messages, **_chat_options(chat_options))
        elif chat_options:
            raise ValueError("chat options need messages")
        if isinstance(prompt, str):
            text: str | None = check_prompt_text(prompt)
            ids = self._pretokenized.pop((prompt, special), None)        # see prepare()
            if ids is None:
                ids = list(core.tokenizer.encode(prompt, add_special_tokens=special))
            if not ids:
                raise ValueError("prompt must not be empty")
            kept = params.truncated_prompt(ids, core.max_model_len)
            if len(kept) < len(ids):      # the prompt reported is the text the model saw
                ids, text = kept, core.tokenizer.decode(kept, skip_special_tokens=False)
            check_token_ids(ids, core.vocab_size, core.max_model_len)
        elif prompt is None:
            raise ValueError("a prompt (text or token ids) or messages is required")
        else:
            text = None
            if isinstance(prompt, (list, tuple)):
                prompt = params.truncated_prompt(list(prompt), core.max_model_len)
            ids = check_token_ids(prompt, core.vocab_size, core.max_model_len)
        max_tokens = params.check_against(
            prompt_len=len(ids), max_model_len=core.max_model_len, vocab_size=core.vocab_size,
            max_n=cfg.max_n, max_stop_strings=cfg.max_stop_strings,
            max_stop_string_len=cfg.max_stop_string_len,
            max_stop_token_ids=cfg.max_stop_token_ids, max_logit_bias=cfg.max_logit_bias)
        model_cap = (getattr(core, "default_sampling", None) or {}).get("max_tokens")
        if params.max_tokens is None and model_cap is not None:   # the model's max_new_tokens
            max_tokens = min(max_tokens, model_cap)

        req_id = next(self._ids)
        name = request_id if request_id is not None else self._free_name(req_id)
        detoks = [core.new_detokenizer(ids, params) for _ in range(params.n)]
        state = RequestState(req_id, name, text, ids, params, max_tokens, detoks, time.monotonic())
        if pooling is not None:
            if not isinstance(pooling, PoolingParams):
                raise TypeError("pooling must be a PoolingParams")
            hidden = getattr(core, "hidden_size", None)
            if hidden is not None and (pooling.dimensions or 0) > hidden:
                raise ValueError(f"dimensions ({pooling.dimensions}) exceeds this model's "
                                 f"embedding size ({hidden})")
            state.pooling = pooling
        state.lora = lora_request
        state.reasoning_parser = reasoning_parser
        # behind requests that wait for a LoRA slot: FIFO (lora_registry.must_queue)
        queue = {"lora_queue": True} if lora_request is not None and self._lora_waiting and \
            self.loras is not None and self.loras.must_queue(lora_request.lora_int_id) else {}
        try:
            core.submit(req_id, ids, params, max_tokens, state, **queue)  # QueueFullError...
        except LoraSlotsBusyError:
            # every slot holds an adapter of a running request: wait for one (FIFO), accepted;
            # meanwhile its adapter's files are read off the event loop
            self._lora_waiting.append(state)
            if self.loras.needs_read(lora_request):
                self._background(self._read_adapter(lora_request))
        if _probe:            # (its step results reach this thread only after we return)
            self._probes.add(req_id)
        self._requests[req_id] = state
        self._by_name[name] = req_id
        self._unscheduled.add(req_id)
        self.counters["accepted"] += 1
        if params.is_guided:
            self.counters["guided"] += 1
        if logger.isEnabledFor(logging.DEBUG) and not _probe:
            logger.debug("request %s: %d prompt tokens, max_tokens %d, n %d, temperature %g%s",
                         name, len(ids), max_tokens, params.n, params.temperature,
                         ", guided" if params.is_guided else "")
        return RequestStream(self, state)

    async def prepare(self, params: SamplingParams | None, prompt: Prompt | None = None,
                      messages: Any = None, chat_options: dict[str, Any] | None = None,
                      lora_request: LoRARequest | None = None) -> None:
        """The slow parts of accepting a request, done off the event loop so that the
        `add_request` that follows finds them done: a long text prompt (or rendered chat) is
        tokenized on a worker thread, a LoRA adapter not loaded yet is read from its files, and
        a guided request's grammar is compiled (one compile
        at a time, so a big schema can hold the next new one for seconds; a grammar compiled
        before is found in the cache without waiting). Optional: without
        it `add_request` does the same work inline. Raises ValueError for a grammar that cannot
        be used; a bad prompt (or adapter) is left for `add_request` to report."""
        if not self.is_running:
            return
        if self._resumed is not None and not self._resumed.is_set():
            await self._resumed.wait()       # generation paused: wait for resume_generation
            if not self.is_running:
                return
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if isinstance(lora_request, LoRARequest):
            await self._read_adapter(lora_request)
        text = prompt if isinstance(prompt, str) else None
        if messages is not None and prompt is None and _content_chars(messages) >= \
                LONG_TEXT_CHARS // 2:          # short chats are rendered once, in add_request
            try:              # a long chat: rendered off the event loop too
                text = await asyncio.to_thread(self.render_chat, messages,
                                               **_chat_options(chat_options))
            except (TypeError, ValueError):
                text = None
        if text is not None and LONG_TEXT_CHARS <= len(text) <= MAX_PROMPT_CHARS:
            special = isinstance(prompt, str)      # a text prompt: BOS if wanted (add_request)
            ids = await asyncio.to_thread(self._core.tokenizer.encode, text, special)
            self._pretokenized[(text, special)] = ids
            while len(self._pretokenized) > PRETOKENIZED_KEPT:
                self._pretokenized.pop(next(iter(self._pretokenized)))
        if params is None or not params.is_guided:
            return
        guided = self._core.guided
        if guided.cached_grammar_for(params) is not None:
            return                      # compiled before: no need to queue behind a compile
        if self._compile_lock is None:
            self._compile_lock = asyncio.Lock()
        async with self._compile_lock:
            await asyncio.to_thread(guided.grammar_for, params)

    async def generate(self, prompt: Prompt | None = None, params: SamplingParams | None = None,
                       request_id: str | None = None, *, messages: Any = None,
                       chat_options: dict[str, Any] | None = None,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; leaving the loop early aborts the request."""
        await self.prepare(params, prompt, messages, chat_options, lora_request)
        stream = self.add_request(prompt, params, request_id, messages=messages,
                                  chat_options=chat_options, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def embed(self, prompt: Prompt, pooling: PoolingParams | None = None,
                    request_id: str | None = None, *,
                    truncate_prompt_tokens: int | None = None,
                    lora_request: LoRARequest | None = None) -> EmbeddingRequestOutput:
        """The prompt's embedding (`PoolingParams`: last-token or mean pooling of the final
        hidden states, cut to `dimensions`, normalized); batched with all other traffic.
        Raises ValueError for bad input; cancelling it aborts the request."""
        pooling = pooling if pooling is not None else PoolingParams()
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind="final",
                                truncate_prompt_tokens=truncate_prompt_tokens)
        await self.prepare(params, prompt, lora_request=lora_request)
        stream = self.add_request(prompt, params, request_id, pooling=pooling,
                                  lora_request=lora_request)
        try:
            last = None
            async for out in stream:
                last = out
        finally:
            stream.abort()
        return EmbeddingRequestOutput.of(last)

    async def score(self, text_1: Any, text_2: Any, pooling: PoolingParams | None = None, *,
                    truncate_prompt_tokens: int | None = None,
                    lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's scoring for embedding models: the cosine similarity of each pair's
        embeddings (`engine/scoring.py`; one text against a list, or two lists pairwise).
        ValueError for bad input."""
        return await score_pairs(self, pairs_of(text_1, text_2), pooling,
                                 truncate_prompt_tokens=truncate_prompt_tokens,
                                 lora_request=lora_request)

    async def beam_search(self, prompt: Prompt | None, params: BeamSearchParams, *,
                          messages: Any = None, chat_options: dict[str, Any] | None = None,
                          lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        """Beam search with transformers' rules (`engine/beam_search.py`): the best
        `params.beam_width` beams, best first. Each step's beams are one-token requests batched
        with the other traffic; cancelling the call aborts them."""
        return await beam_search(self, prompt, params, messages=messages,
                                 chat_options=chat_options, lora_request=lora_request)

    def _free_name(self, req_id: int) -> str:
        """A name for a request given none: `req-<n>`, unless a caller chose that one."""
        name, k = f"req-{req_id}", 0
        while name in self._by_name:
            k += 1
            name = f"req-{req_id}.{k}"
        return name

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request by id; True if it was found. The KV is freed within a step."""
        req_id = self._by_name.get(request_id)
        if req_id is None:
            return False
        self._abort_state(self._requests[req_id], "abort")
        return True

    def _observers_of(self, req_id: int) -> Sequence[EngineObserver]:
        """Who hears about this request: nobody for a readiness probe (not traffic)."""
        return () if req_id in self._probes else self._observers

    def abort_all(self) -> int:
        """Abort every in-flight request (each stream ends with finish reason "abort"); returns
        how many there were."""
        states = list(self._requests.values())
        for st in states:
            self._abort_state(st, "abort")
        return len(states)

    def _abort_state(self, st: RequestState, reason: str, seq_index: int = -1) -> None:
        if st.all_terminal or st.req_id not in self._requests:
            return
        if st in self._lora_waiting:   # never reached the scheduler (no tokens yet): end it here
            self._lora_waiting.remove(st)
            self._end_locally(st, reason, None)      # (its release submits those behind it)
            return
        if seq_index == -1:
            if st.abort_sent:
                return
            st.abort_sent = True
        if self.is_running:
            self._core.abort(st.req_id, seq_index, reason)

    # -- the per-step hand-off (asyncio thread) ------------------------------------------------

    def _on_step(self, result: Any) -> None:
        if self._stopped:
            return                     # shut down: the remaining requests were failed already
        try:
            self._apply_step(result)
        except BaseException as exc:  # noqa: BLE001 - a bug here must not leave a zombie engine
            self._on_fatal(exc)

    def _apply_step(self, r: Any) -> None:
        now = time.monotonic()
        self._stats = r.stats
        requests = self._requests
        # tokens the step computed, unless it ran readiness probes only (not traffic; checked
        # before this step's releases forget them)
        computed = getattr(r, "num_batched_tokens", 0)
        if computed and self._probes and self._probes.issuperset(r.scheduled_req_ids):
            computed = 0
        if self._unscheduled and r.scheduled_req_ids:
            step_start = now - r.step_time_s
            starts = getattr(r, "seq_start_positions", None) or ()
            first = {}                            # newly scheduled id -> its sequence's start
            if starts:
                for rid, start in zip(r.scheduled_req_ids, starts):
                    if rid in self._unscheduled:
                        first.setdefault(rid, start)
            for rid in self._unscheduled.intersection(r.scheduled_req_ids):
                self._unscheduled.discard(rid)
                st = requests[rid]
                st.scheduled_time = max(step_start, st.arrival_time)
                st.num_cached_tokens = first.get(rid)
                if rid in self._probes:       # admitted: its prompt was looked up in the cache
                    self.counters["probe_prompt_tokens"] += len(st.prompt_token_ids)
                for o in self._observers_of(rid):
                    o.on_scheduled(st.scheduled_time - st.arrival_time,
                                   len(st.prompt_token_ids))
        reasons = getattr(r, "failure_messages", None) or {}
        for rid in getattr(r, "failed_req_ids", ()):
            st = requests.get(rid)
            if st is not None:                    # its abort("error") is already queued
                st.abort_sent = True
                message = reasons.get(rid, "the model produced non-finite logits for this "
                                           "request")
                for s in st.seqs:
                    st.finish_seq_locally(s.index, "error", message)
        for rid, vec in (getattr(r, "embeddings", None) or {}).items():
            st = requests.get(rid)
            if st is not None:
                st.embedding = vec
                st.version += 1
        for rid, entries in (getattr(r, "prompt_logprobs", None) or {}).items():
            st = requests.get(rid)
            if st is not None and st.prompt_logprobs is not None:
                try:
                    st.add_prompt_logprobs(entries)
                except LogprobMismatch as exc:
                    for s in st.seqs:
                        st.finish_seq_locally(s.index, "error", f"output processing failed: "
                                                                f"{exc}")
                    self._abort_state(st, "error")
        touched: dict[int, RequestState] = {}
        with_tokens: set[int] = set()
        itls: list[float] = []
        num_tokens = 0
        logprobs = getattr(r, "logprobs", None)
        taken: dict[tuple[int, int], int] = {}    # logprob entries used per sequence this step
        for rid, si, tok, code in zip(r.req_ids, r.seq_indices, r.token_ids, r.finish_reasons):
            st = requests.get(rid)
            if st is None:
                raise RuntimeError(f"scheduler reported unknown request {rid}")
            if rid not in touched:
                touched[rid] = st
            if tok >= 0:
                # an embedding's one sampled token is no generation (nor is a probe's)
                num_tokens += rid not in self._probes and st.pooling is None
                with_tokens.add(rid)
                entry = None
                if logprobs and (rid, si) in logprobs:
                    k = taken.get((rid, si), 0)
                    taken[(rid, si)] = k + 1
                    rows = logprobs[(rid, si)]
                    entry = rows[k] if k < len(rows) else None
                self._add_token(st, si, tok, entry, stop_token=code == FINISH_STOP)
            if code:
                st.terminal_event(si, code, r.error_messages.get(rid))
        for rid, st in touched.items():
            if rid in with_tokens:
                if st.first_token_time is None:
                    st.first_token_time = now
                    for o in self._observers_of(rid):
                        o.on_first_token(now - st.arrival_time)
                elif st.last_token_time is not None and rid not in self._probes:
                    itls.append(now - st.last_token_time)
                st.last_token_time = now
            if st.all_terminal:
                self._release(st, now)          # sets the event
            elif st.wants_wakeup():
                st.event.set()
        if num_tokens:
            for o in self._observers:
                o.on_step_tokens(num_tokens, itls)
        if computed:
            for o in self._observers:
                o.on_step(computed)

    def _add_token(self, st: RequestState, si: int, tok: int, logprob: Any = None,
                   stop_token: bool = False) -> None:
        try:
            stopped = st.add_token(si, tok, logprob, stop_token)
        except Exception as exc:  # noqa: BLE001 - a detokenizer failure fails this request only
            what = "output processing" if isinstance(exc, LogprobMismatch) else "detokenization"
            st.finish_seq_locally(si, "error", f"{what} failed: {exc}")
            for s in st.seqs:
                st.finish_seq_locally(s.index, "error")
            self._abort_state(st, "error")
            return
        if stopped:
            self._abort_state(st, "stop", si)

    def _release(self, st: RequestState, now: float) -> None:
        """The one release path: called once, when every sequence has had its terminal event."""
        if self._requests.pop(st.req_id, None) is None:
            return
        self._by_name.pop(st.request_id, None)
        self._unscheduled.discard(st.req_id)
        self._core.forget(st.req_id)
        if st.lora is not None and self._lora_waiting and not self._stopped:
            self._submit_lora_waiting()
        st.finish_time = now
        reasons = [s.finish_reason or "error" for s in st.seqs]
        reason = next((x for x in ("error", "abort") if x in reasons), reasons[0])
        self.counters["released"] += 1
        self.counters[reason] += 1
        if st.req_id in self._probes:
            self._probes.discard(st.req_id)
            self.counters["probes"] += 1          # released, but not shown to observers
        else:
            if self._observers:
                generated = 0 if st.pooling is not None else st.num_generated
                done = FinishedRequest(reason, len(st.prompt_token_ids), generated,
                                       st.max_tokens, len(st.seqs), st.arrival_time,
                                       st.scheduled_time, st.first_token_time,
                                       st.last_token_time, now)
                for o in self._observers:
                    o.on_finished(done)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("request %s finished: %s, %d tokens generated, %.3f s (queued "
                             "%.3f s)", st.request_id, reason, st.num_generated,
                             now - st.arrival_time, (st.scheduled_time or now) - st.arrival_time)
        st.event.set()

    def _on_fatal(self, exc: BaseException) -> None:
        if self._dead is None:
            self._dead = exc
        self._fail_all(f"engine failure: {type(exc).__name__}: {exc}", "error")
        if self._loop_thread is not None and self._loop_thread.alive:
            self._loop_thread._stopping.set()

    def _fail_all(self, message: str, reason: str) -> None:
        """The scheduler will report nothing more: end every open stream now."""
        self._lora_waiting.clear()
        for st in list(self._requests.values()):
            self._end_locally(st, reason, message if reason == "error" else None)

    def _end_locally(self, st: RequestState, reason: str, message: str | None) -> None:
        """Ends every sequence of ``st`` here (the scheduler has no terminal event to send for
        it) and releases it."""
        for s in st.seqs:
            st.finish_seq_locally(s.index, reason, message)
            if not s.terminal:
                s.terminal = True
                st.num_terminal += 1
        self._release(st, time.monotonic())

    def _submit_lora_waiting(self) -> None:
        """Submits the LoRA requests waiting for a slot, in order, until one must wait on; one
        the core refuses for another reason (e.g. its adapter fails to load) ends with that
        error."""
        core = self._core
        while self._lora_waiting:
            st = self._lora_waiting[0]
            try:
                core.submit(st.req_id, st.prompt_token_ids, st.params, st.max_tokens, st)
            except LoraSlotsBusyError:
                return
            except Exception as exc:  # noqa: BLE001 - this request fails, the engine goes on
                self._lora_waiting.popleft()
                self._end_locally(st, "error", f"{type(exc).__name__}: {exc}")
                continue
            self._lora_waiting.popleft()

    # -- accounting and readiness --------------------------------------------------------------

    def check_accounting(self) -> dict[str, Any]:
        """Cheap consistency check of the request tables; raises RuntimeError when broken."""
        c = self.counters
        open_ = len(self._requests)
        problems = []
        if c["accepted"] - c["released"] != open_:
            problems.append(f"accepted {c['accepted']} - released {c['released']} != open {open_}")
        if len(self._by_name) != open_:
            problems.append(f"{len(self._by_name)} names for {open_} open requests")
        if not self._unscheduled <= self._requests.keys():
            problems.append("unscheduled ids not in the request table")
        if not {st.req_id for st in self._lora_waiting} <= self._unscheduled:
            problems.append("requests waiting for a LoRA slot are not unscheduled ones")
        if c["released"] != sum(c[k] for k in ("stop", "length", "abort", "error")):
            problems.append("released requests without a finish reason")
        if problems:
            raise RuntimeError("engine accounting broken: " + "; ".join(problems))
        return {"open": open_, **c, "tracked_extras": self._core.num_tracked() if self._core else 0}

    def is_idle(self) -> bool:
        return not self._requests

    async def wait_idle(self, poll_s: float = 0.005) -> None:
        while self._requests:
            await asyncio.sleep(poll_s)

    async def check_idle_clean(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Wait until idle, then verify: no request left anywhere and every KV block free."""
        await asyncio.wait_for(self.wait_idle(), timeout_s)
        acc = self.check_accounting()
        if acc["tracked_extras"]:
            raise RuntimeError(f"{acc['tracked_extras']} requests still tracked by the core")
        s = self._stats
        if s.get("num_running", 0) or s.get("num_waiting", 0):
            raise RuntimeError(f"scheduler not idle: {s}")
        if self._core is not None and not self._core.all_blocks_free(s):
            raise RuntimeError(f"KV blocks still held at idle: {s}")
        loras = self.loras
        if loras is not None:
            loras.check()
            if loras.num_refs:
                raise RuntimeError(f"{loras.num_refs} LoRA adapter references held at idle")
        if self._core is not None and self.is_running:
            await asyncio.wait_for(asyncio.wrap_future(
                self._loop_thread.call(self._core.check_integrity)), timeout_s)
        return acc

    async def reset_prefix_cache(self) -> int:
        """vLLM's `reset_prefix_cache`: the prefix cache forgets every block no running
        sequence holds, so later requests find no cached prefix (a cold start for benchmarks,
        or after changing what prompts mean); returns how many blocks it dropped."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not started")
        dropped = await asyncio.wrap_future(self._loop_thread.call(self._core.reset_prefix_cache))
        logger.info("prefix cache reset: %d cached blocks dropped", dropped)
        return dropped

    async def apply_model(self, func: Any) -> Any:
        """``func(model)`` run on the step thread between two steps (vLLM's ``apply_model``:
        inspect the served ``torch.nn.Module``); returns what it returns, raises what it
        raises (the engine serves on). Change weights with ``update_weights``, which keeps the
        kernels' copies and the prefix cache right; a ``func`` that writes them itself does
        not."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not started")
        model = self._core.runner.model
        return await asyncio.wrap_future(self._loop_thread.call(lambda: func(model)))

    @property
    def weights_version(self) -> int:
        """How many times the weights were updated in place since start (``update_weights``)."""
        return getattr(self._core, "weights_version", 0)

    @property
    def is_paused(self) -> bool:
        """Whether generation is paused (``pause_generation``)."""
        return self._resumed is not None and not self._resumed.is_set()

    async def pause_generation(self, *, wait_for_inflight_requests: bool = False,
                               clear_cache: bool = True) -> int:
        """vLLM's, for RL loops updating weights between rollouts: new requests wait (every
        door: they are held before they enter the engine, and a request added without
        ``prepare`` waits in the scheduler) until ``resume_generation``. In-flight requests are
        aborted (finish reason ``abort``), or with ``wait_for_inflight_requests`` run to
        their end first; then no step runs (``update_weights`` still does), and with
        ``clear_cache`` the prefix cache forgets its blocks. Returns how many in-flight
        requests were aborted. Pausing a paused engine does nothing."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not started")
        if self.is_paused:
            return 0
        if self._resumed is None:
            self._resumed = asyncio.Event()
        self._resumed.clear()
        aborted = 0
        if not wait_for_inflight_requests:
            aborted = self.abort_all()
        await self.wait_idle()
        if self.is_paused:             # (not resumed meanwhile)
            self._loop_thread.set_paused(True)
            if clear_cache:
                await self.reset_prefix_cache()
        logger.info("generation paused (%d in-flight requests aborted)", aborted)
        return aborted

    async def resume_generation(self) -> None:
        """Ends a ``pause_generation``: steps run again and the held requests go in."""
        if self._loop_thread is not None:
            self._loop_thread.set_paused(False)
        if self.is_paused:
            logger.info("generation resumed")
        self._resume_doors()

    def _resume_doors(self) -> None:
        if self._resumed is not None:
            self._resumed.set()

    async def update_weights(self, weights: Any) -> dict[str, Any]:
        """Replaces the served model's weights in place (what RL loops do between rollouts):
        ``weights`` is ``(name, tensor)`` pairs or a dict, named as in Hugging Face
        checkpoints (``model.layers.0.self_attn.q_proj.weight``), any subset. Every tensor is
        checked (name, shape, finite values) before any is written: a bad one is a ValueError
        and nothing changes. Runs between two steps: running requests go on with the new
        weights (their cached KV stays theirs); a request admitted after it never reuses KV
        computed before (pause around it for every token to see the new weights). Returns
        ``{"tensors", "skipped", "gguf_layers_unblocked", "prefix_blocks_dropped",
        "weights_version"}``."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not started")
        pairs = list(weights.items() if isinstance(weights, dict) else weights)
        t0 = time.perf_counter()
        summary = await asyncio.wrap_future(
            self._loop_thread.call(lambda: self._core.update_weights(pairs)))
        logger.info("weights updated: %d tensors in %.2f s (version %d; %d cached blocks "
                    "dropped)", summary["tensors"], time.perf_counter() - t0,
                    summary["weights_version"], summary["prefix_blocks_dropped"])
        return summary

    async def update_weights_from_disk(self, path: str) -> dict[str, Any]:
        """``update_weights`` with every tensor of a checkpoint on disk (a model directory's
        safetensors or a ``.gguf`` file of the served model's shape), read off the event
        loop; FileNotFoundError / ValueError for one it cannot use."""
        from ferrobatch.model.loader import read_checkpoint_weights
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not started")
        state = await asyncio.to_thread(read_checkpoint_weights, path, self._core.loaded.config)
        return await self.update_weights(state)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's `add_lora`: loads the adapter into a slot now (a bad one is a ValueError
        here rather than on its first request). False when every slot is held by running
        requests (it then loads on first use)."""
        loras = self._lora_registry()
        try:
            loras.load(lora_request)
        except LoraSlotsBusyError:
            return False
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """vLLM's `remove_lora`: frees the adapter's slot; False when it is not loaded or a
        running request holds it."""
        return self._lora_registry().evict(lora_int_id)

    def list_loras(self) -> set[int]:
        """vLLM's `list_loras`: the ids of the loaded adapters."""
        return {e["id"] for e in self._lora_registry().loaded()}

    async def _read_adapter(self, lora_request: LoRARequest) -> None:
        """Reads an adapter that is not loaded on a worker thread and keeps it for the slot it
        will take (`LoraRegistry.keep_read`), so that loading it into a slot on the event loop
        costs no file reading. A bad adapter is left for `add_request` to report."""
        loras = self.loras
        if loras is None or not loras.needs_read(lora_request):
            return
        try:
            adapter = await asyncio.to_thread(loras.read, lora_request)
        except Exception:  # noqa: BLE001 - reported when the request is submitted
            return
        loras.keep_read(lora_request, adapter)

    def _background(self, coro: Any) -> None:
        """Runs `coro` as a task of this loop, kept referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _lora_registry(self) -> Any:
        if self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (start it with "
                             "enable_lora=True / --enable-lora)")
        return self.loras

    @property
    def loras(self) -> Any:
        """The engine's `LoraRegistry` (`enable_lora`), or None: its served adapters,
        `add_served` / `remove_served`, and what is loaded (asyncio thread only)."""
        return getattr(self._core, "loras", None)

    async def check_ready(self, timeout_s: float = 30.0) -> bool:
        """A real one-token generation through the whole engine."""
        if not self.is_running:
            return False
        try:
            stream = self.add_request([self._core.ready_token_id],
                                      SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                     output_kind="final"), _probe=True)
        except Exception:  # noqa: BLE001 - busy or dead: not ready
            return False

        async def first() -> bool:
            async for out in stream:
                return out.outputs[0].finish_reason == "length"
            return False

        try:
            return await asyncio.wait_for(first(), timeout_s)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001
            return False
        finally:
            stream.abort()
