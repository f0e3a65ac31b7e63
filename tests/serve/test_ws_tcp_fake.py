"""WebSocket and TCP doors on FakeCore: multiplexing, cancel, close-aborts, hostile input."""

from __future__ import annotations

import asyncio
import json
import struct

import aiohttp
import msgpack
import pytest

from ferrobatch.client import TCPClient, WSClient


async def clients(r, which):
    if which == "ws-json":
        return await WSClient.connect(r.ws_url)
    if which == "ws-msgpack":
        return await WSClient.connect(r.ws_url, binary=True)
    return await TCPClient.connect("127.0.0.1", r.tcp_port)


DOORS = ["ws-json", "ws-msgpack", "tcp"]


@pytest.mark.parametrize("door", DOORS)
async def test_multiplexed_generations(fake_server, door):
    async with await clients(fake_server, door) as c:
        results = await asyncio.gather(*(c.complete(f"q{i:02d}", max_tokens=3 + i % 4)
                                         for i in range(20)))
        chat = await c.complete(messages=[{"role": "user", "content": "yo"}], max_tokens=4)
        n2 = await c.complete("abcd", max_tokens=2, n=2)
    for i, res in enumerate(results):
        want = (f"q{i:02d}" * 3)[:3 + i % 4]
        assert res["text"] == want and res["finish_reason"] == "length"
        assert res["usage"] == {"prompt_tokens": 3, "completion_tokens": len(want),
                                "cached_tokens": 0}
    assert chat["text"] == "<use"
    assert n2["texts"] == ["ab", "bc"] and n2["finish_reasons"] == ["length", "length"]
    assert n2["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("door", DOORS)
async def test_cancel_then_cancelled_after_free(fake_server, door):
    engine = fake_server.engine
    async with await clients(fake_server, door) as c:
        seen = []
        async for m in c.generate("abc", id="x1", max_tokens=250):
            seen.append(m["type"])
            if len(seen) == 2:
                await c.cancel("x1")
        assert seen[-1] == "cancelled" and "done" not in seen
        assert engine.check_accounting()["open"] == 0     # freed before "cancelled" was sent
        bad = [m async for m in c.generate("abc", max_tokens=0)]
        assert bad[-1]["type"] == "error" and bad[-1]["code"] == 400
    await engine.check_idle_clean()


@pytest.mark.parametrize("door", DOORS)
async def test_closing_connection_aborts_its_requests(fake_server, door):
    engine = fake_server.engine
    c = await clients(fake_server, door)
    gens = [c.generate(f"z{i}", max_tokens=250) for i in range(5)]
    for g in gens:
        await g.__anext__()
    assert engine.check_accounting()["open"] == 5
    await c.close()
    await engine.check_idle_clean(5.0)
    assert engine.counters["abort"] == 5


async def test_ws_hostile_frames(fake_server):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(fake_server.ws_url) as ws:
            async def ask(payload, binary=False):
                if binary:
                    await ws.send_bytes(payload)
                    return msgpack.unpackb((await ws.receive()).data)
                await ws.send_str(payload)
                return json.loads((await ws.receive()).data)

            cases = [
                ("{not json", "invalid JSON"),
                ("[1, 2]", "map"),
                ('{"type": "fly"}', "unknown message type"),
                ('{"type": "generate", "prompt": "a"}', "'id'"),
                ('{"type": "generate", "id": "a", "prompt": "x", "params": {"temperature": '
                 'NaN}}', "NaN"),
                ('{"type": "generate", "id": "a", "prompt": "x", "params": {"bogus": 1}}',
                 "unknown sampling field"),
                ('{"type": "generate", "id": "a", "prompt": "x", "params": {"top_p": 7}}',
                 "top_p"),
                ('{"type": "generate", "id": "a", "prompt": 5}', "prompt"),
                ('{"type": "generate", "id": "a", "prompt": "x", "messages": []}',
                 "exactly one"),
                ('{"type": "cancel", "id": "nope"}', "no active request"),
                ("[" * 100000 + "]" * 100000, "invalid JSON"),
            ]
            for payload, needle in cases:
                reply = await ask(payload)
                assert reply["type"] == "error" and needle in reply["message"], (payload, reply)
            ext = msgpack.packb({"type": "generate", "id": 1,
                                 "prompt": msgpack.ExtType(5, b"pickle")})
            reply = await ask(ext, binary=True)
            assert reply["type"] == "error" and "ext type" in reply["message"]
            reply = await ask(b"\xc1", binary=True)
            assert reply["type"] == "error" and "msgpack" in reply["message"]
            reply = await ask(msgpack.packb({1.5: "x"}), binary=True)
            assert reply["type"] == "error"
            # still healthy afterwards
            await ws.send_str(json.dumps({"type": "generate", "id": "ok", "prompt": "hey",
                                          "params": {"max_tokens": 2}}))
            kinds = []
            while not kinds or kinds[-1] != "done":
                kinds.append(json.loads((await ws.receive()).data)["type"])
            assert kinds[-1] == "done"


async def raw_tcp(r):
    reader, writer = await asyncio.open_connection("127.0.0.1", r.tcp_port)

    async def send(obj=None, raw=None):
        body = raw if raw is not None else msgpack.packb(obj)
        writer.write(struct.pack(">I", len(body)) + body)
        await writer.drain()

    async def recv():
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        return msgpack.unpackb(await reader.readexactly(n))

    return reader, writer, send, recv


async def test_tcp_hostile_frames(fake_server):
    reader, writer, send, recv = await raw_tcp(fake_server)
    await send({"type": "generate", "id": 1, "prompt": "x"})
    assert (await recv())["code"] == 401                       # hello first
    await send({"type": "hello", "version": 99})
    assert "version" in (await recv())["message"]
    await send({"type": "hello", "version": 1})
    hello = await recv()
    assert hello["type"] == "hello" and hello["model"] == "fake"
    assert hello["limits"]["max_frame_bytes"] == 1 << 20
    await send(raw=msgpack.packb([1] * 70000))                 # array over the limit
    assert (await recv())["type"] == "error"
    await send(raw=b"\x92\x01")                                 # truncated object
    assert "msgpack" in (await recv())["message"]
    await send(raw=msgpack.packb({"type": "generate", "id": 1, "prompt": b"bytes"}))
    assert (await recv())["type"] == "error"
    await send({"type": "generate", "id": 2, "prompt": [1, 2, 10**6]})
    assert "vocabulary" in (await recv())["message"]
    await send({"type": "generate", "id": True, "prompt": "x"})
    assert "'id'" in (await recv())["message"]
    # an unreadable stream: the server reports and closes
    writer.write(struct.pack(">I", 50 << 20))
    await writer.drain()
    err = await recv()
    assert err["code"] == 413
    assert await reader.read() == b""
    writer.close()


@pytest.mark.parametrize("fake_server", [{"api_key": "k1"}], indirect=True)
async def test_tcp_and_ws_auth(fake_server):
    with pytest.raises(ConnectionError):
        await TCPClient.connect("127.0.0.1", fake_server.tcp_port, api_key="wrong")
    async with await TCPClient.connect("127.0.0.1", fake_server.tcp_port, api_key="k1") as c:
        assert (await c.complete("abc", max_tokens=2))["text"] == "ab"
    with pytest.raises(aiohttp.WSServerHandshakeError):
        await WSClient.connect(fake_server.ws_url)
    async with await WSClient.connect(fake_server.ws_url, api_key="k1") as c:
        assert (await c.complete("abc", max_tokens=2))["text"] == "ab"


async def test_duplicate_id_on_connection(fake_server):
    async with await TCPClient.connect("127.0.0.1", fake_server.tcp_port) as c:
        g = c.generate("abc", id="same", max_tokens=200)
        await g.__anext__()
        await c._send({"type": "generate", "id": "same", "prompt": "abc"})
        msg = await g.__anext__()
        while msg["type"] == "delta":
            msg = await g.__anext__()
        assert msg["type"] == "error" and "already in use" in msg["message"]
        await g.aclose()


@pytest.mark.parametrize("door", ["ws-json", "tcp"])
async def test_engine_death_reaches_every_stream(fake_server, door):
    engine = fake_server.engine
    async with await clients(fake_server, door) as c:
        gens = [c.generate(f"d{i}", max_tokens=250) for i in range(3)]
        for g in gens:
            assert (await g.__anext__())["type"] == "delta"
        engine._core.fail_next_step = RuntimeError("device lost")
        engine._core.wake()
        for g in gens:
            last = [m async for m in g][-1]
            assert last["type"] == "error" and last["code"] == 500
            assert "device lost" in last["message"]
        after = [m async for m in c.generate("x", max_tokens=2)]
        assert after[-1]["type"] == "error" and after[-1]["code"] == 503
    assert engine.check_accounting()["open"] == 0


async def test_bad_chat_messages_on_ws(fake_server):
    async with await WSClient.connect(fake_server.ws_url) as c:
        for messages in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}], "hi"):
            last = [m async for m in c.generate(messages=messages, max_tokens=2)][-1]
            assert last["type"] == "error" and last["code"] == 400, last


