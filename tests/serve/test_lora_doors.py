"""LoRA adapters on every door, on the real SmolLM2 (one server for the module, CPU): served
adapters are model names of their own (`/v1/models` lists them with their parent); a request
naming one gives what the engine gives with that adapter (the engine's own output is checked
against transformers in tests/model/test_lora.py); adapters load and unload at run time only
when allowed; unknown names are 404s; the engine ends idle and clean after each test."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest
import pytest_asyncio
from engine_support import REAL_ENGINE_OPTIONS
from serve_support import sdk_client, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from lora_files import ATTN, MLP, write_peft_adapter  # noqa: E402

from ferrobatch.client import TCPClient, WSClient  # noqa: E402
from ferrobatch.engine.async_engine import AsyncEngine  # noqa: E402
from ferrobatch.pooling_params import PoolingParams  # noqa: E402
from ferrobatch.sampling_params import SamplingParams  # noqa: E402
from ferrobatch.serve.lora_api import serve_lora_modules  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The capital of France is"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real(loaded_smollm2, tmp_path_factory):
    paths = {}
    for name, targets, seed, std in (("poet", ("q_proj", "v_proj"), 1, 0.1),
                                     ("coder", ATTN + MLP, 2, 0.03)):
        paths[name] = str(tmp_path_factory.mktemp(name))
        write_peft_adapter(paths[name], loaded_smollm2.config, targets=targets, seed=seed,
                           b_std=std)
    engine = AsyncEngine(loaded_model=loaded_smollm2, enable_lora=True, max_loras=2,
                         **REAL_ENGINE_OPTIONS)
    r = await start_server(engine, served_model_name="smollm2", allow_runtime_lora=True)
    serve_lora_modules(engine, list(paths.items()), ("smollm2",))
    r.paths = paths
    r.spare = str(tmp_path_factory.mktemp("spare"))
    write_peft_adapter(r.spare, loaded_smollm2.config, targets=("o_proj",), seed=3, b_std=0.05)
    yield r
    await stop_server(r)


@pytest_asyncio.fixture(loop_scope="module")
async def sdk(real):
    async with sdk_client(real) as client:
        yield client


async def _engine_text(engine, model: str | None, max_tokens: int = 12) -> str:
    lora = None if model is None else engine.loras.served[model]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind="final")
    last = None
    async for out in engine.generate(PROMPT, params, lora_request=lora):
        last = out
    return last.outputs[0].text


async def test_models_list_adapters_with_their_parent(real, sdk):
    models = (await sdk.models.list()).data
    assert [m.id for m in models] == ["smollm2", "poet", "coder"]
    poet = await sdk.models.retrieve("poet")
    assert poet.model_extra["parent"] == "smollm2" and poet.model_extra["root"] == \
        real.paths["poet"]
    with pytest.raises(openai.NotFoundError):
        await sdk.models.retrieve("nobody")


async def test_completion_and_chat_run_with_the_named_adapter(real, sdk):
    engine = real.engine
    base = await _engine_text(engine, None)
    texts = {}
    for name in ("poet", "coder"):
        c = await sdk.completions.create(model=name, prompt=PROMPT, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
        texts[name] = c.choices[0].text
        assert c.model == name
        assert texts[name] == await _engine_text(engine, name)
    base_http = (await sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12,
                                              temperature=0,
                                              extra_body={"ignore_eos": True})).choices[0].text
    assert base_http == base
    assert base not in texts.values(), "an adapter changed nothing"
    msgs = [{"role": "user", "content": "Name a colour."}]
    full = await sdk.chat.completions.create(model="coder", messages=msgs, max_tokens=10,
                                             temperature=0)
    stream = await sdk.chat.completions.create(model="coder", messages=msgs, max_tokens=10,
                                               temperature=0, stream=True)
    parts = [ch.delta.content or "" async for chunk in stream for ch in chunk.choices]
    assert "".join(parts) == full.choices[0].message.content
    resp = await sdk.responses.create(model="coder", input=msgs, max_output_tokens=10,
                                      temperature=0)
    assert resp.output_text == full.choices[0].message.content


async def test_ws_and_tcp_messages_name_the_adapter(real, sdk):
    want = await _engine_text(real.engine, "poet")
    ws = await WSClient.connect(real.ws_url)
    tcp = await TCPClient.connect("127.0.0.1", real.tcp_port)
    try:
        for client in (ws, tcp):
            got = await client.complete(PROMPT, model="poet", max_tokens=12, temperature=0.0,
                                        ignore_eos=True)
            assert got["text"] == want
            with pytest.raises(RuntimeError, match="404.*does not exist"):
                await client.complete(PROMPT, model="nobody", max_tokens=2)
            lora_vec = np.asarray(await client.embed(PROMPT, model="coder"))
            base_vec = np.asarray(await client.embed(PROMPT))
            assert np.abs(lora_vec - base_vec).max() > 1e-3
    finally:
        await ws.close()
        await tcp.close()


async def test_embeddings_and_beam_search_with_an_adapter(real, sdk):
    engine = real.engine
    emb = await sdk.embeddings.create(model="coder", input=[PROMPT])
    want = await engine.embed(PROMPT, PoolingParams(), lora_request=engine.loras.served["coder"])
    np.testing.assert_allclose(emb.data[0].embedding, want.outputs.embedding, atol=1e-6)
    from ferrobatch.engine.beam_search import BeamSearchParams
    beams = await engine.beam_search(PROMPT, BeamSearchParams(beam_width=2, max_tokens=4),
                                     lora_request=engine.loras.served["poet"])
    c = await sdk.completions.create(model="poet", prompt=PROMPT, max_tokens=4, n=2,
                                     temperature=0, extra_body={"use_beam_search": True})
    assert [ch.text for ch in c.choices] == [s.text for s in beams.sequences]


async def test_adapters_load_and_unload_at_run_time(real, sdk):
    async with aiohttp.ClientSession() as s:
        url = real.base + "/v1/"
        r = await s.post(url + "load_lora_adapter", json={"lora_name": "spare",
                                                          "lora_path": real.spare})
        assert r.status == 200 and "spare" in await r.text()
        assert "spare" in [m.id for m in (await sdk.models.list()).data]
        spare = (await sdk.completions.create(model="spare", prompt=PROMPT, max_tokens=12,
                                              temperature=0,
                                              extra_body={"ignore_eos": True})).choices[0].text
        assert spare == await _engine_text(real.engine, "spare")
        for body, status, text in (
                ({"lora_name": "spare", "lora_path": real.spare}, 400, "already served"),
                ({"lora_name": "smollm2", "lora_path": real.spare}, 400, "already served"),
                ({"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "does not exist"),
                ({"lora_name": "x"}, 400, "lora_path")):
            r = await s.post(url + "load_lora_adapter", json=body)
            assert r.status == status and text in (await r.json())["error"]["message"]
        r = await s.post(url + "unload_lora_adapter", json={"lora_name": "spare"})
        assert r.status == 200
        r = await s.post(url + "unload_lora_adapter", json={"lora_name": "spare"})
        assert r.status == 404
    with pytest.raises(openai.NotFoundError):
        await sdk.completions.create(model="spare", prompt=PROMPT, max_tokens=2)
    real.engine.loras.check()


async def test_runtime_routes_are_off_unless_allowed(loaded_smollm2):
    engine = AsyncEngine(loaded_model=loaded_smollm2, enable_lora=True, **REAL_ENGINE_OPTIONS)
    r = await start_server(engine)
    try:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(r.base + "/v1/load_lora_adapter",
                                json={"lora_name": "a", "lora_path": "/tmp"})
            assert resp.status == 404
            resp = await s.post(r.base + "/update_weights_from_disk",
                                json={"model_path": "/tmp"})
            assert resp.status == 404
            assert (await s.post(r.base + "/pause")).status == 404
    finally:
        await stop_server(r)



async def test_metrics_name_the_adapters(real, sdk):
    await sdk.completions.create(model="poet", prompt=PROMPT, max_tokens=2)
    async with aiohttp.ClientSession() as s:
        text = await (await s.get(real.base + "/metrics")).text()
    line = next(x for x in text.splitlines() if x.startswith("ferrobatch_lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line
    loads = next(x for x in text.splitlines() if x.startswith("ferrobatch_lora_adapter_loads"))
    assert float(loads.split()[-1]) >= 2
    engine = real.engine
    stream = engine.add_request(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True),
                                lora_request=engine.loras.served["coder"])
    assert engine.stats()["lora"]["running"] == ["coder"]
    stream.abort()
