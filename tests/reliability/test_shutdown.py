"""Graceful shutdown of `ferrobatch serve` under load (a real process, SIGTERM).

In-flight streams on every door finish with their full token count; during the drain every new
request gets 503 (HTTP, /ready, WS, TCP) while /health stays 200; the process exits 0 within
the drain timeout, leaves no child process, and its ports are closed afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import psutil
from harness import HERE, LOOPBACK, PROMPTS, ROOT, Outcome, RawTCP, http_stream, tcp_stream, ws_stream

MAX_TOKENS = 200   # long enough to still be in flight 0.3 s after SIGTERM on a fast CPU


async def _wait_ports(proc, lines):
    import re
    http = tcp = None
    while http is None or tcp is None:
        line = (await asyncio.wait_for(proc.stdout.readline(), 240)).decode()
        assert line, "server exited early:\n" + "".join(lines)
        lines.append(line)
        m = re.search(r"OpenAI HTTP : http://127\.0\.0\.1:(\d+)/v1", line)
        http = int(m.group(1)) if m else http
        m = re.search(r"msgpack/TCP : 127\.0\.0\.1:(\d+)", line)
        tcp = int(m.group(1)) if m else tcp
    return http, tcp


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((LOOPBACK, port)) != 0


async def test_sigterm_drains_under_load(oracle):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.join(ROOT, "python")]),
               PYTHONUNBUFFERED="1", FB_TINY="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.join(HERE, "launch_serve.py"), "serve", "--device", "cpu",
        "--port", "0", "--tcp-port", "0", "--kv-cache-gb", "0.05", "--max-num-seqs", "16",
        "--drain-timeout", "120", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        cwd=ROOT)
    lines: list[str] = []
    try:
        port, tcp_port = await _wait_ports(proc, lines)
        base = f"http://{LOOPBACK}:{port}"
        ws_url = f"ws://{LOOPBACK}:{port}/v1/ws"
        async with aiohttp.ClientSession() as s:
            outs = [Outcome(d) for d in ("http", "http", "ws", "ws", "tcp", "tcp")]
            tasks = []
            for i, o in enumerate(outs):
                p = PROMPTS[i % len(PROMPTS)]
                tasks.append(asyncio.create_task(
                    http_stream(s, base, p, MAX_TOKENS, o) if o.door == "http"
                    else ws_stream(s, ws_url, p, MAX_TOKENS, o) if o.door == "ws"
                    else tcp_stream(tcp_port, p, MAX_TOKENS, o)))
            # a WS and a TCP connection opened before the signal, used during the drain
            idle_ws = await s.ws_connect(ws_url)
            idle_tcp = await RawTCP.connect(tcp_port)
            await asyncio.wait_for(asyncio.gather(*(o.first_token.wait() for o in outs)), 120)
            children = psutil.Process(proc.pid).children(recursive=True)
            t_sig = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            assert not all(t.done() for t in tasks), "load finished before the signal"
            # during the drain: new work is refused with 503, liveness stays up
            async with s.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == 503
            async with s.get(base + "/ready") as r:
                assert r.status == 503
            async with s.get(base + "/health") as r:
                assert r.status == 200
            await idle_ws.send_json({"type": "generate", "id": 1, "prompt": "x",
                                     "params": {"max_tokens": 2}})
            m = await idle_ws.receive_json(timeout=30)
            assert m["type"] == "error" and m["code"] == 503, m
            await idle_tcp.send({"type": "generate", "id": 1, "prompt": "x",
                                 "params": {"max_tokens": 2}})
            m = await idle_tcp.recv()
            assert m["type"] == "error" and m["code"] == 503, m
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            for o in outs:                       # in-flight work completed in full
                want = ["length", "[DONE]"] if o.door == "http" else ["done"]
                assert o.terminals == want and o.num_tokens == MAX_TOKENS, (o.door, vars(o))
            await idle_ws.close()
            await idle_tcp.close()
        rc = await asyncio.wait_for(proc.wait(), 120)
        drain_s = time.monotonic() - t_sig
        rest = (await proc.stdout.read()).decode()
        assert rc == 0, "".join(lines) + rest
        assert "draining" in rest and "stopped" in rest
        assert drain_s < 120
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert _port_closed(port) and _port_closed(tcp_port)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
