"""Fault injection through the objects the engine holds (runner, sampler, detokenizer factory).

Per-request faults (NaN logits for one request, a detokenizer that raises for one request) fail
only that request: bystanders on every door finish with their reference greedy text and the
engine keeps serving. Engine-fatal faults (the forward raising at step N, a BaseException like
a Rust panic, a step the Rust scheduler rejects) send one terminal error to every open stream on
every door, flip /health and /ready to 503, refuse new work with 503, and the `serve` process
exits non-zero (no zombie server).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import aiohttp
import pytest
from faults import PanicLike, RunnerProxy, SamplerProxy, detok_fault
from harness import HERE, LOOPBACK, PROMPTS, ROOT, Outcome, RawTCP, http_stream, tcp_stream, ws_stream

ENGINE = dict(num_blocks=512, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024)
N = 10


async def _bystanders(srv, s, max_tokens: int) -> tuple[list[Outcome], list[asyncio.Task]]:
    outs, tasks = [], []
    for i, door in enumerate(("http", "ws", "tcp")):
        o = Outcome(door)
        o.prompt = PROMPTS[i]
        outs.append(o)
        if door == "http":
            coro = http_stream(s, srv.base, o.prompt, max_tokens, o)
        elif door == "ws":
            coro = ws_stream(s, srv.ws_url, o.prompt, max_tokens, o, binary=True)
        else:
            coro = tcp_stream(srv.tcp_port, o.prompt, max_tokens, o)
        tasks.append(asyncio.create_task(coro))
    return outs, tasks


async def _reference(srv, max_tokens: int) -> dict[str, str]:
    refs = {}
    for p in PROMPTS[:3]:
        o = Outcome("ref")
        await tcp_stream(srv.tcp_port, p, max_tokens, o)
        refs[p] = o.text
    return refs


def _assert_finished_ok(outs: list[Outcome], refs: dict[str, str], max_tokens: int) -> None:
    for o in outs:
        want = ["length", "[DONE]"] if o.door == "http" else ["done"]
        assert o.terminals == want, (o.door, o.terminals, o.error)
        assert o.num_tokens == max_tokens and o.text == refs[o.prompt], (o.door, o.text)


async def test_nan_logits_fail_only_that_request(oracle, tiny_model):
    srv = await oracle.serve(tiny_model, **ENGINE)
    proxy = RunnerProxy(srv.engine._core.runner)
    srv.engine._core.runner = proxy
    refs = await _reference(srv, N)
    async with aiohttp.ClientSession() as s:
        outs, tasks = await _bystanders(srv, s, N)
        victim = Outcome("tcp")
        vt = asyncio.create_task(tcp_stream(srv.tcp_port, PROMPTS[5], 400, victim))
        await asyncio.wait_for(victim.first_token.wait(), 60)
        rid = next(st.req_id for st in srv.engine._requests.values() if st.prompt == PROMPTS[5])
        proxy.poison.add(rid)                        # from now on its logits rows are NaN
        await asyncio.wait_for(asyncio.gather(vt, *tasks), 120)
    assert proxy.poisoned_rows >= 1
    assert victim.terminals == ["error"] and "non-finite" in victim.error, vars(victim)
    assert victim.num_tokens < 400
    _assert_finished_ok(outs, refs, N)
    assert srv.engine.is_running and srv.engine.counters["error"] == 1
    o = Outcome("http")
    async with aiohttp.ClientSession() as s:
        await http_stream(s, srv.base, PROMPTS[0], N, o)   # the next request is served
    assert o.terminals == ["length", "[DONE]"] and o.text == refs[PROMPTS[0]]


async def test_detokenizer_fault_fails_only_that_request(oracle, tiny_model):
    srv = await oracle.serve(tiny_model, **ENGINE)
    refs = await _reference(srv, N)
    victim_ids = srv.engine.tokenizer.encode(PROMPTS[6])
    hits = detok_fault(srv.engine._core, victim_ids, after=3)
    async with aiohttp.ClientSession() as s:
        outs, tasks = await _bystanders(srv, s, N)
        victims = [Outcome(d) for d in ("http", "ws", "tcp")]
        vtasks = [http_stream(s, srv.base, PROMPTS[6], 300, victims[0]),
                  ws_stream(s, srv.ws_url, PROMPTS[6], 300, victims[1]),
                  tcp_stream(srv.tcp_port, PROMPTS[6], 300, victims[2])]
        await asyncio.wait_for(asyncio.gather(*vtasks, *tasks), 120)
    assert hits() == 3
    assert victims[0].terminals == ["error", "[DONE]"], vars(victims[0])
    assert victims[1].terminals == ["error"] and victims[2].terminals == ["error"]
    for v in victims:
        assert "detokeniz" in v.error and v.num_tokens <= 3
    _assert_finished_ok(outs, refs, N)
    assert srv.engine.is_running and srv.engine.counters["error"] == 3


async def _engine_fatal(oracle, model, inject) -> None:
    srv = await oracle.serve(model, **ENGINE)
    async with aiohttp.ClientSession() as s:
        outs, tasks = await _bystanders(srv, s, 400)
        await asyncio.wait_for(asyncio.gather(*(o.first_token.wait() for o in outs)), 60)
        inject(srv.engine._core)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for o in outs:                                   # exactly one terminal error each
            want = ["error", "[DONE]"] if o.door == "http" else ["error"]
            assert o.terminals == want, (o.door, o.terminals)
            assert o.num_tokens < 400
        assert not srv.engine.is_running
        for path in ("/health", "/ready"):
            async with s.get(srv.base + path) as r:
                assert r.status == 503, path
        async with s.post(srv.base + "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 503
            assert (await r.json())["error"]["type"] == "server_error"
        late = Outcome("ws")
        await ws_stream(s, srv.ws_url, "hi", 2, late)
        assert late.terminals == ["error"]
    c = await RawTCP.connect(srv.tcp_port)
    await c.send({"type": "generate", "id": 7, "prompt": "hi", "params": {"max_tokens": 2}})
    m = await c.recv()
    assert m["type"] == "error" and m["code"] == 503, m
    await c.close()


async def test_forward_raises_at_step_n(oracle, tiny_model):
    def inject(core):
        core.runner = RunnerProxy(core.runner)
        core.runner.arm(3, RuntimeError("injected forward failure"))
    await _engine_fatal(oracle, tiny_model, inject)


async def test_panic_like_base_exception(oracle, tiny_model):
    def inject(core):
        core.runner = RunnerProxy(core.runner)
        core.runner.arm(2, PanicLike("injected panic"))
    await _engine_fatal(oracle, tiny_model, inject)


async def test_rust_rejects_step(oracle, tiny_model):
    def inject(core):
        core.sampler = SamplerProxy(core.sampler)
        core.sampler.armed = True                    # update() raises ValueError in Rust
    await _engine_fatal(oracle, tiny_model, inject)


async def test_serve_process_exits_nonzero_on_engine_fault(oracle):
    """`ferrobatch serve` with a forward that fails at step N: streams end with an error,
    the process exits non-zero by itself and leaves no child process behind."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.join(ROOT, "python")]),
               PYTHONUNBUFFERED="1", FB_FAULT_AT_EXECUTE="6")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.join(HERE, "launch_serve.py"), "serve", "--device", "cpu",
        "--port", "0", "--tcp-port", "0", "--kv-cache-gb", "0.05", "--max-num-seqs", "8",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    lines: list[str] = []
    try:
        port = await _wait_port(proc, lines)
        o = Outcome("http")
        async with aiohttp.ClientSession() as s:
            await asyncio.wait_for(
                http_stream(s, f"http://{LOOPBACK}:{port}", "Hello", 400, o), 120)
        assert o.terminals == ["error", "[DONE]"] and "injected" in o.error, vars(o)
        rc = await asyncio.wait_for(proc.wait(), 60)
        rest = (await proc.stdout.read()).decode()
        assert rc != 0, "".join(lines) + rest
        assert "engine failed" in rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _wait_port(proc, lines: list[str]) -> int:
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 240)).decode()
        assert line, "server exited early:\n" + "".join(lines)
        lines.append(line)
        m = re.search(r"OpenAI HTTP : http://127\.0\.0\.1:(\d+)/v1", line)
        if m:
            return int(m.group(1))


del pytest, signal
