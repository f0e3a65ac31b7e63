"""The session-34 doors under cuts, on the tiny real-weights model: `/v1/responses` streams cut
at random points by closing the connection leave nothing running or held (the oracle checks
block and request accounting after the test), and the survivors finish in full with the text a
solo run gives; a batch answers every line while half of a concurrent stream load is cut; and
the same cuts on session 39's doors (Anthropic's /v1/messages, Ollama's /api/chat, SGLang's
/generate) streaming at once."""

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


# -- session 39's doors: Anthropic's /v1/messages, Ollama's /api/chat, SGLang's /generate ------

def _anthropic(prompt: str, model: str) -> tuple[str, dict]:
    return "/v1/messages", {"model": model, "max_tokens": TOKENS, "temperature": 0,
                            "ignore_eos": True, "stream": True,
                            "messages": [{"role": "user", "content": prompt}]}


def _ollama(prompt: str, model: str) -> tuple[str, dict]:
    return "/api/chat", {"model": model, "messages": [{"role": "user", "content": prompt}],
                         "options": {"temperature": 0, "num_predict": TOKENS}}


def _sglang(prompt: str, model: str) -> tuple[str, dict]:
    return "/generate", {"text": prompt, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": TOKENS, "ignore_eos": True}}


def _pieces(door: str, raw: bytes) -> tuple[list[str], int | None]:
    """A door's stream so far as (its text pieces, the tokens its end reports or None)."""
    text, done = [], None
    if door == "ollama":
        for line in raw.split(b"\n"):
            if line.strip():
                obj = json.loads(line)
                text.append(obj["message"]["content"])
                done = obj.get("eval_count") if obj["done"] else done
        return text, done
    for event in raw.split(b"\n\n"):
        data = next((x[6:] for x in event.split(b"\n") if x.startswith(b"data: {")), None)
        if data is None:
            continue
        obj = json.loads(data)
        if door == "anthropic":
            if obj["type"] == "content_block_delta":
                text.append(obj["delta"]["text"])
            elif obj["type"] == "message_delta":
                done = obj["usage"]["output_tokens"]
        else:                                  # SGLang: the text so far in every event
            text.append(obj["text"][len("".join(text)):])
            if obj["meta_info"]["finish_reason"] is not None:
                done = obj["meta_info"]["completion_tokens"]
    return text, done


DOORS = {"anthropic": _anthropic, "ollama": _ollama, "sglang": _sglang}


async def door_stream(s: aiohttp.ClientSession, base: str, door: str, prompt: str, model: str,
                      cut_after: int | None) -> dict:
    """One streamed request on `door`; with `cut_after`, the connection is closed once that
    many text pieces came. Returns the text and the tokens its end reports ("cut": none)."""
    path, body = DOORS[door](prompt, model)
    raw = b""
    async with s.post(base + path, json=body) as r:
        assert r.status == 200, await r.text()
        async for data in r.content.iter_any():
            raw += data
            pieces, done = _pieces(door, raw)
            if cut_after is not None and len(pieces) >= cut_after and done is None:
                r.close()
                return {"text": "".join(pieces), "tokens": "cut"}
    pieces, done = _pieces(door, raw)
    return {"text": "".join(pieces), "tokens": done}


async def test_anthropic_ollama_and_sglang_streams_cut_mid_way_leave_nothing_behind(
        oracle, tiny_model):
    """Streams on the three doors at once, every other one cut at a random point: nothing is
    left running or held (the oracle checks the block and request accounting after the test),
    and the survivors finish in full with the text a solo run on their door gives."""
    srv = await oracle.serve(tiny_model, num_blocks=512, max_num_seqs=16,
                             max_num_batched_tokens=256, max_model_len=512)
    model = srv.engine.model_name
    rng = random.Random(39)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        solo = {(d, p): await door_stream(s, srv.base, d, p, model, None)
                for d in DOORS for p in PROMPTS[:2]}
        plan = [(door, PROMPTS[i % 2], rng.randint(1, TOKENS // 2) if i % 2 else None)
                for i in range(STREAMS) for door in [list(DOORS)[i % 3]]]
        outs = await asyncio.wait_for(asyncio.gather(*(
            door_stream(s, srv.base, door, prompt, model, cut) for door, prompt, cut in plan)),
            300)
    for (door, prompt, cut), out in zip(plan, outs):
        if cut is None:
            assert out == solo[door, prompt] and out["tokens"] == TOKENS, (door, out)
        else:
            assert out["tokens"] == "cut", (door, out)
    await srv.engine.check_idle_clean(10.0)
