"""LoRA under churn, on the tiny real-weights model: three served adapters and the base model
share two slots while half of many concurrent streams are cut at random points (some while
their request still waits for a slot). Nothing is left running, waiting or held (the oracle
checks block and request accounting; the registry its slots and references), and every
survivor gives, in full, the text its adapter gives alone."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import aiohttp
from harness import PROMPTS, chat_stream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from lora_files import ATTN, MLP, write_peft_adapter  # noqa: E402

from ferrobatch.serve.lora_api import serve_lora_modules  # noqa: E402

STREAMS, TOKENS = 32, 16
MODELS = ["base", "a", "b", "c"]


async def test_cut_streams_across_adapters_leave_nothing_behind(oracle, tiny_model, tmp_path):
    srv = await oracle.serve(tiny_model, num_blocks=512, max_num_seqs=16,
                             max_num_batched_tokens=256, max_model_len=512, enable_lora=True,
                             max_loras=2)
    adapters = []
    for k, name in enumerate(MODELS[1:]):
        path = str(tmp_path / name)
        write_peft_adapter(path, tiny_model.config, targets=ATTN + MLP, seed=k + 1, b_std=0.05)
        adapters.append((name, path))
    serve_lora_modules(srv.engine, adapters)
    registry = srv.engine.loras
    rng = random.Random(36)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        solo = {(m, p): await chat_stream(s, srv.base, p, None, model=m, max_tokens=TOKENS)
                for m in MODELS for p in PROMPTS[:2]}
        assert len({solo[m, PROMPTS[0]]["text"] for m in MODELS}) > 1, "adapters changed nothing"
        cuts = [rng.randint(0, TOKENS // 2) if i % 2 else None for i in range(STREAMS)]
        jobs = [(MODELS[i % 4], PROMPTS[(i // 4) % 2]) for i in range(STREAMS)]
        most_waiting = 0

        async def watch():
            nonlocal most_waiting
            while True:
                most_waiting = max(most_waiting,
                                   srv.engine.stats()["num_lora_waiting_requests"])
                await asyncio.sleep(0.002)
        watcher = asyncio.ensure_future(watch())
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(
                chat_stream(s, srv.base, p, cuts[i], model=m, max_tokens=TOKENS)
                for i, (m, p) in enumerate(jobs))),
                300)
        finally:
            watcher.cancel()
    assert most_waiting > 0, "no request ever waited for a slot: the test lost its point"
    for i, out in enumerate(outs):
        if cuts[i] is None:                  # survivors: in full, as alone
            assert out == solo[jobs[i]], (jobs[i], out)
    await oracle.check()
    registry.check()
    assert registry.num_refs == 0 and srv.engine.stats()["num_lora_waiting_requests"] == 0
    assert registry.loads > len(MODELS) - 1        # two slots for three adapters: reloads
