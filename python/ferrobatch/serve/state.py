"""ServerState: what every door shares (the engine, auth, limits, metrics, open sessions)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ferrobatch.sampling_params import MAX_LOGPROBS
from ferrobatch.serve.codec import MAX_ARRAY_LEN, MAX_FRAME_BYTES, MAX_MAP_LEN

MAX_BODY_BYTES = 1 << 20          # HTTP request bodies


@dataclass
class ServerState:
    engine: Any
    api_key: str | None = None
    metrics: Any = None
    served_model_name: str | tuple[str, ...] | None = None   # names clients use; the first
#                                                           is the one reported
    allowed_origins: frozenset[str] = frozenset()    # CORS (serve/cors.py); empty: off
    reasoning_parser: str | None = None   # chat replies' <think> part (serve/reasoning.py)
    allow_runtime_lora: bool = False  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    allow_weight_updates: bool = False   # POST /update_weights_from_disk
    tool_parser: str | None = None    # --tool-call-parser (None: from the chat template)
    return_tokens_as_token_ids: bool = False   # logprobs show token_id:<id> unless asked not to
    responses: Any = None         # the Responses API's ResponseStore (--enable-response-store)
    batches: Any = None           # the Files / Batches APIs' BatchStore (--enable-batch-api)
    sessions: set = field(default_factory=set)
    websockets: set = field(default_factory=set)     # open WebSocketResponses (closed on stop)
    created: int = field(default_factory=lambda: int(time.time()))
    ready_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    draining: bool = False        # shutting down: in-flight work finishes, new work gets 503
    _token_strings: Any = None

    def token_strings(self) -> Any:
        """The engine tokenizer's id -> string/bytes cache for logprobs (built on first use)."""
        if self._token_strings is None:
            from ferrobatch.serve.logprobs import TokenStrings
            self._token_strings = TokenStrings(self.engine.tokenizer)
        return self._token_strings

    @property
    def tool_call_parser(self) -> str | None:
        """How the model writes its own tool calls, so tool_choice "auto" is served: the
        server's `--tool-call-parser`, else what its chat template asks for (Hermes
        `<tool_call>` blocks or Llama 3 JSON calls: serve/tools.py); None: neither."""
        if self.tool_parser is not None:
            return self.tool_parser
        from ferrobatch.serve.tools import template_tool_parser
        return template_tool_parser(getattr(self.engine.tokenizer, "chat_template", None))

    @property
    def base_model_names(self) -> tuple[str, ...]:
        """The names of the base model (the first is reported by default)."""
        names = self.served_model_name
        if isinstance(names, str):
            return (names,)
        return tuple(names) if names else (self.engine.model_name,)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give as `model`: the base model's, then the served LoRA
        adapters' (serve/lora_api.py)."""
        registry = getattr(self.engine, "loras", None)
        base = self.base_model_names
        return base + tuple(registry.served) if registry is not None and registry.served \
            else base

    @property
    def model_name(self) -> str:
        return self.base_model_names[0]

    @property
    def limits(self) -> dict[str, Any]:
        cfg = self.engine.config
        return {"max_frame_bytes": MAX_FRAME_BYTES, "max_prompt_tokens": MAX_ARRAY_LEN,
                "max_map_entries": MAX_MAP_LEN,
                "max_model_len": self.engine.max_model_len, "max_n": cfg.max_n,
                "max_stop_strings": cfg.max_stop_strings, "max_logprobs": MAX_LOGPROBS}


STATE = web.AppKey("ferrobatch", ServerState)
