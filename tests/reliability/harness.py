"""Shared pieces of the reliability battery: a fast real-weights model, servers, stream clients
for every door that count their terminal messages, and the accounting oracles.

The "tiny" model is the shipped SmolLM2-135M cut to four of its 30 decoder layers
(same weights, same tokenizer, same Rust scheduler, runner, KV cache and sampler): the whole
serving path is real, only the forward is ~4x cheaper, which is what lets 200 concurrent
streams run on two CPU cores inside the CI budget. The `slow` variants use the full model.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import socket
import struct
import sys
import time
from typing import Any

import aiohttp
import msgpack
import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))

from ferrobatch.engine.async_engine import AsyncEngine  # noqa: E402
from ferrobatch.serve.server import Server  # noqa: E402

TINY_LAYERS = (0, 1, 28, 29)     # first two + last two: fast, yet diverse high-entropy text
LOOPBACK = "127.0.0.1"
PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three most important rules of programming are",
    "Write a short poem about the moon:",
    "Q: What is the boiling point of water? A:",
    "List the planets of the solar system:",
    "In 1492, Columbus",
    "def fibonacci(n):",
    "The quick brown fox",
]
_LEN = struct.Struct(">I")


def truncated_model(loaded: Any, layers: tuple[int, ...] = TINY_LAYERS) -> Any:
    """A LoadedModel sharing `loaded`'s weights but running only the decoder layers `layers`
    (the session's model is never mutated: the module tree is copied, the tensors shared)."""
    import torch.nn as nn
    cfg = dataclasses.replace(loaded.config, num_layers=len(layers))
    m = copy.copy(loaded.model)
    m._modules = dict(loaded.model._modules)
    m._modules["layers"] = nn.ModuleList([loaded.model.layers[i] for i in layers])
    m.config = cfg
    out = copy.copy(loaded)
    out.model = m
    out.config = cfg
    return out


class Served:
    """A started engine + server on loopback (HTTP/WS on one port, TCP on another)."""

    def __init__(self, engine: AsyncEngine, server: Server) -> None:
        self.engine = engine
        self.server = server
        self.base = f"http://{LOOPBACK}:{server.port}"
        self.ws_url = f"ws://{LOOPBACK}:{server.port}/v1/ws"
        self.tcp_port = server.tcp_port

    async def stop(self) -> None:
        await self.server.stop()
        await self.engine.shutdown()


async def serve(loaded: Any = None, *, core: Any = None, api_key: str | None = None,
                **options: Any) -> Served:
    options.setdefault("device", "cpu")
    if core is not None:
        from ferrobatch.config import EngineConfig
        engine = AsyncEngine(EngineConfig(model="fake", **options), core=core)
    else:
        engine = AsyncEngine(loaded_model=loaded, **options)
    await engine.start()
    server = Server(engine, api_key=api_key)
    await server.start(LOOPBACK, 0, tcp_port=0)
    return Served(engine, server)


# -- oracles -------------------------------------------------------------------------------------

class FinishCounter:
    """EngineObserver: counts terminal states (the engine calls on_finished once per request)."""

    def __init__(self) -> None:
        self.finished = 0
        self.by_reason: dict[str, int] = {}

    def on_scheduled(self, *a: Any) -> None: ...
    def on_first_token(self, *a: Any) -> None: ...
    def on_step(self, *a: Any) -> None: ...
    def on_step_tokens(self, *a: Any) -> None: ...

    def on_finished(self, request: Any) -> None:
        self.finished += 1
        reason = request.finish_reason
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1


def assert_engine_clean(engine: AsyncEngine, counter: FinishCounter | None = None) -> dict:
    """Request + block accounting at idle; call only once the engine has no open request."""
    acc = engine.check_accounting()
    c = engine.counters
    assert acc["open"] == 0, f"requests left in the engine: {acc}"
    assert c["accepted"] == c["released"], c
    assert c["released"] == sum(c[k] for k in ("stop", "length", "abort", "error")), c
    if counter is not None:
        # readiness probes are released like any request but not shown to observers
        assert counter.finished == c["released"] - c["probes"], (counter.by_reason, c)
    assert not engine._by_name and not engine._unscheduled
    core = engine._core
    assert core.num_tracked() == 0, "sampler extras leaked"
    if engine.is_running and hasattr(core, "scheduler"):
        s = core.scheduler.stats()
        assert s["num_running"] == 0 and s["num_waiting"] == 0, s
        assert s["num_used_blocks"] == 0, f"KV blocks held at idle: {s}"
        assert s["num_free_blocks"] + s["num_cached_blocks"] == s["num_blocks"] - 1, s
        assert s["intake_queue_len"] == 0, s
        assert not core.scheduler.has_unfinished()
        core.check_integrity()                   # Rust: ref counts, free lists, no double owner
    return acc


async def wait_engine_idle(engine: AsyncEngine, timeout_s: float) -> float:
    """Seconds until no request is open and the Rust scheduler holds nothing (fails after)."""
    t0 = time.monotonic()
    while True:
        s = engine.stats()
        if (not engine._requests and s.get("num_running", 0) == 0
                and s.get("num_waiting", 0) == 0 and s.get("num_used_blocks", 0) == 0):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"engine not idle after {timeout_s}s: {s}")
        await asyncio.sleep(0.01)


