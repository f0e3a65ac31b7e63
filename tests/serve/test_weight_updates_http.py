"""`POST /update_weights_from_disk` with `/pause` and `/resume` (serve --allow-weight-updates): a
server started on random weights of SmolLM2's shape is paused (its running stream aborted, a
new request held), given the real SmolLM2's weights over HTTP, resumed, and from then on
answers as the real model does (the engine on the real weights, the oracle here; its own
output is checked against transformers elsewhere); bad bodies and checkpoints are clear
errors that change nothing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
import torch
from engine_support import REAL_ENGINE_OPTIONS
from serve_support import start_server, stop_server

from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The capital of France is"
BODY = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def random_server():
    from ferrobatch.model.loader import load_model
    loaded = load_model("random:smollm2-135m", device="cpu", dtype=torch.float32)
    engine = AsyncEngine(loaded_model=loaded, **REAL_ENGINE_OPTIONS)
    r = await start_server(engine, allow_weight_updates=True)
    yield r
    await stop_server(r)


async def _real_text(loaded_smollm2) -> str:
    async with AsyncEngine(loaded_model=loaded_smollm2, **REAL_ENGINE_OPTIONS) as engine:
        outs = [o async for o in engine.generate(PROMPT, SamplingParams(
            max_tokens=10, temperature=0.0))]
    return outs[-1].outputs[0].text


async def test_random_weights_become_the_real_model(random_server, loaded_smollm2,
                                                    smollm2_gguf_path, tmp_path):
    want = await _real_text(loaded_smollm2)
    async with aiohttp.ClientSession() as s:
        async def complete() -> str:
            async with s.post(random_server.base + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
                return (await resp.json())["choices"][0]["text"]

        async def update(body) -> tuple[int, dict]:
            async with s.post(random_server.base + "/update_weights_from_disk",
                              json=body) as resp:
                return resp.status, await resp.json()

        before = await complete()
        assert before != want
        for body, status, words in [
                ({"model_path": 5}, 400, "non-empty string"),
                ({}, 400, "non-empty string"),
                ({"model_path": str(tmp_path / "none")}, 404, "not found"),
                ({"model_path": __file__}, 400, "expected a .gguf file")]:
            got_status, reply = await update(body)
            assert got_status == status and words in reply["error"]["message"], reply
        assert await complete() == before            # nothing changed

        # an RL loop's round: pause (the running stream is aborted), update, resume; a
        # request sent while paused is held and answered by the new weights
        async def stream_finish() -> str:
            body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
            finish = None
            async with s.post(random_server.base + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                        started.set()
            return finish

        started = asyncio.Event()
        streaming = asyncio.create_task(stream_finish())
        await started.wait()
        async with s.post(random_server.base + "/pause") as resp:
            assert resp.status == 200 and await resp.json() == {"is_paused": True,
                                                                "num_aborted": 1}
        assert await streaming == "abort"
        async with s.get(random_server.base + "/is_paused") as resp:
            assert (await resp.json())["is_paused"] is True
        async with s.get(random_server.base + "/metrics") as resp:
            text = await resp.text()
        assert 'ferrobatch_generation_paused{model_name="smollm2"} 1.0' in text
        held = asyncio.create_task(complete())
        await asyncio.sleep(0.3)
        assert not held.done()
        status, reply = await update({"model_path": smollm2_gguf_path})
        assert status == 200 and reply["success"] is True, reply
        assert reply["num_tensors"] > 200 and reply["weights_version"] == 1
        async with s.post(random_server.base + "/pause?clear_cache=maybe") as resp:
            assert resp.status == 400
        async with s.post(random_server.base + "/resume") as resp:
            assert resp.status == 200 and (await resp.json())["is_paused"] is False
        assert await held == want
        async with s.get(random_server.base + "/metrics") as resp:
            text = await resp.text()
        assert "ferrobatch_weights_version{" in text and \
            'ferrobatch_weights_version{model_name="smollm2"} 1.0' in text
        assert 'ferrobatch_generation_paused{model_name="smollm2"} 0.0' in text
        assert await complete() == want

        # the same round in SGLang's words: /generate, /pause_generation, /continue_generation
        async def generate_finish() -> dict:
            body = {"text": PROMPT, "stream": True, "sampling_params": {
                "max_new_tokens": 500, "ignore_eos": True}}
            last = None
            async with s.post(random_server.base + "/generate", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        last = json.loads(line[6:])
                        started.set()
            return last

        started.clear()
        streaming = asyncio.create_task(generate_finish())
        await started.wait()
        async with s.post(random_server.base + "/pause_generation",
                          json={"mode": "in_place"}) as resp:
            assert resp.status == 400 and "'abort'" in (await resp.json())["error"]["message"]
        async with s.post(random_server.base + "/pause_generation") as resp:
            assert await resp.json() == {"is_paused": True, "num_aborted": 1}
        last = await streaming
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["meta_info"]["weight_version"] == "1"
        async with s.post(random_server.base + "/abort_request",
                          json={"abort_all": True}) as resp:    # allowed with the flag
            assert await resp.json() == {"num_aborted": 0}
        async with s.post(random_server.base + "/continue_generation") as resp:
            assert (await resp.json())["is_paused"] is False
        async with s.post(random_server.base + "/generate", json={
                "text": PROMPT, "sampling_params": {"temperature": 0,
                                                    "max_new_tokens": 10}}) as resp:
            assert (await resp.json())["text"] == want
    await random_server.engine.check_idle_clean(10.0)
