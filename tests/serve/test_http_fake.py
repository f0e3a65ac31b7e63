"""HTTP door on FakeCore: OpenAI shapes, SSE, validation, auth, backpressure, disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest


async def post(r, path, body, headers=None, raw=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + path, json=body if raw is None else None, data=raw,
                          headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.text()


async def sse_events(r, path, body):
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + path, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
            for block in buf.decode().split("\n\n"):
                if block.startswith("data: "):
                    events.append(block[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_completion_non_streaming(fake_server):
    status, _, text = await post(fake_server, "/v1/completions",
                                 {"model": "fake", "prompt": "hello", "max_tokens": 7})
    assert status == 200
    body = json.loads(text)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "hellohe", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


async def test_completion_multi_prompt_and_n(fake_server):
    status, _, text = await post(fake_server, "/v1/completions",
                                 {"prompt": [[97, 98, 99], [120, 121]], "max_tokens": 2, "n": 2})
    assert status == 200
    body = json.loads(text)
    assert [c["text"] for c in body["choices"]] == ["ab", "bc", "xy", "yx"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 8


async def test_completion_stream_with_usage(fake_server):
    events = await sse_events(fake_server, "/v1/completions", {
        "prompt": "abcXYZ", "max_tokens": 20, "stop": "XYZ", "stream": True,
        "stream_options": {"include_usage": True}})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "abc"
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 6
    finals = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert [c["finish_reason"] for c in finals] == ["stop"]
    assert len({e["id"] for e in events}) == 1


async def test_stream_with_continuous_usage_stats(fake_server):
    """vLLM's `continuous_usage_stats`: every chunk carries the usage so far (its own tokens
    included), the last one the totals; without `include_usage` it changes nothing."""
    for route, body in (("/v1/completions", {"prompt": "abcdef", "max_tokens": 5}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})):
        events = await sse_events(fake_server, route, {
            **body, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        usages = [e["usage"] for e in events]
        assert all(u is not None for u in usages), events
        prompt = usages[-1]["prompt_tokens"]
        assert prompt > 0 and all(u["prompt_tokens"] == prompt for u in usages)
        counts = [u["completion_tokens"] for u in usages]
        assert counts == sorted(counts) and counts[-1] == body["max_tokens"]
        assert all(u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
        streamed = [c for e in events[:-1] for c in e["choices"]]
        assert streamed and events[-1]["choices"] == []
        events = await sse_events(fake_server, route, {
            **body, "stream": True, "stream_options": {"continuous_usage_stats": True}})
        assert all("usage" not in e for e in events)


@pytest.mark.parametrize("fake_server", [{"core": {"max_running": 1, "step_delay_s": 0.01}}],
                         indirect=True)
async def test_chat_role_chunk_waits_for_the_first_token(fake_server):
    """The role chunk is the first chunk with choices, which clients (`vllm bench serve`) time
    as the first token: it must not go out while the request still waits for its first token
    (here: queued behind another request that holds the only slot for ~40 steps)."""
    async def first_event_after() -> tuple[float, dict]:
        async with aiohttp.ClientSession() as s:
            async with s.post(fake_server.base + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "stream": True}) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        return time.monotonic(), json.loads(line[6:])
        raise AssertionError("no event")

    busy = asyncio.create_task(post(fake_server, "/v1/completions",
                                    {"prompt": "ab", "max_tokens": 40, "ignore_eos": True}))
    await asyncio.sleep(0.05)           # the busy request holds the only slot
    t0 = time.monotonic()
    t_first, first = await first_event_after()
    status, _, _ = await busy
    assert status == 200
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # ~40 steps of 10 ms were left on the busy request; an eager role chunk came at once
    assert t_first - t0 > 0.1, f"role chunk after {t_first - t0:.3f} s"


async def test_a_body_that_is_not_the_gzip_it_claims_is_a_400(fake_server):
    status, headers, text = await post(fake_server, "/v1/completions", None, raw=b"xx",
                                       headers={"Content-Encoding": "gzip",
                                                "Content-Type": "application/json"})
    assert status == 400, text
    assert "could not be decoded" in json.loads(text)["error"]["message"]
    assert headers.get("Connection") == "close"     # nothing more can be read on it
    status, _, _ = await post(fake_server, "/v1/completions", {"prompt": "ab", "max_tokens": 2})
    assert status == 200


async def test_chat_stream_shape(fake_server):
    events = await sse_events(fake_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["delta"].get("content", "") for e in events[1:] for c in e["choices"])
    assert content == "<use"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in events[-1]


async def test_chat_non_streaming(fake_server):
    status, _, text = await post(fake_server, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "s"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 3})
    body = json.loads(text)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "<sy"}


BAD = [
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "context window"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "integer"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.01}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ({"prompt": "hi", "n": 1000}, 400, "n must be"),
    ({"prompt": "hi", "stop": ["a"] * 40}, 400, "stop"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": [1, 2, 99999]}, 400, "vocabulary"),
    ({"prompt": [1, -2]}, 400, "vocabulary"),
    ({"prompt": "a" * 400}, 400, "context window"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": 1}}, 400,
     "continuous_usage_stats"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "seed": -2}, 400, "seed"),
    ({"prompt": "hi", "ignore_eos": 1}, 400, "boolean"),
    ({"prompt": "hi", "stop_token_ids": [1, 10**6]}, 400, "vocabulary"),
    ([1, 2], 400, "JSON object"),
]


@pytest.mark.parametrize("body,status,needle", BAD)
async def test_bad_completion_requests(fake_server, body, status, needle):
    got, _, text = await post(fake_server, "/v1/completions", body)
    err = json.loads(text)["error"]
    assert got == status and needle in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    assert fake_server.engine.check_accounting()["open"] == 0


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": "hi"}, "messages"),
])
async def test_bad_chat_requests(fake_server, body, needle):
    got, _, text = await post(fake_server, "/v1/chat/completions", body)
    assert got == 400 and needle in json.loads(text)["error"]["message"]


async def test_bad_json_and_oversized_body(fake_server):
    got, _, text = await post(fake_server, "/v1/completions", None, raw=b"{nope",
                              headers={"Content-Type": "application/json"})
    assert got == 400 and "invalid JSON" in json.loads(text)["error"]["message"]
    got, _, text = await post(fake_server, "/v1/completions", None, raw=b"x" * (2 << 20))
    assert got == 413 and json.loads(text)["error"]["code"] == 413
    got, _, text = await post(fake_server, "/v1/nothing", {})
    assert got == 404 and "error" in json.loads(text)


@pytest.mark.parametrize("fake_server", [{"api_key": "sekret"}], indirect=True)
async def test_api_key(fake_server):
    got, _, _ = await post(fake_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert got == 401
    got, _, _ = await post(fake_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                           headers={"Authorization": "Bearer wrong"})
    assert got == 401
    got, _, _ = await post(fake_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                           headers={"Authorization": "Bearer sekret"})
    assert got == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(fake_server.base + "/health") as resp:
            assert resp.status == 200                 # liveness needs no key
        async with s.get(fake_server.base + "/v1/models") as resp:
            assert resp.status == 401


async def until(condition, what: str, timeout: float = 10.0) -> None:
    """Polls ``condition()`` until it holds; fails (never hangs) after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("fake_server", [{"config": {"max_queued_requests": 2},
                                          "core": {"max_running": 1, "step_delay_s": 0.01}}],
                         indirect=True)
