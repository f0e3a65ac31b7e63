"""Property-based fuzzing (hypothesis) of the msgpack TCP frames, the WebSocket messages and the
HTTP API: no crash, no hang (every reply bounded in time), no 5xx, and the next valid request
on a fresh connection succeeds. Runs on FakeCore (the doors and the engine are real).

The server runs on its own event-loop thread so hypothesis can drive it from a sync test.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import msgpack
import pytest
from fake_core import FakeCore
from harness import RawTCP, serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = 50
COUNT = {"tcp": 0, "ws": 0, "http": 0}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_srv():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    run = lambda coro, timeout=30: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)  # noqa: E731
    srv = run(serve(core=FakeCore(max_model_len=128)))
    srv.run = run
    yield srv
    run(srv.stop())
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)
    srv.engine.check_accounting()
    assert not srv.engine._requests and not srv.server.state.sessions


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                      st.floats(allow_nan=False), st.text(max_size=20))
json_val = st.recursive(json_leaf, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)), max_leaves=12)
FIELDS = ["type", "id", "prompt", "messages", "params", "version", "api_key", "max_tokens", "n",
          "temperature", "stop", "stop_token_ids", "logit_bias", "stream", "stream_options",
          "model", "top_p", "seed", "min_tokens", "ignore_eos", "input", "instructions",
          "max_output_tokens", "text", "metadata", "include", "tools", "tool_choice",
          "guided_grammar", "dimensions", "pooling", "normalize", "encoding_format",
          "use_beam_search", "length_penalty", "early_stopping", "bad_words",
          "allowed_token_ids", "truncate_prompt_tokens", "cache_salt", "text_1", "text_2",
          "query", "documents", "top_n", "return_documents", "vllm_xargs", "extra_args",
          "return_token_ids", "return_tokens_as_token_ids", "system", "stop_sequences",
          "thinking", "options", "format", "raw", "think", "suffix"]
# SGLang's /generate (serve/native_protocol.py): each field mostly a plausible value, now and
# then any JSON, so that both answers and refusals get exercised
def _mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.integers(0, 7).flatmap(lambda k: json_val if k == 0 else valid)


SGLANG_SAMPLING = {
    "max_new_tokens": st.integers(1, 8), "min_new_tokens": st.integers(0, 3),
    "temperature": st.floats(0, 2), "top_k": st.integers(-1, 5), "stop": st.text(max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "n": st.integers(1, 3),
    "regex": st.sampled_from(["a|b", "[0-9]+", "("]),
    "json_schema": st.sampled_from(['{"type": "object"}', "{}", "not json"]),
    "no_stop_trim": st.booleans(), "sampling_seed": st.integers(0, 2**32),
    "ignore_eos": st.booleans(), "spaces_between_special_tokens": st.booleans()}
_sampling = st.fixed_dictionaries(
    {"max_new_tokens": _mostly(SGLANG_SAMPLING["max_new_tokens"])},   # (its default overfills
    optional={k: _mostly(v) for k, v in SGLANG_SAMPLING.items()      # FakeCore's context)
              if k != "max_new_tokens"})
_prompt = st.one_of(
    st.fixed_dictionaries({"text": _mostly(st.one_of(
        st.text(min_size=1, max_size=20),
        st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3)))}),
    st.fixed_dictionaries({"input_ids": _mostly(st.one_of(
        st.lists(st.integers(0, 300), min_size=1, max_size=4),
        st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=3), min_size=1,
                 max_size=3)))}))
near_generate = st.tuples(_prompt, st.fixed_dictionaries(
    {"sampling_params": st.one_of(_sampling, _sampling, st.lists(_sampling, max_size=3))},
    optional={"stream": _mostly(st.booleans()), "return_logprob": _mostly(st.booleans()),
              "top_logprobs_num": _mostly(st.integers(0, 5)),
              "logprob_start_len": _mostly(st.integers(-1, 5)),
              "return_text_in_logprobs": _mostly(st.booleans()),
              "rid": _mostly(st.text(min_size=1, max_size=10))})).map(
    lambda parts: {**parts[0], **parts[1]})
# Anthropic's /v1/messages (serve/anthropic_protocol.py), the same way
_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _mostly(st.text(max_size=12))}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": _mostly(st.text(min_size=1,
                                                                               max_size=6)),
                           "name": st.sampled_from(["f", "g"]),
                           "input": _mostly(st.dictionaries(st.text(max_size=3), json_leaf,
                                                            max_size=2))}),
    st.fixed_dictionaries({"type": st.just("tool_result"),
                           "tool_use_id": _mostly(st.text(min_size=1, max_size=6)),
                           "content": _mostly(st.text(max_size=10))}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "x"])}))
_turn = st.fixed_dictionaries({
    "role": _mostly(st.sampled_from(["user", "assistant"])),
    "content": _mostly(st.one_of(st.text(min_size=1, max_size=15),
                                 st.lists(_block, min_size=1, max_size=3)))})
_tool = st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "input_schema": _mostly(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}}))})
near_messages = st.fixed_dictionaries(
    {"model": _mostly(st.just("fake")), "max_tokens": _mostly(st.integers(1, 8)),
     "messages": _mostly(st.lists(_turn, min_size=1, max_size=3))},
    optional={"system": _mostly(st.text(max_size=10)), "stream": _mostly(st.booleans()),
              "stop_sequences": _mostly(st.lists(st.text(max_size=3), max_size=2)),
              "temperature": _mostly(st.floats(0, 1)), "tools": _mostly(st.lists(_tool,
                                                                                max_size=2)),
              "tool_choice": _mostly(st.sampled_from([{"type": "any"}, {"type": "none"},
                                                      {"type": "tool", "name": "f"},
                                                      {"type": "auto"}, {"type": "tool"}])),
              "thinking": _mostly(st.sampled_from([{"type": "enabled"},
                                                   {"type": "disabled"}]))})
near_valid = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate", "embed", "cancel", "hello", "x"])},
    optional={f: json_val for f in FIELDS if f != "type"} | {
        "params": st.dictionaries(st.sampled_from(FIELDS), json_val, max_size=5),
        "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 600), max_size=10))})
msgpack_val = st.recursive(
    st.one_of(json_leaf, st.binary(max_size=10),
              st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))),
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(
        st.one_of(st.text(max_size=6), st.integers(-3, 3)), c, max_size=4)), max_leaves=12)


def hostile_bodies() -> st.SearchStrategy[bytes]:
    pk = lambda o: msgpack.packb(o, use_bin_type=True)  # noqa: E731
    return st.one_of(
        st.binary(min_size=1, max_size=64),                                # garbage
        near_valid.map(pk).flatmap(lambda b: st.integers(1, len(b)).map(lambda k: b[:k])),
        st.integers(10, 5000).map(lambda d: b"\x91" * d + b"\xc0"),       # deep nesting
        st.integers(10, 5000).map(lambda d: b"\x81\xa1k" * d + b"\xc0"),
        st.sampled_from([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",  # huge declared
                         b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01"]),
        msgpack_val.map(pk),                                               # ext types, wrong types
        near_valid.map(pk))


async def _valid_tcp(port: int) -> None:
    c = await RawTCP.connect(port)
    await c.send({"type": "generate", "id": 1, "prompt": "ok", "params": {"max_tokens": 3}})
    got = []
    while not got or got[-1]["type"] == "delta":
        m = await c.recv(10)
        assert m is not None
        got.append(m)
    assert got[-1]["type"] == "done", got
    await c.close()


@FUZZ
@given(bodies=st.lists(hostile_bodies(), min_size=1, max_size=3),
       lie=st.sampled_from([None, 0, 1 << 31, 7, 2**32 - 1]))
def test_fuzz_tcp_frames(fuzz_srv, bodies, lie):
    async def go():
        c = await RawTCP.connect(fuzz_srv.tcp_port)
        for b in bodies:
            c.send_raw(b, declared=lie)            # a lying length header, sometimes
        await c.w.drain()
        while True:                      # replies until the server closes or goes quiet
            try:
                m = await c.recv(0.3)
            except asyncio.TimeoutError:
                break
            if m is None:
                break
            assert m["type"] in ("error", "delta", "done", "cancelled", "hello"), m
            if m["type"] == "error":
                assert 400 <= m["code"] < 500 or m["code"] == 503, m
        c.reset()
        await _valid_tcp(fuzz_srv.tcp_port)
    COUNT["tcp"] += len(bodies)
    fuzz_srv.run(go())


@FUZZ
@given(msgs=st.lists(st.one_of(near_valid.map(lambda o: ("t", json.dumps(o))),
                               st.text(max_size=40).map(lambda s: ("t", s)),
                               st.integers(10, 3000).map(lambda d: ("t", "[" * d + "]" * d)),
                               hostile_bodies().map(lambda b: ("b", b))), min_size=1, max_size=3))
def test_fuzz_ws_messages(fuzz_srv, msgs):
    def decode(m):
        return json.loads(m.data) if m.type == aiohttp.WSMsgType.TEXT else \
            msgpack.unpackb(m.data, raw=False)

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(fuzz_srv.ws_url) as ws:
                for kind, data in msgs:
                    await (ws.send_str(data) if kind == "t" else ws.send_bytes(data))
                while True:
                    try:
                        m = await ws.receive(timeout=0.3)
                    except asyncio.TimeoutError:
                        break
                    if m.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                        break
                    obj = decode(m)
                    if obj["type"] == "error":
                        assert 400 <= obj["code"] < 500, obj
                await ws.send_str(json.dumps({"type": "generate", "id": "v", "prompt": "ok",
                                              "params": {"max_tokens": 2}}))
                last = None
                while last is None or last["type"] == "delta" or last.get("id") != "v":
                    # (a reply to a fuzz message may come late, past the wait above: a binary
                    # message's in msgpack)
                    last = decode(await ws.receive(timeout=10))
                assert last["type"] == "done", last
    COUNT["ws"] += len(msgs)
    fuzz_srv.run(go())


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses",
                             "/v1/embeddings", "/v1/score", "/v1/rerank", "/generate",
                             "/abort_request", "/v1/messages", "/v1/messages/count_tokens",
                             "/api/chat", "/api/generate", "/api/show", "/api/embed",
                             "/invocations"]),
       body=st.one_of(near_valid.map(lambda o: json.dumps(o).encode()),
                      near_generate.map(lambda o: json.dumps(o).encode()),
                      st.fixed_dictionaries({}, optional={f: json_val for f in FIELDS})
                      .map(lambda o: json.dumps(o).encode()),
                      st.binary(max_size=64),
                      st.integers(10, 3000).map(lambda d: b"[" * d + b"]" * d),
                      st.just(b'{"prompt": NaN}')),
       ctype=st.sampled_from(["application/json", "text/plain", "application/msgpack"]))
def test_fuzz_http_api(fuzz_srv, path, body, ctype):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(fuzz_srv.base + path, data=body,
                              headers={"Content-Type": ctype}) as r:
                text = await asyncio.wait_for(r.text(), 30)
                assert r.status < 500, (r.status, body[:200], text[:300])
                if r.status != 200:
                    assert "error" in json.loads(text)
            async with s.post(fuzz_srv.base + "/v1/completions",
                              json={"prompt": "ok", "max_tokens": 2}) as r:
                assert r.status == 200
    COUNT["http"] += 1
    fuzz_srv.run(go())


@FUZZ
@given(body=near_generate)
def test_fuzz_sglang_generate(fuzz_srv, body):
    """SGLang's /generate on near-valid bodies: a 4xx naming the error, or a whole answer (a
    stream ends with [DONE]); the engine serves on."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(fuzz_srv.base + "/generate", json=body) as r:
                text = await asyncio.wait_for(r.text(), 30)
                assert r.status < 500, (r.status, body, text[:300])
                if r.status != 200:
                    assert json.loads(text)["error"]["message"]
                elif body.get("stream") is True:
                    assert text.endswith("data: [DONE]\n\n"), text[-200:]
                else:
                    assert "output_ids" in text
            async with s.post(fuzz_srv.base + "/generate",
                              json={"text": "ok", "sampling_params": {"max_new_tokens": 2}}) as r:
                assert r.status == 200
    COUNT["http"] += 1
    fuzz_srv.run(go())


