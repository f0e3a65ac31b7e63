"""SageMaker's routes (FakeCore): `/ping` is liveness like `/health` (no key needed), and
`/invocations` reaches the route the body's fields name, answering in that route's shape
(streams included); a body naming none is a 400."""

from __future__ import annotations

import json

import aiohttp
import pytest


async def _post(r, path: str, body, headers=None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + path, json=body, headers=headers) as resp:
            return resp.status, await resp.text()


async def test_invocations_reach_the_route_the_body_names(fake_server):
    for body in ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                 {"prompt": "abc", "max_tokens": 2},
                 {"prompt": "abc", "max_tokens": 2, "stream": True}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        direct = await _post(fake_server, path, body)
        via = await _post(fake_server, "/invocations", body)
        assert via[0] == direct[0] == 200
        if body.get("stream"):
            assert via[1].endswith("data: [DONE]\n\n")
            texts = [json.loads(line[6:])["choices"][0]["text"] for line in via[1].split("\n\n")
                     if line.startswith("data: {")]
            assert "".join(texts) == "ab"
        else:
            got, want = json.loads(via[1]), json.loads(direct[1])
            assert got["object"] == want["object"]
            assert got["choices"][0].get("text", got["choices"][0].get("message")) == \
                want["choices"][0].get("text", want["choices"][0].get("message"))
    status, text = await _post(fake_server, "/invocations", {"max_tokens": 3})
    assert status == 400 and "'messages' (chat)" in json.loads(text)["error"]["message"]
    status, text = await _post(fake_server, "/invocations", {"prompt": "x", "max_tokens": -1})
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("fake_server", [{"api_key": "k"}], indirect=True)
async def test_ping_is_liveness_and_needs_no_key(fake_server):
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "POST"):
            async with s.request(method, fake_server.base + "/ping") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ok"
    assert (await _post(fake_server, "/invocations", {"prompt": "a", "max_tokens": 1}))[0] == 401
    assert (await _post(fake_server, "/invocations", {"prompt": "a", "max_tokens": 1},
                        {"Authorization": "Bearer k"}))[0] == 200