async def test_queue_full_is_429(fake_server):
    engine = fake_server.engine
    async with aiohttp.ClientSession() as s:
        long = []
        for n in range(1, 4):               # one runs, two wait: the queue is then full
            long.append(asyncio.create_task(s.post(fake_server.base + "/v1/completions",
                                                   json={"prompt": "x", "max_tokens": 100})))
            # the first must be running (out of the queue) before the third comes, or the
            # third would find the queue full; each takes ~1 s (100 steps of 10 ms)
            await until(lambda n=n: engine.check_accounting()["open"] == n
                        and len(engine._unscheduled) == n - 1, f"request {n} in place")
        assert len(engine._unscheduled) == 2
        async with s.post(fake_server.base + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 1}) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["type"] == "rate_limit_error"
        for t in long:
            resp = await t
            assert resp.status == 200
            resp.release()


async def test_disconnect_mid_stream_aborts(fake_server):
    engine = fake_server.engine
    async with aiohttp.ClientSession() as s:
        resp = await s.post(fake_server.base + "/v1/completions",
                            json={"prompt": "abc", "max_tokens": 200, "stream": True})
        await resp.content.readline()
        assert engine.check_accounting()["open"] == 1
        resp.close()                                  # drop the connection mid-stream
    await engine.check_idle_clean(5.0)
    assert engine.counters["abort"] == 1