def process_snapshot() -> dict[str, float]:
    """RSS (what the process retains: garbage collected and the allocator's free memory
    handed back first, so a leak shows and heap slack does not), fds, threads, connections."""
    import gc

    from ferrobatch.runtime.heap import return_freed_memory

    gc.collect()
    return_freed_memory()
    p = psutil.Process()
    return {"rss_mb": p.memory_info().rss / 2**20, "fds": p.num_fds(),
            "threads": p.num_threads(), "conns": len(p.net_connections(kind="tcp"))}


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t_s, rss_mb) samples, in MiB per minute."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if var == 0 else 60 * sum((t - mt) * (r - mr) for t, r in samples) / var


# -- stream clients (each counts the terminal messages it got) ---------------------------------

class Outcome:
    """What one stream saw: text, token ids (WS/TCP), terminal messages, tokens counted."""

    def __init__(self, door: str) -> None:
        self.door = door
        self.text = ""
        self.token_ids: list[int] = []
        self.num_tokens = 0            # usage.completion_tokens (HTTP) or len(token_ids)
        self.terminals: list[str] = []   # finish_reason / done / cancelled / error
        self.error: str | None = None
        self.cut = False
        self.status: int | None = None
        self.prompt = ""
        self.first_token = asyncio.Event()


async def chat_stream(s: aiohttp.ClientSession, base: str, prompt: str, cut_after: int | None,
                      *, model: str | None = None, max_tokens: int = 16) -> dict:
    """One streamed greedy chat completion (`model`: a served name; None or "base": the
    default); with `cut_after`, the connection is closed after that many content deltas (0:
    before the first one, while it may still wait, e.g. for a LoRA slot). Returns {text,
    finish} ("cut" when closed)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    if model not in (None, "base"):
        body["model"] = model
    text, deltas, finish = "", 0, None
    async with s.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if cut_after == 0:
            r.close()
            return {"text": "", "finish": "cut"}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            assert "choices" in event, event
            for c in event["choices"]:
                if c["delta"].get("content"):
                    text += c["delta"]["content"]
                    deltas += 1
                finish = c.get("finish_reason") or finish
            if cut_after is not None and deltas >= cut_after and finish is None:
                r.close()
                return {"text": text, "finish": "cut"}
    return {"text": text, "finish": finish}


def gen_body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}


async def http_stream(session: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int,
                      out: Outcome, cut_after: int | None = None) -> Outcome:
    """Stream /v1/completions over SSE; with `cut_after`, close the connection after that many
    text chunks (0: right after the response headers)."""
    chunks = 0
    async with session.post(base + "/v1/completions", json=gen_body(prompt, max_tokens)) as r:
        out.status = r.status
        if r.status != 200:
            out.error = (await r.text())[:500]
            out.terminals.append(f"http-{r.status}")
            return out
        if cut_after == 0:
            out.cut = True
            r.close()
            return out
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    out.terminals.append("[DONE]")
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    out.error = obj["error"]["message"]
                    out.terminals.append("error")
                    continue
                if obj.get("usage"):
                    out.num_tokens = obj["usage"]["completion_tokens"]
                for ch in obj.get("choices", []):
                    if ch.get("text"):
                        out.text += ch["text"]
                        chunks += 1
                        out.first_token.set()
                    if ch.get("finish_reason"):
                        out.terminals.append(ch["finish_reason"])
                if cut_after is not None and chunks >= cut_after and not out.terminals:
                    out.cut = True
                    r.close()                      # HTTP close mid-stream
                    return out
    return out


class RawTCP:
    """A bare msgpack/TCP connection (one stream per connection) that can be reset (RST)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer

    @classmethod
    async def connect(cls, port: int, api_key: str | None = None) -> "RawTCP":
        r, w = await asyncio.open_connection(LOOPBACK, port)
        c = cls(r, w)
        hello: dict[str, Any] = {"type": "hello", "version": 1}
        if api_key is not None:
            hello["api_key"] = api_key
        await c.send(hello)
        reply = await c.recv()
        assert reply is not None and reply["type"] == "hello", reply
        return c

    async def send(self, msg: Any) -> None:
        self.send_raw(msgpack.packb(msg, use_bin_type=True))
        await self.w.drain()

    def send_raw(self, body: bytes, declared: int | None = None) -> None:
        self.w.write(_LEN.pack(len(body) if declared is None else declared) + body)

    async def recv(self, timeout_s: float = 30.0) -> Any:
        try:
            (n,) = _LEN.unpack(await asyncio.wait_for(self.r.readexactly(4), timeout_s))
            body = await asyncio.wait_for(self.r.readexactly(n), timeout_s)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0)

    def reset(self) -> None:
        """Abortive close: SO_LINGER 0 makes the kernel send RST instead of FIN."""
        sock = self.w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.w.transport.abort()

    async def close(self) -> None:
        self.w.close()
        try:
            await self.w.wait_closed()
        except (ConnectionError, OSError):
            pass


