"""Weight updates under churn, on the tiny real-weights model (its own copy: the updates change
it): while many concurrent streams run and half of them are cut at random points, an RL-style
loop pauses generation, swaps in other weights, resumes, and later swaps the originals back,
several times. Nothing is left running, waiting or held (the oracle checks block and request
accounting), no request ends in an error, the step thread survives every round, and once the
original weights are back every prompt gives, in full, what it gave before any update."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import torch
from harness import PROMPTS, chat_stream, truncated_model

STREAMS, TOKENS, ROUNDS = 24, 16, 4


async def test_pause_update_resume_rounds_under_cut_streams(oracle, smollm2_gguf_path):
    from ferrobatch.model.loader import load_model
    tiny = truncated_model(load_model(smollm2_gguf_path, device="cpu", dtype=torch.float32))
    srv = await oracle.serve(tiny, num_blocks=512, max_num_seqs=16,
                             max_num_batched_tokens=256, max_model_len=512)
    engine = srv.engine
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)] + ["model.norm.weight"]
    state = await engine.apply_model(lambda m: {
        "model.norm.weight": m.norm.weight.detach().clone(),
        **{n: m.layers[int(n.split(".")[2])].mlp.down_proj.dense_weight() for n in names[:4]}})
    gen = torch.Generator().manual_seed(3)
    other = {n: t + 0.3 * t.std() * torch.randn(t.shape, generator=gen) for n, t in state.items()}
    rng = random.Random(38)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        solo = {p: await chat_stream(s, srv.base, p, None, max_tokens=TOKENS)
                for p in PROMPTS[:3]}
        cuts = [rng.randint(0, TOKENS // 2) if i % 2 else None for i in range(STREAMS)]
        jobs = [PROMPTS[i % 3] for i in range(STREAMS)]
        delays = [rng.uniform(0.0, 1.0) for _ in range(STREAMS)]

        async def later(i, p):        # arrivals spread over the rounds
            await asyncio.sleep(delays[i])
            return await chat_stream(s, srv.base, p, cuts[i], max_tokens=TOKENS)

        async def rl_loop():
            for r in range(ROUNDS):
                await asyncio.sleep(rng.uniform(0.1, 0.3))
                await engine.pause_generation(wait_for_inflight_requests=bool(r % 2))
                await engine.update_weights(other if r % 2 == 0 else state)
                await engine.resume_generation()

        outs, _ = await asyncio.wait_for(asyncio.gather(
            asyncio.gather(*(later(i, p) for i, p in enumerate(jobs))),
            rl_loop()), 300)
        assert engine.stats()["weights_version"] == ROUNDS and not engine.is_paused
        assert all(o["finish"] in ("length", "abort", "cut") for o in outs), outs
        assert any(o["finish"] == "length" for o in outs)
        # the original weights are back (the last round): every prompt as before any update
        again = {p: await chat_stream(s, srv.base, p, None, max_tokens=TOKENS)
                 for p in PROMPTS[:3]}
    assert again == solo
    await oracle.check()