async def test_disconnect_while_waiting_non_streaming(fake_server):
    engine = fake_server.engine
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(fake_server.base + "/v1/completions",
                                          json={"prompt": "abc", "max_tokens": 250}))
        await asyncio.sleep(0.1)
        task.cancel()
    await engine.check_idle_clean(5.0)
    assert engine.counters["abort"] == 1


async def test_models_health_ready_metrics(fake_server):
    async with aiohttp.ClientSession() as s:
        async with s.get(fake_server.base + "/v1/models") as resp:
            data = (await resp.json())["data"]
            assert data[0]["id"] == "fake" and data[0]["object"] == "model"
        async with s.get(fake_server.base + "/v1/models/fake") as resp:
            assert resp.status == 200 and await resp.json() == data[0]
        async with s.get(fake_server.base + "/v1/models/org/other-model") as resp:
            err = (await resp.json())["error"]
            assert resp.status == 404 and err["type"] == "not_found_error"
            assert "'org/other-model' does not exist" in err["message"]
        async with s.get(fake_server.base + "/version") as resp:
            from ferrobatch import __version__
            assert await resp.json() == {"version": __version__}
        for _ in range(3):          # readiness probes run a real step but are not traffic
            async with s.get(fake_server.base + "/ready") as resp:
                assert resp.status == 200
        await post(fake_server, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
        async with s.get(fake_server.base + "/metrics") as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "num_admission_holds_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket"):
        assert f"ferrobatch_{name}" in text, name
    assert 'ferrobatch_request_success_total{finished_reason="length",model_name="fake"} 1.0' \
        in text
    assert 'ferrobatch_generation_tokens_total{model_name="fake"} 3.0' in text
    assert 'ferrobatch_prompt_tokens_total{model_name="fake"} 3.0' in text
    assert 'ferrobatch_time_to_first_token_seconds_count{model_name="fake"} 1.0' in text
    # per finished request (vLLM's names): its lengths, its bounds, its phases' times
    assert 'ferrobatch_request_prompt_tokens_sum{model_name="fake"} 3.0' in text
    assert 'ferrobatch_request_generation_tokens_sum{model_name="fake"} 3.0' in text
    assert 'ferrobatch_request_generation_tokens_bucket{le="2.0",model_name="fake"} 0.0' in text
    assert 'ferrobatch_request_generation_tokens_bucket{le="5.0",model_name="fake"} 1.0' in text
    assert 'ferrobatch_request_params_max_tokens_sum{model_name="fake"} 3.0' in text
    assert 'ferrobatch_request_params_n_sum{model_name="fake"} 1.0' in text
    for phase in ("prefill", "decode", "inference"):
        assert f'ferrobatch_request_{phase}_time_seconds_count{{model_name="fake"}} 1.0' in text
    # per step: the probes' steps are not counted; the request's are: its 3-token prompt with
    # its first token, then two decodes
    assert 'ferrobatch_iteration_tokens_total_count{model_name="fake"} 3.0' in text
    assert 'ferrobatch_iteration_tokens_total_sum{model_name="fake"} 5.0' in text