def _absorb(out: Outcome, m: dict[str, Any]) -> bool:
    """Apply one WS/TCP message to `out`; True when it was terminal."""
    t = m.get("type")
    if t == "delta":
        out.text += m["text"]
        out.token_ids += m["token_ids"]
        out.num_tokens = len(out.token_ids)
        if m["token_ids"]:
            out.first_token.set()
        return False
    out.terminals.append(t)
    if t == "error":
        out.error = m.get("message")
    return t in ("done", "cancelled", "error")


async def tcp_stream(port: int, prompt: str, max_tokens: int, out: Outcome,
                     cut_after: int | None = None, how: str = "reset") -> Outcome:
    """One generation over TCP; with `cut_after` tokens, end it by `how`: reset | cancel."""
    c = await RawTCP.connect(port)
    try:
        await c.send({"type": "generate", "id": 1, "prompt": prompt,
                      "params": {"max_tokens": max_tokens, "temperature": 0,
                                 "ignore_eos": True}})
        cancelled = False
        while True:
            if cut_after is not None and not cancelled and out.num_tokens >= cut_after:
                out.cut = True
                if how == "reset":
                    c.reset()                       # TCP reset
                    return out
                await c.send({"type": "cancel", "id": 1})
                cancelled = True
            m = await c.recv()
            if m is None:
                out.terminals.append("eof")
                return out
            if _absorb(out, m):
                # nothing may follow the terminal message for this id
                return out
    finally:
        if not c.w.is_closing():
            await c.close()


async def ws_stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                    out: Outcome, cut_after: int | None = None, binary: bool = False,
                    how: str = "close") -> Outcome:
    """One generation over WebSocket (JSON or msgpack); `how`: close (close frame) | cancel."""
    async with session.ws_connect(url, max_msg_size=1 << 20) as ws:
        msg = {"type": "generate", "id": "s", "prompt": prompt,
               "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        if binary:
            await ws.send_bytes(msgpack.packb(msg, use_bin_type=True))
        else:
            await ws.send_str(json.dumps(msg))
        cancelled = False
        while True:
            if cut_after is not None and not cancelled and out.num_tokens >= cut_after:
                out.cut = True
                if how == "close":
                    await ws.close()                # WS close frame
                    return out
                await (ws.send_bytes(msgpack.packb({"type": "cancel", "id": "s"}))
                       if binary else ws.send_str(json.dumps({"type": "cancel", "id": "s"})))
                cancelled = True
            m = await ws.receive(timeout=60)
            if m.type == aiohttp.WSMsgType.TEXT:
                obj = json.loads(m.data)
            elif m.type == aiohttp.WSMsgType.BINARY:
                obj = msgpack.unpackb(m.data, raw=False, max_ext_len=0)
            else:
                out.terminals.append("ws-closed")
                return out
            if _absorb(out, obj):
                return out


def record_result(name: str, data: object) -> None:
    """Append a slow run's figures to tests/reliability/results.jsonl (summarised in RESULTS.md)."""
    with open(os.path.join(HERE, "results.jsonl"), "a") as f:
        f.write(json.dumps({"test": name, "date": time.strftime("%Y-%m-%d %H:%M"),
                            "data": data}) + "\n")