@FUZZ
@given(body=near_messages)
def test_fuzz_anthropic_messages(fuzz_srv, body):
    """Anthropic's /v1/messages on near-valid bodies: an Anthropic error object with a 4xx, or
    a whole reply (a stream ends with message_stop); the engine serves on."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(fuzz_srv.base + "/v1/messages", json=body) as r:
                text = await asyncio.wait_for(r.text(), 30)
                assert r.status < 500, (r.status, body, text[:300])
                if r.status != 200:
                    err = json.loads(text)
                    assert err["type"] == "error" and err["error"]["message"], err
                elif body.get("stream") is True:
                    assert "event: message_stop" in text, text[-300:]
                else:
                    assert json.loads(text)["type"] == "message"
            async with s.post(fuzz_srv.base + "/v1/messages", json={
                    "model": "fake", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "ok"}]}) as r:
                assert r.status == 200
    COUNT["http"] += 1
    fuzz_srv.run(go())


def test_fuzz_totals(fuzz_srv):
    """Runs last in this module: the engine is still healthy and idle after all of it."""
    print("fuzz inputs tried:", COUNT)
    if not any(COUNT.values()):
        pytest.skip("counts the fuzz tests of this module: run it with them")
    assert all(COUNT.values()), f"a door was never fuzzed: {COUNT}"
    assert fuzz_srv.engine.is_running
    fuzz_srv.run(_valid_tcp(fuzz_srv.tcp_port))