async def test_engine_death_marks_not_ready(fake_server):
    engine = fake_server.engine
    engine._core.fail_next_step = RuntimeError("device lost")
    got, _, text = await post(fake_server, "/v1/completions", {"prompt": "abc",
                                                               "max_tokens": 50})
    assert got == 500 and "device lost" in json.loads(text)["error"]["message"]
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/ready"):
            async with s.get(fake_server.base + path) as resp:
                assert resp.status == 503
    got, _, text = await post(fake_server, "/v1/completions", {"prompt": "abc"})
    assert got == 503


async def test_stop_ends_streams_still_running_after_the_drain_timeout():
    """Past `drain_timeout_s` the server aborts what still runs: the stream ends with a final
    chunk and [DONE] at once, and stop() returns, instead of generating on for minutes."""
    from fake_core import FakeCore
    from serve_support import start_server

    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model="fake"), core=FakeCore(step_delay_s=0.05))
    r = await start_server(engine)
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + "/v1/completions", json={
                "prompt": "ab", "max_tokens": 200, "ignore_eos": True, "stream": True}) as resp:
            stop = None
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if stop is None:
                        t0 = time.monotonic()
                        stop = asyncio.create_task(r.server.stop(drain_timeout_s=0.3))
            await asyncio.wait_for(stop, 15)
            took = time.monotonic() - t0
    await engine.shutdown()
    assert events[-1] == b"[DONE]"
    final = json.loads(events[-2])["choices"][0]
    assert final["finish_reason"] is not None
    texts = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert 0 < len(texts) < 200
    assert took < 8, f"stop took {took:.1f} s"


async def test_malformed_http_is_a_400_and_one_log_line_not_a_traceback(fake_server, caplog):
    """aiohttp's parser refuses these before any handler runs; its log record (a traceback at
    ERROR) becomes one WARNING line naming the client and the reason."""
    import logging
    port = int(fake_server.base.rsplit(":", 1)[1])
    bad = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
           b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\n"
           b"Content-Length: 2\r\n\r\n{}",
           b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n"]
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        for data in bad:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(data)
            await writer.drain()
            head = await asyncio.wait_for(reader.read(64), 10)
            writer.close()
            assert head.startswith(b"HTTP/1.0 400") or head.startswith(b"HTTP/1.1 400"), head
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == len(bad), [r.getMessage() for r in records]
    for r in records:
        assert r.levelno == logging.WARNING and r.exc_info is None and r.exc_text is None
        assert r.getMessage().startswith("rejected a malformed HTTP request from 127.0.0.1: ")
    assert "brotli" in records[1].getMessage()
    async with aiohttp.ClientSession() as s:                     # the server is fine
        async with s.get(fake_server.base + "/health") as resp:
            assert resp.status == 200


@pytest.mark.parametrize("fake_server", [{"served_model_name": ["main", "alias"]}],
                         indirect=True)
