"""Session: one WebSocket or TCP connection speaking the message protocol (transport-agnostic).

Many generations run multiplexed, each pumped by its own task. Invariants:
- a client id is active from an accepted `generate` until its `done`/`cancelled`/`error` is sent;
- `cancelled` is sent only after the engine reported the abort, i.e. after the KV was freed;
- `close()` (socket closed, EOF, server shutdown) aborts every active request of the connection.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from ferrobatch.sampling_params import SamplingParams
from ferrobatch.serve.logprobs import message_logprobs
from ferrobatch.serve.protocol import (
    PROTOCOL_VERSION,
    EmbedMsg,
    GenerateMsg,
    ProtocolError,
    error_msg,
    error_status,
    parse_message,
)

# prompt positions per `prompt_logprobs` message: with 20 alternatives each, ~200 KB of JSON,
# well under the 1 MiB frame limit a client enforces
PROMPT_LOGPROBS_PER_MESSAGE = 256
MAX_ACTIVE_PER_CONNECTION = 1024
Send = Callable[[dict[str, Any], bool], Awaitable[None]]   # (message, binary) -> None
Pump = Callable[[Any, Any, bool], Awaitable[None]]        # (id, stream, binary) -> None


class Session:
    def __init__(self, engine: Any, send: Send, *, api_key: str | None = None,
                 require_hello: bool = False, limits: dict[str, Any] | None = None,
                 draining: Callable[[], bool] = lambda: False,
                 model_name: str | None = None,
                 lora_of: Callable[[Any], Any] = lambda model: None) -> None:
        """`lora_of`: a message's `model` -> its LoRARequest or None (ProtocolError for a name
        the server does not serve; `lora_api.resolve_model`)."""
        self._engine = engine
        self._lora_of = lora_of
        # the id `hello` reports: `--served-model-name` when set, as on HTTP
        self._model_name = model_name or engine.model_name
        self._draining = draining
        self._send = send
        self._api_key = api_key
        self._authed = api_key is None and not require_hello
        self._require_hello = require_hello
        self._limits = limits or {}
        self._active: dict[Any, tuple[Any, asyncio.Task, bool]] = {}
        self._cancelled: set[Any] = set()
        self._closed = False

    @property
    def num_active(self) -> int:
        return len(self._active)

    async def handle(self, raw: Any, binary: bool) -> None:
        """Handle one decoded client message; protocol errors become `error` messages."""
        rid = raw.get("id") if isinstance(raw, dict) else None
        rid = rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None
        try:
            kind, payload = parse_message(raw, self._engine.default_sampling_fields)
            if kind == "hello":
                self._hello(payload)
                await self._send({"type": "hello", "version": PROTOCOL_VERSION,
                                  "model": self._model_name, "limits": self._limits},
                                 binary)
                return
            if not self._authed:
                raise ProtocolError("send 'hello' first" if self._require_hello
                                    else "authentication required", code=401)
            if kind == "embed":
                self._embed(payload, binary)
                return
            if kind == "generate":
                # a long prompt's tokens and a guided grammar, computed off the event loop
                await self._engine.prepare(payload.params, payload.prompt, payload.messages,
                                           payload.chat_options, self._lora_of(payload.model))
                self._generate(payload, binary)
            else:
                await self._cancel(payload, binary)
        except Exception as exc:  # noqa: BLE001 - reported to the client, never raised
            code, _ = error_status(exc)
            msg = str(exc) if code < 500 or code == 503 else "internal server error"
            await self._send(error_msg(rid, code, msg), binary)

    def _hello(self, key: str | None) -> None:
        if self._api_key is not None:
            if key is None or not hmac.compare_digest(key.encode(), self._api_key.encode()):
                raise ProtocolError("invalid or missing api_key", code=401)
        self._authed = True

    def _admit(self, rid: Any) -> None:
        """Refuses a new request on a closing, draining or full connection, or a reused id."""
        if self._closed:
            raise ProtocolError("connection is closing", code=503)
        if self._draining():
            raise ProtocolError("the server is shutting down; retry elsewhere", code=503)
        if rid in self._active:
            raise ProtocolError(f"id {rid!r} is already in use on this connection")
        if len(self._active) >= MAX_ACTIVE_PER_CONNECTION:
            raise ProtocolError("too many active requests on this connection", code=429)

    def _generate(self, msg: GenerateMsg, binary: bool) -> None:
        self._admit(msg.id)
        if msg.beam is not None:
            search = self._engine.beam_search(msg.prompt, msg.beam, messages=msg.messages,
                                              chat_options=msg.chat_options,
                                              lora_request=self._lora_of(msg.model))
            self._start(msg.id, _BeamSearch(search), binary, self._pump_beams)
            return
        stream = self._engine.add_request(msg.prompt, msg.params, messages=msg.messages,
                                          chat_options=msg.chat_options,
                                          lora_request=self._lora_of(msg.model))
        self._start(msg.id, stream, binary, self._pump)

    def _embed(self, msg: EmbedMsg, binary: bool) -> None:
        self._admit(msg.id)
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind="final",
                                truncate_prompt_tokens=msg.truncate_prompt_tokens)
        stream = self._engine.add_request(msg.prompt, params, pooling=msg.pooling,
                                          lora_request=self._lora_of(msg.model))
        self._start(msg.id, stream, binary, self._pump_embedding)

    def _start(self, rid: Any, stream: Any, binary: bool, pump: Pump) -> None:
        """Runs `pump` for an accepted request in a task of its own; the request is active
        until the pump ends (`_pumped`)."""
        task = asyncio.get_running_loop().create_task(self._pumped(rid, stream, binary, pump))
        self._active[rid] = (stream, task, binary)

    async def _pumped(self, rid: Any, stream: Any, binary: bool, pump: Pump) -> None:
        """`pump` to its end; a transport failure or a cancelled task ends it quietly, and
        either way the request is retired."""
        try:
            await pump(rid, stream, binary)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # noqa: BLE001 - the transport failed; the connection is going away
            pass
        finally:
            self._retire(rid, stream)

    async def _pump_embedding(self, rid: Any, stream: Any, binary: bool) -> None:
        """An `embed` request's one reply: `embedding`, `cancelled` or `error`."""
        last = None
        async for out in stream:
            last = out
        if last is not None and last.embedding is not None:
            await self._send({"type": "embedding", "id": rid, "embedding": last.embedding,
                              "usage": {"prompt_tokens": len(stream.prompt_token_ids)}}, binary)
        elif rid in self._cancelled:
            await self._send({"type": "cancelled", "id": rid}, binary)
        else:
            message = last.error if last is not None and last.error else "embedding failed"
            await self._send(error_msg(rid, 500, message), binary)

    async def _pump_beams(self, rid: Any, search: _BeamSearch, binary: bool) -> None:
        """A beam search's messages: each returned beam, best first, as one `delta` of its
        index (its whole text and tokens), then `done` with each beam's finish reason; or
        `cancelled`, or `error` (a bad request is a 400)."""
        try:
            out = await search.task
        except asyncio.CancelledError:
            if rid not in self._cancelled:
                raise                            # the connection is closing: nothing to send
            await self._send({"type": "cancelled", "id": rid}, binary)
            return
        except ValueError as exc:
            await self._send(error_msg(rid, 400, str(exc)), binary)
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client
            code, _ = error_status(exc)
            await self._send(error_msg(rid, code, str(exc) if code < 500 or code == 503
                                       else "beam search failed"), binary)
            return
        for j, seq in enumerate(out.sequences):
            await self._send({"type": "delta", "id": rid, "index": j, "text": seq.text,
                              "token_ids": seq.output_token_ids}, binary)
        reasons = [seq.finish_reason for seq in out.sequences] or ["abort"]
        await self._send({"type": "done", "id": rid, "finish_reason": reasons[0],
                          "finish_reasons": reasons,
                          "usage": {"prompt_tokens": len(out.prompt_token_ids),
                                    "completion_tokens": sum(len(s.output_token_ids)
                                                             for s in out.sequences),
                                    "cached_tokens": 0}}, binary)

    async def _cancel(self, rid: Any, binary: bool) -> None:
        entry = self._active.get(rid)
        if entry is None:
            raise ProtocolError(f"no active request with id {rid!r}", code=404)
        self._cancelled.add(rid)
        entry[0].abort()

    async def _pump(self, rid: Any, stream: Any, binary: bool) -> None:
        """A generation's messages: deltas (and prompt logprobs), then `done`, `cancelled` or
        `error`."""
        send = self._send
        completion = 0
        reasons: dict[int, str] = {}
        error: str | None = None
        cached = 0                  # prompt tokens the prefix cache held
        async for out in stream:
            cached = out.num_cached_tokens or cached
            if out.prompt_logprobs is not None:     # once, before the first delta
                entries = [None] + message_logprobs(out.prompt_logprobs[1:])
                for start in range(0, len(entries), PROMPT_LOGPROBS_PER_MESSAGE):
                    await send({"type": "prompt_logprobs", "id": rid, "start": start,
                                "logprobs": entries[start:start + PROMPT_LOGPROBS_PER_MESSAGE]},
                               binary)
            for c in out.outputs:
                if c.text or c.token_ids:
                    completion += len(c.token_ids)
                    msg = {"type": "delta", "id": rid, "index": c.index, "text": c.text,
                           "token_ids": c.token_ids}
                    if c.logprobs is not None:
                        msg["logprobs"] = message_logprobs(c.logprobs)
                    await send(msg, binary)
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
            error = out.error or error
        ordered = [reasons.get(i, "abort") for i in range(len(reasons) or 1)]
        if rid in self._cancelled and all(r == "abort" for r in ordered):
            await send({"type": "cancelled", "id": rid}, binary)
        elif "error" in ordered:
            await send(error_msg(rid, 500, error or "generation failed"), binary)
        else:
            await send({"type": "done", "id": rid, "finish_reason": ordered[0],
                        "finish_reasons": ordered,
                        "usage": {"prompt_tokens": len(stream.prompt_token_ids),
                                  "completion_tokens": completion,
                                  "cached_tokens": cached}}, binary)

    def _retire(self, rid: Any, stream: Any) -> None:
        """A pump's end: its request aborted if still running, its id free again."""
        stream.abort()
        self._active.pop(rid, None)
        self._cancelled.discard(rid)

    async def close(self) -> None:
        """Abort every active request of this connection and stop its pump tasks."""
        self._closed = True
        tasks = []
        for stream, task, _ in list(self._active.values()):
            stream.abort()
            task.cancel()
            tasks.append(task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class _BeamSearch:
    """A running beam search in the place of a request stream: `abort()` cancels it (its
    requests are aborted as the search unwinds)."""

    def __init__(self, search: Any) -> None:
        self.task = asyncio.ensure_future(search)

    def abort(self) -> None:
        self.task.cancel()