@pytest.mark.parametrize("fake_server", [{"served_model_name": "my-model"}], indirect=True)
async def test_hello_reports_the_served_model_name(fake_server):
    # `--served-model-name` is the id every door reports, not only HTTP's /v1/models
    async with await TCPClient.connect("127.0.0.1", fake_server.tcp_port) as c:
        assert c.server_hello["model"] == "my-model"
    async with aiohttp.ClientSession() as s, s.ws_connect(fake_server.ws_url) as ws:
        await ws.send_json({"type": "hello", "version": 1})
        assert (await ws.receive_json())["model"] == "my-model"
        async with s.get(fake_server.base + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "my-model"


@pytest.mark.parametrize("door", DOORS)
async def test_a_closed_generator_keeps_its_id_until_the_cancel_is_confirmed(fake_server, door):
    """Closing a generator early sends a cancel; the id stays reserved (the server still holds
    it) and the request's trailing messages are dropped, not left in `unrouted`."""
    async with await clients(fake_server, door) as c:
        g = c.generate("abc", id="r", max_tokens=250)
        await g.__anext__()
        await g.aclose()
        with pytest.raises(ValueError, match="already in use"):
            await c.generate("abc", id="r", max_tokens=2).__anext__()
        for _ in range(500):
            if "r" not in c._queues:
                break
            await asyncio.sleep(0.01)
        res = await c.complete("abc", id="r", max_tokens=2)
        assert res["text"] == "ab" and c.unrouted.empty()
    await fake_server.engine.check_idle_clean()


@pytest.mark.parametrize("door", ["ws-msgpack", "tcp"])
async def test_msgpack_doors_take_a_full_logit_bias(fake_server, door):
    """The msgpack decoder's map limit is above the engine's logit_bias limit (300 entries):
    the request is judged by the engine's rules, as on the JSON doors."""
    async with await clients(fake_server, door) as c:
        res = await c.complete("abc", max_tokens=2, logit_bias={str(t): 0.0 for t in range(300)})
        assert res["finish_reason"] == "length"
        with pytest.raises(RuntimeError, match="logit_bias"):
            await c.complete("abc", max_tokens=2, logit_bias={str(t): 0.0 for t in range(400)})


@pytest.mark.parametrize("door", DOORS)
async def test_the_client_refuses_what_the_server_could_not_read(fake_server, door):
    """A frame the server would refuse unread gets an error without the request's id, which no
    generator could receive: the client refuses it at once instead of waiting forever."""
    async with await clients(fake_server, door) as c:
        with pytest.raises(ValueError, match="token ids"):
            await c.generate([1] * 70000, max_tokens=2).__anext__()
        with pytest.raises(ValueError, match="bytes"):
            await c.generate("x" * (1 << 20), max_tokens=2).__anext__()
        assert (await c.complete("abc", max_tokens=1))["text"] == "a"


async def test_stopping_the_server_closes_idle_websockets_at_once():
    """An idle WebSocket gets close code 1001 when the server stops, instead of holding the
    shutdown until aiohttp's own timeout (~30 s)."""
    import time

    from fake_core import FakeCore
    from serve_support import start_server

    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model="fake"), core=FakeCore())
    r = await start_server(engine)
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(r.ws_url) as ws:
            t0 = time.monotonic()
            stop = asyncio.create_task(r.server.stop())
            msg = await asyncio.wait_for(ws.receive(), 10)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1001
            await asyncio.wait_for(stop, 10)
            assert time.monotonic() - t0 < 5
    await engine.shutdown()