async def test_served_model_name_aliases(fake_server):
    """`--served-model-name main alias`: both are listed and accepted; a response reports the
    name it was asked for (the first when none), anything else is a 404."""
    async with aiohttp.ClientSession() as s:
        async with s.get(fake_server.base + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["main", "alias"]
        async with s.get(fake_server.base + "/v1/models/alias") as resp:
            assert resp.status == 200 and (await resp.json())["id"] == "alias"
    for asked, reported in ((None, "main"), ("main", "main"), ("alias", "alias")):
        body = {"prompt": "hi", "max_tokens": 2, **({"model": asked} if asked else {})}
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            if path == "/v1/chat/completions":
                body = {k: v for k, v in body.items() if k != "prompt"} | {
                    "messages": [{"role": "user", "content": "hi"}]}
            if path == "/v1/responses":
                body = {k: v for k, v in body.items() if k not in ("messages", "max_tokens")} | {
                    "input": "hi", "max_output_tokens": 2}
            status, _, text = await post(fake_server, path, body)
            assert status == 200 and json.loads(text)["model"] == reported, (path, text)
    status, _, text = await post(fake_server, "/v1/completions", {"prompt": "x",
                                                                  "model": "other"})
    assert status == 404 and "serves 'main'" in json.loads(text)["error"]["message"]


def _rid(headers: dict) -> str | None:
    """The X-Request-Id of a response's headers (as a plain dict: aiohttp spells it -ID)."""
    return next((v for k, v in headers.items() if k.lower() == "x-request-id"), None)


@pytest.mark.parametrize("fake_server", [{"api_key": "sekret"}], indirect=True)
async def test_x_request_id_is_echoed_and_names_the_response(fake_server):
    """A client's X-Request-Id comes back in the header (errors and streams too) and as the
    base of the object id; without one the server makes a fresh one per request; a malformed
    one is a 400 that does not reflect it."""
    auth = {"Authorization": "Bearer sekret"}
    body = {"prompt": "hi", "max_tokens": 2}
    got, headers, text = await post(fake_server, "/v1/completions", body,
                                    headers={**auth, "X-Request-Id": "trace-7/a:b"})
    assert got == 200 and _rid(headers) == "trace-7/a:b"
    assert json.loads(text)["id"] == "cmpl-trace-7/a:b"
    got, headers, text = await post(fake_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={**auth, "X-Request-Id": "c1"})
    assert json.loads(text)["id"] == "chatcmpl-c1" and _rid(headers) == "c1"
    got, headers, _ = await post(fake_server, "/v1/completions", body,
                                 headers={"X-Request-Id": "no-key"})
    assert got == 401 and _rid(headers) == "no-key"          # errors carry it too
    ids = set()
    for _ in range(2):
        got, headers, text = await post(fake_server, "/v1/completions", body, headers=auth)
        assert got == 200 and len(_rid(headers)) == 24
        assert not json.loads(text)["id"].endswith(_rid(headers))
        ids.add(_rid(headers))
    assert len(ids) == 2
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/completions", json={**body, "stream": True},
                          headers={**auth, "X-Request-Id": "s1"}) as resp:
            assert resp.headers["x-request-id"] == "s1"
            chunks = [json.loads(line[6:]) for line in (await resp.text()).split("\n\n")
                      if line.startswith("data: {")]
    assert chunks and all(c["id"] == "cmpl-s1" for c in chunks)
    for bad in ("x" * 129, "two words", "<script>"):
        got, headers, text = await post(fake_server, "/v1/completions", body,
                                        headers={**auth, "X-Request-Id": bad})
        assert got == 400 and "X-Request-Id" in text and bad not in text
        assert _rid(headers) is None


