"""The model's sampling defaults on every door, on the real SmolLM2 (one server for the module,
CPU) started with a generation_config.json of greedy top-k 1, a six-token cap and a repetition
penalty: requests that leave those fields unset take them, requests that set them keep theirs,
the cap applies to requests that fill the context (chat, responses), completions and WS / TCP
keep their 16-token default, and beam search is not refused for the model's penalty."""

from __future__ import annotations

import json

import aiohttp
import pytest
import pytest_asyncio
from engine_support import REAL_ENGINE_OPTIONS
from serve_support import sdk_client, start_server, stop_server

from ferrobatch.client import TCPClient, WSClient
from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The capital of France is"
MODEL_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 6, "repetition_penalty": 1.3}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real(loaded_smollm2, tmp_path_factory):
    d = tmp_path_factory.mktemp("genconfig")
    (d / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    engine = AsyncEngine(loaded_model=loaded_smollm2, generation_config=str(d),
                         override_generation_config={"top_k": 1}, **REAL_ENGINE_OPTIONS)
    r = await start_server(engine, served_model_name="smollm2")
    yield r
    await stop_server(r)


async def _text(engine, params, **kw) -> str:
    outs = [o async for o in engine.generate(PROMPT if not kw else None,
                                              params.replace(output_kind="final"), **kw)]
    return outs[-1].outputs[0].text


async def test_the_engine_reports_and_applies_them(real):
    engine = real.engine
    assert engine.default_sampling_fields == {"temperature": 0.0, "max_tokens": 6,
                                              "repetition_penalty": 1.3, "top_k": 1}
    p = engine.default_sampling_params()
    assert (p.temperature, p.max_tokens, p.repetition_penalty, p.top_k) == (0.0, 16, 1.3, 1)
    outs = [o async for o in engine.generate(PROMPT)]          # no params: SamplingParams' 16
    assert len(outs[-1].outputs[0].token_ids) == 16
    # fill the context: capped (the request's own temperature 1.0 samples, so EOS is ignored:
    # an early EOS would end it before the cap)
    fill = SamplingParams(max_tokens=None, ignore_eos=True, output_kind="final")
    outs = [o async for o in engine.generate(PROMPT, fill)]
    assert len(outs[-1].outputs[0].token_ids) == 6


async def test_http_requests_take_what_they_leave_unset(real):
    engine = real.engine
    penalised = await _text(engine, SamplingParams(max_tokens=6, temperature=0.0,
                                                   repetition_penalty=1.3))
    plain = await _text(engine, SamplingParams(max_tokens=6, temperature=0.0))
    async with sdk_client(real) as sdk:
        chat = await sdk.chat.completions.create(model="smollm2", messages=MESSAGES)
        assert chat.usage.completion_tokens == 6                 # the model's cap, not "fill"
        cmpl = await sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6)
        assert cmpl.choices[0].text == penalised                 # greedy, with the penalty
        own = await sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6,
                                           extra_body={"repetition_penalty": 1.0})
        assert own.choices[0].text == plain                      # the request's own value
        long = await sdk.completions.create(model="smollm2", prompt=PROMPT,
                                            extra_body={"ignore_eos": True})
        assert long.usage.completion_tokens == 16                # completions keep their 16
        resp = await sdk.responses.create(model="smollm2", input="Name three colours.")
        assert resp.usage.output_tokens == 6
    async with aiohttp.ClientSession() as s:       # SGLang's /generate: the same defaults
        async with s.post(real.base + "/generate", json={
                "text": PROMPT, "sampling_params": {"max_new_tokens": 6}}) as resp:
            assert (await resp.json())["text"] == penalised
        async with s.post(real.base + "/generate", json={
                "text": PROMPT, "sampling_params": {"max_new_tokens": 6,
                                                    "repetition_penalty": 1.0}}) as resp:
            assert (await resp.json())["text"] == plain
    assert penalised != plain       # the check is only meaningful if the penalty matters


async def test_beam_search_is_not_refused_for_the_models_penalty(real):
    async with aiohttp.ClientSession() as s:
        async with s.post(real.base + "/v1/completions", json={
                "model": "smollm2", "prompt": PROMPT, "max_tokens": 3, "n": 2,
                "use_beam_search": True}) as resp:
            assert resp.status == 200, await resp.text()
        async with s.post(real.base + "/v1/completions", json={
                "model": "smollm2", "prompt": PROMPT, "max_tokens": 3, "n": 2,
                "use_beam_search": True, "repetition_penalty": 1.1}) as resp:
            assert resp.status == 400                            # the request's own: refused
    await real.engine.check_idle_clean(10.0)


async def test_ws_and_tcp_generate_takes_them(real):
    want = await _text(real.engine, SamplingParams(max_tokens=16, temperature=0.0,
                                                   repetition_penalty=1.3))
    ws = await WSClient.connect(real.ws_url)
    tcp = await TCPClient.connect("127.0.0.1", real.tcp_port)
    try:
        for client in (ws, tcp):
            got = await client.complete(PROMPT)
            assert got["text"] == want
    finally:
        await ws.close()
        await tcp.close()
    await real.engine.check_idle_clean(10.0)