async def test_tcp_client_pointed_at_the_http_port_says_so(fake_server):
    with pytest.raises(ConnectionError, match="answers in HTTP.*--tcp-port"):
        await TCPClient.connect("127.0.0.1", fake_server.server.port, timeout=10)


async def test_client_connects_time_out_on_a_silent_server():
    """A server that accepts and never answers must not hold `connect` forever."""
    accepted = []
    silent = await asyncio.start_server(lambda reader, writer: accepted.append(writer),
                                        "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        with pytest.raises(TimeoutError, match="no handshake from"):
            await TCPClient.connect("127.0.0.1", port, timeout=0.5)
        with pytest.raises(TimeoutError, match="no WebSocket upgrade"):
            await WSClient.connect(f"ws://127.0.0.1:{port}/v1/ws", timeout=0.5)
    finally:
        for writer in accepted:
            writer.close()
        silent.close()
        await silent.wait_closed()


CONTINUED = [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "hel"}]


@pytest.mark.parametrize("door", DOORS)
async def test_chat_rendering_options_on_ws_and_tcp(fake_server, door):
    """vLLM's add_generation_prompt / continue_final_message / chat_template_kwargs reach the
    chat template from a WS / TCP `generate` as from the HTTP chat route (the fake template
    writes one token per character: the prompt's length tells the rendering)."""
    c = await clients(fake_server, door)
    try:
        plain = await c.complete(messages=CONTINUED, max_tokens=2)
        assert plain["usage"]["prompt_tokens"] == len("<user>yo\n<assistant>hel\n<assistant>")
        cont = await c.complete(messages=CONTINUED, max_tokens=2, add_generation_prompt=False,
                                continue_final_message=True, chat_template_kwargs={"x": 1})
        assert cont["usage"]["prompt_tokens"] == len("<user>yo\n<assistant>hel")
        for kw, match in [
            (dict(prompt="x", structured_outputs={"structural_tag": "r"}),
             "'structured_outputs.structural_tag'"),
            (dict(prompt="x", add_generation_prompt=False), "'add_generation_prompt' needs 'messages'"),
            (dict(messages=CONTINUED, continue_final_message=True), "needs 'add_generation_prompt'"),
            (dict(messages=CONTINUED, add_generation_prompt="no"), "must be a boolean"),
            (dict(messages=[{"role": "user", "content": "a"}], add_generation_prompt=False,
                  continue_final_message=True), "last message from the assistant"),
        ]:
            with pytest.raises(RuntimeError, match=f"400.*{match}"):
                await c.complete(max_tokens=2, **kw)
    finally:
        await c.close()