async def test_embeddings_route_shapes_on_fakecore(fake_server):
    """`/v1/embeddings`: one item per input in order, float and base64 (little-endian float32)
    alike, usage of the prompts; bad bodies are 400s naming the field."""
    import base64

    import numpy as np
    from fake_core import fake_embedding

    from ferrobatch.engine.pooling import finish_embedding
    from ferrobatch.pooling_params import PoolingParams

    inputs = ["abc", "hi", "hello"]
    status, _, text = await post(fake_server, "/v1/embeddings", {"input": inputs})
    body = json.loads(text)
    assert status == 200 and body["object"] == "list" and body["model"] == "fake"
    prompts = [[ord(c) for c in text] for text in inputs]
    for i, (item, p) in enumerate(zip(body["data"], prompts)):
        assert item["index"] == i and item["object"] == "embedding"
        want = finish_embedding(fake_embedding(p), PoolingParams())
        np.testing.assert_allclose(item["embedding"], want, rtol=1e-6)
    assert body["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
    status, _, text = await post(fake_server, "/v1/embeddings", {
        "input": "abc", "encoding_format": "base64", "dimensions": 3, "normalize": False})
    raw = np.frombuffer(base64.b64decode(json.loads(text)["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(raw, fake_embedding(prompts[0])[:3])
    status, _, text = await post(fake_server, "/v1/embeddings", {"input": [[104, 105], [97]]})
    assert [len(d["embedding"]) for d in json.loads(text)["data"]] == [8, 8]
    for bad, param in (({"input": 5}, "input"), ({"input": ["a", [1]]}, "input"),
                       ({"input": "x", "dimensions": 9}, "dimensions"),
                       ({"input": "x", "pooling": "cls"}, "pooling"),
                       ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                       ({"input": "x", "model": "other"}, "model")):
        status, _, text = await post(fake_server, "/v1/embeddings", bad)
        assert status in (400, 404) and json.loads(text)["error"]["param"] == param, (bad, text)


@pytest.mark.parametrize("fake_server", [{"api_key": "k"}], indirect=True)
async def test_every_http_request_is_counted_and_timed_by_route_method_and_status(fake_server):
    """Answers, refusals (a bad body, a wrong key, a path no route serves) and streams count
    with their status under the route's path template; a client that leaves mid-stream counts
    as 499."""
    key = {"Authorization": "Bearer k"}
    async with aiohttp.ClientSession(headers=key) as s:
        for body in ({"prompt": "abc", "max_tokens": 2}, {"prompt": "abc", "max_tokens": 2,
                                                          "stream": True},
                     {"prompt": "abc", "max_tokens": -1}):
            async with s.post(fake_server.base + "/v1/completions", json=body) as resp:
                await resp.read()
        async with s.get(fake_server.base + "/v1/models/fake") as resp:
            await resp.read()
        async with s.get(fake_server.base + "/no/such/route") as resp:
            assert resp.status == 404
        async with s.post(fake_server.base + "/v1/completions", json={
                "prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}) as resp:
            await resp.content.readline()          # the first event, then leave
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/completions", json={}) as resp:
            assert resp.status == 401
    await fake_server.engine.wait_idle()
    async with aiohttp.ClientSession(headers=key) as s:
        for _ in range(100):                   # (the left stream's handler ends on its own)
            async with s.get(fake_server.base + "/metrics") as resp:
                text = await resp.text()
            if 'status="499"' in text:
                break
            await asyncio.sleep(0.02)

    def count(handler: str, method: str, status: int) -> float:
        line = (f'ferrobatch_http_requests_total{{handler="{handler}",method="{method}",'
                f'status="{status}"}} ')
        return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])

    assert count("/v1/completions", "POST", 200) == 2
    assert count("/v1/completions", "POST", 400) == 1
    assert count("/v1/completions", "POST", 401) == 1
    assert count("/v1/completions", "POST", 499) == 1
    assert count("/v1/models/{model}", "GET", 200) == 1
    assert count("<unmatched>", "GET", 404) == 1
    assert ('ferrobatch_http_request_duration_seconds_count{handler="/v1/completions",'
            'method="POST"} 5.0') in text


@pytest.mark.parametrize("fake_server", [{"vllm_metric_names": True}], indirect=True)
async def test_metrics_can_carry_vllms_names(fake_server):
    """`serve --vllm-metric-names`: every metric as vLLM names it (`vllm:` for `ferrobatch_`),
    so that dashboards made for vLLM read them."""
    await post(fake_server, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    async with aiohttp.ClientSession() as s:
        async with s.get(fake_server.base + "/metrics") as resp:
            text = await resp.text()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    # (the HTTP request metrics as vLLM's prometheus-fastapi-instrumentator names them)
    assert names and all(n.startswith(("vllm:", "http_")) for n in names), names
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="200"} 1.0' \
        in text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:request_success_total", "vllm:num_preemptions_total"):
        assert name in names, name
    assert 'vllm:generation_tokens_total{model_name="fake"} 3.0' in text
