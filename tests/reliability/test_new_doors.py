"""The session-34 doors under cuts, on the tiny real-weights model: `/v1/responses` streams cut
at random points by closing the connection leave nothing running or held (the oracle checks
block and request accounting after the test), and the survivors finish in full with the text a
solo run gives; a batch answers every line while half of a concurrent stream load is cut."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
from harness import PROMPTS

from ferrobatch.batch import run_batch

STREAMS, TOKENS = 24, 24


async def responses_stream(s: aiohttp.ClientSession, base: str, prompt: str,
                           cut_after: int | None) -> dict:
    """One streamed /v1/responses call; with `cut_after`, the connection is closed after that
    many text deltas. Returns the text, the terminal event type (or "cut") and its usage."""
    body = {"input": prompt, "max_output_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, deltas, terminal, usage = "", 0, None, None
    async with s.post(base + "/v1/responses", json=body) as r:
        assert r.status == 200
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = json.loads(event.split(b"\n", 1)[1].removeprefix(b"data: "))
                if payload["type"] == "response.output_text.delta":
                    text += payload["delta"]
                    deltas += 1
                elif payload["type"] in ("response.completed", "response.incomplete",
                                         "response.failed"):
                    terminal, usage = payload["type"], payload["response"]["usage"]
                if cut_after is not None and deltas >= cut_after and terminal is None:
                    r.close()
                    return {"text": text, "terminal": "cut", "usage": None}
    return {"text": text, "terminal": terminal, "usage": usage}


async def test_responses_streams_cut_mid_way_leave_nothing_behind(oracle, tiny_model):
    srv = await oracle.serve(tiny_model, num_blocks=512, max_num_seqs=16,
                             max_num_batched_tokens=256, max_model_len=512)
    rng = random.Random(34)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        solo = {p: await responses_stream(s, srv.base, p, None) for p in PROMPTS[:4]}
        cuts = [rng.randint(1, TOKENS // 2) if i % 2 else None for i in range(STREAMS)]
        outs = await asyncio.wait_for(asyncio.gather(*(
            responses_stream(s, srv.base, PROMPTS[i % 4], cuts[i]) for i in range(STREAMS))),
            300)
    for i, out in enumerate(outs):
        if cuts[i] is None:                  # survivors: in full, as the solo run
            want = solo[PROMPTS[i % 4]]
            assert out["terminal"] == "response.incomplete", out      # cut by max tokens
            assert out["text"] == want["text"] and out["usage"]["output_tokens"] == TOKENS
        else:
            assert out["terminal"] == "cut"
    await srv.engine.check_idle_clean(10.0)  # (the oracle checks the accounting after this)


async def test_a_batch_answers_every_line_while_streams_are_cut(oracle, tiny_model):
    srv = await oracle.serve(tiny_model, num_blocks=512, max_num_seqs=16,
                             max_num_batched_tokens=256, max_model_len=512)
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": PROMPTS[i % 8], "max_tokens": 8, "temperature": 0,
                                  "ignore_eos": True}}) for i in range(40)]
    answers: list[dict] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        cut_load = [responses_stream(s, srv.base, PROMPTS[i % 4], 2) for i in range(12)]
        # (run_batch starts a second server on the same engine; stopping it at the end aborts
        # only what still runs, and by then the cut streams are long gone)
        results = await asyncio.wait_for(asyncio.gather(
            run_batch(srv.engine, lines, answers.append, concurrency=16, progress=False),
            *cut_load), 300)
    summary = results[0]
    assert summary.total == summary.succeeded == 40 and len(answers) == 40
    assert sorted(a["custom_id"] for a in answers) == sorted(f"b{i}" for i in range(40))
    assert all(a["response"]["body"]["usage"]["completion_tokens"] == 8 for a in answers)
    assert all(r["terminal"] == "cut" for r in results[1:])
    await srv.engine.check_idle_clean(10.0)
