"""Server: the HTTP app (OpenAI + WebSocket + service routes) and the TCP door around one engine.

    server = Server(engine, api_key=None)
    await server.start(host="127.0.0.1", port=8000, tcp_port=8001)
    ...
    await server.stop(drain_timeout_s=30)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import WSCloseCode, web

from ferrobatch.engine.stats_logger import StatsLogger
from ferrobatch.serve.batch_api import add_batch_routes
from ferrobatch.serve.cors import install_cors
from ferrobatch.serve.http import add_routes
from ferrobatch.serve.metrics import ServerMetrics, http_metrics_middleware
from ferrobatch.serve.middleware import (
    auth_middleware,
    drain_middleware,
    error_middleware,
    quiet_malformed_request_logs,
)
from ferrobatch.serve.reasoning import PARSERS as REASONING_PARSERS
from ferrobatch.serve.request_ids import add_request_id_header, request_id_middleware
from ferrobatch.serve.state import MAX_BODY_BYTES, STATE, ServerState
from ferrobatch.serve.tcp import TCPServer
from ferrobatch.serve.ws import ws_handler

SHUTDOWN_TIMEOUT_S = 5.0
# --access-log: client, request line, status, response bytes, seconds, X-Request-Id
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf %{X-Request-Id}o'


def build_app(state: ServerState) -> web.Application:
    middlewares = [] if state.metrics is None else [http_metrics_middleware(state.metrics)]
    middlewares += [request_id_middleware(), error_middleware]
    if state.api_key is not None:
        middlewares.append(auth_middleware(state.api_key))
    middlewares.append(drain_middleware(state))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app.on_response_prepare.append(add_request_id_header)
    install_cors(app, state.allowed_origins)
    app[STATE] = state
    add_routes(app)
    add_batch_routes(app)
    app.router.add_get("/v1/ws", ws_handler)
    return app


class Server:
    def __init__(self, engine: Any, *, api_key: str | None = None,
                 served_model_name: str | Sequence[str] | None = None,
                 allowed_origins: frozenset[str] = frozenset(),
                 log_stats_interval_s: float = 0.0, access_log: bool = False,
                 reasoning_parser: str | None = None, allow_runtime_lora: bool = False,
                 allow_weight_updates: bool = False, vllm_metric_names: bool = False,
                 tool_call_parser: str | None = None,
                 return_tokens_as_token_ids: bool = False,
                 response_store: int = 0, batch_api: bool = False,
                 batch_max_file_mb: int = 200, batch_concurrency: int = 64,
                 batch_priority: int = 1) -> None:
        """`allowed_origins`: the browser origins CORS lets call the HTTP API (`"*"`: any;
        empty: CORS off), as `cors.parse_origins` makes them. `log_stats_interval_s` > 0: an
        INFO line of engine activity that often while the server runs (`StatsLogger`);
        `access_log`: an INFO line per HTTP request (logger `ferrobatch.access`).
        `reasoning_parser` ("deepseek_r1", "qwen3"): chat replies' `<think>` part is served as
        `reasoning_content` (`serve/reasoning.py`). `allow_runtime_lora`: LoRA adapters may be
        loaded and unloaded over HTTP (`serve/lora_api.py`; needs an engine with enable_lora).
        `allow_weight_updates`: `POST /update_weights_from_disk` replaces the model's weights
        from a checkpoint on the server's disk (`serve/weights_api.py`). `vllm_metric_names`:
        `/metrics` names its metrics `vllm:...` as vLLM does (its dashboards read them).
        `tool_call_parser` ("hermes", "llama3_json", "mistral"): how the model writes its own
        tool calls, for tool_choice "auto" (default: what the chat template asks for).
        `return_tokens_as_token_ids`: logprobs show tokens as `token_id:<id>` unless a request
        says otherwise (vLLM's flag). `response_store` > 0: the Responses API keeps that many
        finished responses in memory (`previous_response_id`, `GET /v1/responses/{id}`).
        `batch_api`: OpenAI's Files and Batches APIs (`serve/batch_api.py`): uploads of at most
        `batch_max_file_mb`, each batch's requests `batch_concurrency` at a time through a
        loopback address of this same server, at `batch_priority` unless a line sets one."""
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty")
        if served_model_name is not None and not isinstance(served_model_name, str):
            served_model_name = tuple(served_model_name)
            if not served_model_name or not all(isinstance(n, str) and n
                                                for n in served_model_name):
                raise ValueError("served_model_name must be a name or a list of names")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: "
                             f"{', '.join(REASONING_PARSERS)}")
        from ferrobatch.serve.tools import AUTO_PARSERS
        if tool_call_parser is not None and tool_call_parser not in AUTO_PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; known: "
                             f"{', '.join(AUTO_PARSERS)}")
        if allow_runtime_lora and getattr(engine, "loras", None) is None:
            raise ValueError("allow_runtime_lora needs an engine started with enable_lora")
        self.state = ServerState(engine, api_key=api_key, served_model_name=served_model_name,
                                 allowed_origins=frozenset(allowed_origins),
                                 reasoning_parser=reasoning_parser,
                                 allow_runtime_lora=allow_runtime_lora,
                                 allow_weight_updates=allow_weight_updates,
                                 tool_parser=tool_call_parser,
                                 return_tokens_as_token_ids=return_tokens_as_token_ids)
        if response_store:
            from ferrobatch.serve.response_store import ResponseStore
            self.state.responses = ResponseStore(response_store)
        if batch_api:
            from ferrobatch.serve.batch_store import BatchStore
            self.state.batches = BatchStore(max_file_bytes=batch_max_file_mb << 20,
                                            concurrency=batch_concurrency,
                                            priority=batch_priority)
        self.state.metrics = ServerMetrics(engine, self.state.model_name,
                                           "vllm:" if vllm_metric_names else "ferrobatch_")
        self.stats_logger = (StatsLogger(engine, log_stats_interval_s)
                             if log_stats_interval_s > 0 else None)
        self._stats_task: asyncio.Task | None = None
        self._access_log = logging.getLogger("ferrobatch.access") if access_log else None
        self.app = build_app(self.state)
        quiet_malformed_request_logs()
        self._runner: web.AppRunner | None = None
        self._tcp: TCPServer | None = None
        self.port: int | None = None
        self.tcp_port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 8000,
                    tcp_port: int | None = None) -> None:
        # the logprobs' token strings (a table over the vocabulary, ~0.2 s for 49k ids) are
        # built here, off the event loop, instead of stalling it at the first logprobs request
        await asyncio.to_thread(self.state.token_strings)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts
        # its request (the streaming path also notices failed writes).
        # shutdown_timeout: how long cleanup waits for handlers; by then every request has been
        # aborted (stop()), so their last chunks need little (aiohttp's default is 60 s)
        self._runner = web.AppRunner(self.app, handler_cancellation=True,
                                     access_log=self._access_log,
                                     access_log_format=ACCESS_LOG_FORMAT,
                                     shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]          # the real port when port=0
        if self.state.batches is not None:
            # batch jobs post their requests here: the same app (routes, options, auth) on a
            # loopback port of its own, whatever address the server listens on
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
            key = self.state.api_key
            self.state.batches.base_url = f"http://127.0.0.1:{self._runner.addresses[-1][1]}"
            self.state.batches.headers = {"Authorization": f"Bearer {key}"} if key else {}
        if tcp_port is not None:
            self._tcp = TCPServer(self.state)
            self.tcp_port = await self._tcp.start(host, tcp_port)
        if self.stats_logger is not None:
            self._stats_task = asyncio.create_task(self.stats_logger.run())

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Refuse new work (503, /ready too), let in-flight requests finish up to the timeout,
        then stop listening and close every connection."""
        engine = self.state.engine
        if self.state.batches is not None:
            # running batch jobs end as cancelled (their requests aborted), files removed
            await self.state.batches.close()
        self.state.draining = True
        if drain_timeout_s > 0:
            try:
                await asyncio.wait_for(engine.wait_idle(), drain_timeout_s)
            except asyncio.TimeoutError:
                pass
        # What is still running past the drain is aborted, so its stream ends now with a final
        # chunk (finish reason "abort") instead of running on until the process is killed.
        if engine.is_running and engine.abort_all():
            try:
                await asyncio.wait_for(engine.wait_idle(), 10.0)
            except asyncio.TimeoutError:
                pass
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()                 # no new connections
        if self._tcp is not None:
            self._tcp.stop_listening()
        for session in list(self.state.sessions):
            await session.close()
        # An idle WebSocket would otherwise hold its handler (and the shutdown) until aiohttp's
        # own timeout: tell each client the server is going away (close code 1001).
        await asyncio.gather(*(ws.close(code=WSCloseCode.GOING_AWAY,
                                        message=b"server shutting down")
                               for ws in list(self.state.websockets)), return_exceptions=True)
        if self._tcp is not None:
            await self._tcp.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._stats_task is not None:          # the engine is idle now: one last line
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
            self._stats_task = None
            self.stats_logger.log_line()
