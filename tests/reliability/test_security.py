"""Security: API key on every route but liveness (constant-time compare), loopback default bind,
error bodies that echo neither prompts nor internal details, and no unpickling in runtime code."""

from __future__ import annotations

import ast
import inspect
import os
import re

import aiohttp
from fake_core import FakeCore
from harness import ROOT, RawTCP

from ferrobatch.cli import build_parser
from ferrobatch.serve import middleware, session
from ferrobatch.serve.server import Server

KEY = "s3cret-key"
MARKER = "PROMPT-MARKER-7f3a"


async def test_api_key_on_every_route(oracle):
    srv = await oracle.serve(core=FakeCore(), api_key=KEY)
    routes = {(r.method, r.resource.canonical) for r in srv.server.app.router.routes()
              if r.method != "HEAD"}
    assert ("POST", "/v1/completions") in routes and ("GET", "/v1/ws") in routes
    async with aiohttp.ClientSession() as s:
        for method, path in sorted(routes):
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"},
                            {"x-api-key": "wrong"}, {"x-api-key": ""},
                            {"x-api-key": f"Bearer {KEY}"}):
                async with s.request(method, srv.base + path, headers=headers, json={}) as r:
                    if path in ("/health", "/ping"):          # liveness
                        assert r.status == 200
                    else:
                        assert r.status == 401, (method, path, headers, r.status)
                        assert (await r.json())["error"]["type"] == "authentication_error"
            for good in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):  # (Anthropic's)
                async with s.request(method, srv.base + path, headers=good,
                                     json={"prompt": "x", "max_tokens": 1}) as r:
                    assert r.status != 401, (method, path, good)
    # TCP: nothing before a hello with the right key
    for hello in ({"type": "hello", "version": 1}, {"type": "hello", "version": 1,
                                                    "api_key": "wrong"}):
        c = RawTCP.__new__(RawTCP)
        import asyncio
        c.r, c.w = await asyncio.open_connection("127.0.0.1", srv.tcp_port)
        await c.send(hello)
        assert (await c.recv())["code"] == 401
        await c.send({"type": "generate", "id": 1, "prompt": "x", "params": {"max_tokens": 1}})
        assert (await c.recv())["code"] == 401
        await c.close()
    c = await RawTCP.connect(srv.tcp_port, api_key=KEY)
    await c.close()


def test_compare_is_constant_time():
    for fn in (middleware.auth_middleware, session.Session._hello):
        src = inspect.getsource(fn)
        assert "hmac.compare_digest" in src and "==" not in src.replace("!=", ""), fn


def test_default_bind_is_loopback():
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    assert inspect.signature(Server.start).parameters["host"].default == "127.0.0.1"


async def test_error_bodies_do_not_echo(oracle):
    core = FakeCore(max_model_len=64)
    srv = await oracle.serve(core=core)
    bad_bodies = [
        {"prompt": MARKER * 50, "max_tokens": 4},                     # over max_model_len
        {"prompt": MARKER, "max_tokens": -1},
        {"prompt": MARKER, "temperature": "hot"},
        {"prompt": MARKER, "n": 10 ** 9},
        {"prompt": MARKER, "stop": [MARKER * 100] * 40},
        {"prompt": MARKER, "model": "other"},
        {"messages": [{"role": MARKER, "content": MARKER}]},
        {"prompt": [MARKER, 5]},
    ]
    leaks = re.compile(r"Traceback|File \"|/work/|site-packages|0x[0-9a-f]{6,}|127\.0\.0\.1")
    async with aiohttp.ClientSession() as s:
        for body in bad_bodies:
            for path in ("/v1/completions", "/v1/chat/completions"):
                async with s.post(srv.base + path, json=body) as r:
                    text = await r.text()
                    assert 400 <= r.status < 500, (body, r.status, text)
                    assert MARKER not in text, (path, body, text)
                    assert not leaks.search(text), text
        # an internal failure while submitting: 500 with a generic message only
        core.fail_submit = RuntimeError(f"boom at 0x7fdeadbeef /work/x.py {MARKER}")
        async with s.post(srv.base + "/v1/completions",
                          json={"prompt": MARKER, "max_tokens": 2}) as r:
            text = await r.text()
            assert r.status == 500 and MARKER not in text and not leaks.search(text), text


def _runtime_files():
    base = os.path.join(ROOT, "python", "ferrobatch")
    for d, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(d, f)


def test_runtime_never_unpickles():
    banned_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal",
                      "joblib"}
    problems = []
    files = list(_runtime_files())
    assert len(files) > 30
    for path in files:
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                names = []
            problems += [f"{path}: imports {n}" for n in names if n in banned_modules]
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                kw = {k.arg: k.value for k in node.keywords}
                owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
                if name == "load" and owner == "torch":
                    wo = kw.get("weights_only")
                    if not (isinstance(wo, ast.Constant) and wo.value is True):
                        problems.append(f"{path}:{node.lineno}: torch.load without "
                                        "weights_only=True")
                if name == "load" and owner in ("np", "numpy"):
                    ap = kw.get("allow_pickle")
                    if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                        problems.append(f"{path}:{node.lineno}: np.load(allow_pickle=...)")
                if name in ("loads", "load", "Unpickler") and owner in banned_modules:
                    problems.append(f"{path}:{node.lineno}: {owner}.{name}")
                if name in ("unpackb", "Unpacker") and owner == "msgpack" \
                        and "ext_hook" not in kw and "max_ext_len" not in kw:
                    problems.append(f"{path}:{node.lineno}: msgpack decode without ext limits")
    assert not problems, problems
