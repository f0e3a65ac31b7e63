"""Python clients for the WebSocket and TCP doors (one protocol, two transports).

    async with await TCPClient.connect("127.0.0.1", 8001) as c:
        async for msg in c.generate("Once upon a time", max_tokens=16):
            if msg["type"] == "delta":
                print(msg["text"], end="", flush=True)

    async with await WSClient.connect("ws://127.0.0.1:8000/v1/ws") as c:
        result = await c.complete(messages=[{"role": "user", "content": "Hi"}], max_tokens=16)

Many generations can run at once on one connection; each `generate` yields that request's
messages (`delta`..., then one of `done`, `cancelled`, `error`). Closing the generator early
cancels the request: at once with `contextlib.aclosing(c.generate(...))` or `await g.aclose()`,
else when Python finalizes it (a plain `break` out of `async for` waits for that). Its id stays
reserved until the server confirms the cancel.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import msgpack

# the server's own limits (its hello reports them): a frame past them is refused unread
from ferrobatch.serve.codec import MAX_ARRAY_LEN as MAX_PROMPT_TOKENS
from ferrobatch.serve.codec import MAX_FRAME_BYTES
from ferrobatch.serve.protocol import CHAT_OPTION_FIELDS

TERMINAL = ("done", "cancelled", "error", "embedding")
CONNECT_TIMEOUT_S = 30.0           # connecting plus the handshake (`connect(timeout=None)`: none)
MAX_UNROUTED = 256                 # id-less errors kept in `unrouted` (the oldest are dropped)
_LEN = struct.Struct(">I")


def _frame_body(body: Any) -> Any:
    """A frame to send; ValueError when the server would refuse it unread (its error could
    not say which request it was)."""
    size = len(body.encode()) if isinstance(body, str) else len(body)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"the message is {size} bytes; the server reads frames of at most "
                         f"{MAX_FRAME_BYTES}")
    return body


class _Multiplexer:
    def __init__(self) -> None:
        # id -> its queue, or None while a cancelled request's last messages are on their way
        # (they are dropped; the id is free again at the terminal one)
        self._queues: dict[Any, asyncio.Queue | None] = {}
        self._ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._closed = False
        self.unrouted: asyncio.Queue = asyncio.Queue(MAX_UNROUTED)   # errors with no id

    async def _send(self, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    async def _recv(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def _start_reader(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self._recv()
                if msg is None:
                    break
                if not isinstance(msg, dict):
                    continue
                rid = msg.get("id")
                if rid is not None and rid in self._queues:
                    q = self._queues[rid]
                    if q is not None:
                        q.put_nowait(msg)
                    elif msg.get("type") in TERMINAL:
                        del self._queues[rid]       # the cancelled request is over
                elif rid is None:                   # e.g. a frame the server could not read
                    if self.unrouted.full():
                        self.unrouted.get_nowait()
                    self.unrouted.put_nowait(msg)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            self._closed = True
            for rid, q in list(self._queues.items()):
                if q is not None:
                    q.put_nowait({"type": "error", "id": rid, "code": 0,
                                  "message": "connection closed"})

    async def generate(self, prompt: str | list[int] | None = None, *,
                       messages: list[dict[str, Any]] | None = None, id: Any = None,
                       model: str | None = None,
                       **params: Any) -> AsyncIterator[dict[str, Any]]:
        """Start one generation and yield its messages until the terminal one. With
        `messages`, vLLM's chat fields (`add_generation_prompt`, `continue_final_message`,
        `chat_template_kwargs`) may be given among the keywords too. `model`: a served name
        (a LoRA adapter's selects it)."""
        msg: dict[str, Any] = {"type": "generate"}
        if model is not None:
            msg["model"] = model
        for name in CHAT_OPTION_FIELDS:          # message-level fields, not sampling ones
            if name in params:
                msg[name] = params.pop(name)
        msg["params"] = params
        if messages is not None:
            msg["messages"] = messages
        else:
            msg["prompt"] = prompt
        async for m in self._exchange(msg, prompt, id):
            yield m

    async def embed(self, prompt: str | list[int], *, id: Any = None, model: str | None = None,
                    **params: Any) -> list[float]:
        """The prompt's embedding (`pooling`, `normalize`, `dimensions`,
        `truncate_prompt_tokens` as keywords; `model` as in `generate`); RuntimeError with the
        server's error."""
        msg: dict[str, Any] = {"type": "embed", "prompt": prompt, "params": params}
        if model is not None:
            msg["model"] = model
        async for m in self._exchange(msg, prompt, id):
            if m["type"] == "embedding":
                return m["embedding"]
            if m["type"] == "error":
                raise RuntimeError(f"embedding failed ({m.get('code')}): {m.get('message')}")
        raise ConnectionError("connection closed")

    async def _exchange(self, msg: dict[str, Any], prompt: Any,
                        id: Any) -> AsyncIterator[dict[str, Any]]:
        """Send `msg` under a fresh (or the given) id; yield its replies until the terminal
        one; leaving early cancels it."""
        if self._closed:
            raise ConnectionError("connection closed")
        rid = id if id is not None else f"c{next(self._ids)}"
        if rid in self._queues:
            raise ValueError(f"id {rid!r} is already in use (a cancelled request keeps it "
                             "until the server confirms)")
        if isinstance(prompt, (list, tuple)) and len(prompt) > MAX_PROMPT_TOKENS:
            raise ValueError(f"the prompt has {len(prompt)} token ids; the server reads at "
                             f"most {MAX_PROMPT_TOKENS}")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        msg = {**msg, "id": rid}
        finished = sent = False
        try:
            await self._send(msg)
            sent = True
            while True:
                m = await q.get()
                finished = m.get("type") in TERMINAL
                yield m
                if finished:
                    return
        finally:
            if finished or not sent or self._closed:
                self._queues.pop(rid, None)
            else:
                self._queues[rid] = None            # reserved until the server's terminal
                try:
                    await self._send({"type": "cancel", "id": rid})
                except (ConnectionError, OSError):
                    self._queues.pop(rid, None)

    async def complete(self, prompt: str | list[int] | None = None, **kw: Any) -> dict[str, Any]:
        """Run one generation to the end: {text, token_ids, finish_reason, usage} (sequence 0)
        plus `texts` / `finish_reasons` of every sequence, `logprobs` (a list per sequence) and
        `prompt_logprobs` when the parameters of those names asked for them."""
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        logprobs: dict[int, list[Any]] = {}
        prompt_logprobs: list[Any] = []
        async for m in self.generate(prompt, **kw):
            t = m["type"]
            if t == "prompt_logprobs":
                prompt_logprobs[m["start"]:m["start"] + len(m["logprobs"])] = m["logprobs"]
            elif t == "delta":
                texts.setdefault(m.get("index", 0), []).append(m["text"])
                ids.setdefault(m.get("index", 0), []).extend(m["token_ids"])
                if "logprobs" in m:
                    logprobs.setdefault(m.get("index", 0), []).extend(m["logprobs"])
            elif t == "done":
                num_seqs = len(m.get("finish_reasons") or [0])
                out = {"text": "".join(texts.get(0, [])), "token_ids": ids.get(0, []),
                       "texts": ["".join(texts.get(i, [])) for i in range(num_seqs)],
                       "finish_reason": m["finish_reason"],
                       "finish_reasons": m.get("finish_reasons"), "usage": m["usage"]}
                if kw.get("logprobs") is not None:
                    out["logprobs"] = [logprobs.get(i, []) for i in range(num_seqs)]
                if kw.get("prompt_logprobs") is not None:
                    out["prompt_logprobs"] = prompt_logprobs
                return out
            elif t == "cancelled":
                return {"text": "".join(texts.get(0, [])), "token_ids": ids.get(0, []),
                        "finish_reason": "abort", "usage": None}
            else:
                raise RuntimeError(f"generation failed ({m.get('code')}): {m.get('message')}")
        raise ConnectionError("connection closed")

    async def cancel(self, rid: Any) -> None:
        await self._send({"type": "cancel", "id": rid})

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class WSClient(_Multiplexer):
    """WebSocket client; `binary=True` sends and receives msgpack frames instead of JSON."""

    def __init__(self, session: Any, ws: Any, binary: bool) -> None:
        super().__init__()
        self._session = session
        self._ws = ws
        self._binary = binary

    @classmethod
    async def connect(cls, url: str, *, api_key: str | None = None, binary: bool = False,
                      timeout: float | None = CONNECT_TIMEOUT_S) -> "WSClient":
        """Open the WebSocket; TimeoutError when the upgrade takes over `timeout` seconds."""
        import aiohttp
        session = aiohttp.ClientSession()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        try:
            ws = await asyncio.wait_for(
                session.ws_connect(url, headers=headers, heartbeat=20,
                                   max_msg_size=MAX_FRAME_BYTES), timeout)
        except asyncio.TimeoutError:
            await session.close()
            raise TimeoutError(f"no WebSocket upgrade from {url} within {timeout} s") from None
        except BaseException:
            await session.close()
            raise
        client = cls(session, ws, binary)
        client._start_reader()
        return client

    async def _send(self, msg: dict[str, Any]) -> None:
        if self._binary:
            await self._ws.send_bytes(_frame_body(msgpack.packb(msg, use_bin_type=True)))
        else:
            await self._ws.send_str(_frame_body(json.dumps(msg)))

    async def _recv(self) -> dict[str, Any] | None:
        import aiohttp
        msg = await self._ws.receive()
        if msg.type == aiohttp.WSMsgType.TEXT:
            return json.loads(msg.data)
        if msg.type == aiohttp.WSMsgType.BINARY:
            return msgpack.unpackb(msg.data, raw=False, strict_map_key=True, max_ext_len=0)
        return None

    async def close(self) -> None:
        await self._ws.close()
        await self._session.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


class TCPClient(_Multiplexer):
    """Length-prefixed msgpack over TCP; `connect` performs the hello handshake."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__()
        self._r = reader
        self._w = writer
        self.server_hello: dict[str, Any] = {}

    @classmethod
    async def connect(cls, host: str = "127.0.0.1", port: int = 8001, *,
                      api_key: str | None = None,
                      timeout: float | None = CONNECT_TIMEOUT_S) -> "TCPClient":
        """Connect and shake hands; TimeoutError when that takes over `timeout` seconds,
        ConnectionError when the server refuses (or `port` is not a ferrobatch TCP door)."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"could not connect to {host}:{port} within {timeout} s") from None
        client = cls(reader, writer)
        hello: dict[str, Any] = {"type": "hello", "version": 1}
        if api_key is not None:
            hello["api_key"] = api_key
        try:
            await client._send(hello)
            reply = await asyncio.wait_for(client._recv_hello(host, port), timeout)
        except asyncio.TimeoutError:
            writer.close()
            raise TimeoutError(f"no handshake from {host}:{port} within {timeout} s (is it "
                               "ferrobatch's TCP port, --tcp-port?)") from None
        except BaseException:
            writer.close()
            raise
        if not reply or reply.get("type") != "hello":
            writer.close()
            raise ConnectionError(f"handshake refused: {reply}")
        client.server_hello = reply
        client._start_reader()
        return client

    async def _recv_hello(self, host: str, port: int) -> dict[str, Any] | None:
        try:
            head = await self._r.readexactly(4)
        except asyncio.IncompleteReadError:
            return None
        if head == b"HTTP":
            raise ConnectionError(f"{host}:{port} answers in HTTP: it is the HTTP/WebSocket "
                                  "port; the TCP door listens on --tcp-port (8001 by default)")
        return await self._recv(head)

    async def _send(self, msg: dict[str, Any]) -> None:
        body = _frame_body(msgpack.packb(msg, use_bin_type=True))
        self._w.write(_LEN.pack(len(body)) + body)
        await self._w.drain()

    async def _recv(self, head: bytes | None = None) -> dict[str, Any] | None:
        try:
            (n,) = _LEN.unpack(head if head is not None else await self._r.readexactly(4))
            if n > MAX_FRAME_BYTES:
                raise ConnectionError(f"server frame of {n} bytes is too large")
            body = await self._r.readexactly(n)
        except asyncio.IncompleteReadError:
            return None
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0)

    async def close(self) -> None:
        self._w.close()
        try:
            await self._w.wait_closed()
        except (ConnectionError, OSError):
            pass
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
