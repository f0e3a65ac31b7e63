"""SGLang's native routes on the real SmolLM2 (CPU, one server for the module): `/generate`
answers token for token what `/v1/completions` answers for the same request (that route is
checked against transformers elsewhere), with the same logprobs, streamed or whole, one prompt
or a batch; a stop, an abort by id and a client that leaves end as they should, bad requests
are 4xx naming the field, and after every test the engine is idle with every block free."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
from serve_support import start_watched, stop_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The capital of France is"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real(loaded_smollm2):
    r = await start_watched(loaded_smollm2, served_model_name="smollm2")
    yield r
    await stop_server(r)


@pytest_asyncio.fixture(loop_scope="module")
async def http(real):
    async with aiohttp.ClientSession() as session:
        yield session
    await real.engine.check_idle_clean(10.0)


async def _post(http, real, path: str, body) -> tuple[int, object]:
    async with http.post(real.base + path, json=body) as resp:
        return resp.status, json.loads(await resp.text())


async def _generate(http, real, body) -> object:
    status, got = await _post(http, real, "/generate", body)
    assert status == 200, got
    return got


async def _events(http, real, body) -> list[dict]:
    async with http.post(real.base + "/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        raw = (await resp.text()).split("\n\n")
    assert raw[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in raw[:-2]]


async def _completion(http, real, prompt, **fields) -> dict:
    status, got = await _post(http, real, "/v1/completions", {
        "model": "smollm2", "prompt": prompt, "temperature": 0, "return_token_ids": True,
        **fields})
    assert status == 200, got
    return got


async def test_generate_answers_what_completions_answers(http, real):
    got = await _generate(http, real, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8}})
    want = await _completion(http, real, PROMPT, max_tokens=8)
    assert got["text"] == want["choices"][0]["text"]
    assert got["output_ids"] == want["choices"][0]["token_ids"]
    meta = got["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert meta["completion_tokens"] == 8 and meta["weight_version"] == "0"
    assert meta["e2e_latency"] > 0 and len(meta["id"]) == 32
    # token ids in: the same prompt's ids give the same answer
    ids = want["choices"][0]["prompt_token_ids"]
    by_ids = await _generate(http, real, {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8}})
    assert by_ids["output_ids"] == got["output_ids"] and by_ids["text"] == got["text"]


async def test_logprobs_are_the_completions_logprobs(http, real):
    got = await _generate(http, real, {
        "text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0,
        "return_text_in_logprobs": True})
    want = await _completion(http, real, PROMPT, max_tokens=4, logprobs=3, echo=True)
    lp = want["choices"][0]["logprobs"]
    meta = got["meta_info"]
    n_prompt = meta["prompt_tokens"]
    prompt_lp, out_lp = lp["token_logprobs"][:n_prompt], lp["token_logprobs"][n_prompt:]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(out_lp, abs=1e-5)
    assert [e[1] for e in meta["output_token_logprobs"]] == got["output_ids"]
    assert "".join(e[2] for e in meta["output_token_logprobs"]) == got["text"]
    for tops, want_top in zip(meta["output_top_logprobs"], lp["top_logprobs"][n_prompt:]):
        assert len(tops) == 3
        assert {text: value for value, _, text in tops}.items() <= {
            k: pytest.approx(v, abs=1e-5) for k, v in want_top.items()}.items()
    assert meta["input_token_logprobs"][0][0] is None       # nothing predicts the first token
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == pytest.approx(
        prompt_lp[1:], abs=1e-5)
    assert [e[1] for e in meta["input_token_logprobs"]] == want["choices"][0][
        "prompt_token_ids"]
    # from position 2 on, and without texts
    later = await _generate(http, real, {
        "text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True, "logprob_start_len": 2})
    entries = later["meta_info"]["input_token_logprobs"]
    assert len(entries) == n_prompt - 2 and all(e[2] is None for e in entries)
    assert [e[0] for e in entries] == pytest.approx(prompt_lp[2:], abs=1e-5)


async def test_a_stream_grows_to_the_whole_answer(http, real):
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 10},
            "return_logprob": True}
    whole = await _generate(http, real, body)
    events = await _events(http, real, body)
    assert len(events) >= 2
    for before, after in zip(events, events[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    last = events[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert len(last["meta_info"]["output_token_logprobs"]) == 10
    assert "index" not in last


async def test_a_batch_answers_prompt_major_one_item_per_sample(http, real):
    prompts = [PROMPT, "1, 2, 3,"]
    singles = [await _generate(http, real, {"text": p, "sampling_params": {
        "temperature": 0, "max_new_tokens": 5}}) for p in prompts]
    got = await _generate(http, real, {"text": prompts, "rid": ["a", "b"],
                                       "sampling_params": {"temperature": 0,
                                                           "max_new_tokens": 5, "n": 2}})
    assert [g["output_ids"] for g in got] == [s["output_ids"] for s in singles for _ in "jj"]
    assert [g["meta_info"]["id"] for g in got] == ["a", "a", "b", "b"]
    events = await _events(http, real, {"text": prompts, "sampling_params": [
        {"temperature": 0, "max_new_tokens": 5}, {"temperature": 0, "max_new_tokens": 3}]})
    last = {}
    for e in events:
        last[e["index"]] = e
    assert sorted(last) == [0, 1]
    assert last[0]["output_ids"] == singles[0]["output_ids"]
    assert last[1]["output_ids"] == singles[1]["output_ids"][:3]
    # seeded sampling: each sample of n its own, the same again with the same seed
    body = {"text": PROMPT, "sampling_params": {"temperature": 1.0, "max_new_tokens": 6,
                                                "n": 3, "sampling_seed": 7}}
    first, again = await _generate(http, real, body), await _generate(http, real, body)
    assert [g["output_ids"] for g in first] == [g["output_ids"] for g in again]


async def test_stops_end_as_sglang_reports_them(http, real):
    greedy = await _generate(http, real, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8}})
    stop_id = greedy["output_ids"][2]
    by_id = await _generate(http, real, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop_id]}})
    assert by_id["output_ids"] == greedy["output_ids"][:3]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    word = greedy["text"].split()[1]
    by_text = await _generate(http, real, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "stop": [word]}})
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert by_text["text"] == greedy["text"][:greedy["text"].index(word)]
    kept = await _generate(http, real, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "stop": [word], "no_stop_trim": True}})
    assert kept["text"] == by_text["text"] + word
    guided = await _generate(http, real, {"text": "Is the sky blue? Answer:", "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "regex": " (yes|no)"}})
    assert guided["text"] in (" yes", " no")
    assert guided["meta_info"]["finish_reason"]["type"] == "stop"


async def test_abort_request_by_id_ends_the_stream_with_abort(http, real):
    body = {"text": "Tell me a long story.", "rid": "victim", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    events = []
    async with http.post(real.base + "/generate", json=body) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 2:
                assert await _post(http, real, "/abort_request", {"rid": "victim"}) == (
                    200, {"aborted": True})
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 400
    assert await _post(http, real, "/abort_request", {"rid": "victim"}) == (
        200, {"aborted": False})
    status, err = await _post(http, real, "/abort_request", {"abort_all": True})
    assert status == 403 and err["error"]["param"] == "abort_all"   # not without the flag


async def test_a_client_that_leaves_mid_stream_frees_everything(http, real):
    body = {"text": "Tell me a long story.", "stream": True, "rid": "leaver",
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    finishes = real.engine.finishes.seen
    before = len(finishes)
    async with http.post(real.base + "/generate", json=body) as resp:
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: {")
            if seen == 3:
                break                   # leaving the block closes the connection
    await asyncio.wait_for(real.engine.wait_idle(), 30.0)
    reason, generated = finishes[before]
    assert reason == "abort" and generated < 1500    # (the fixture checks every block free)


async def test_bad_requests_are_4xx_and_the_engine_serves_on(http, real):
    vocab = real.engine.vocab_size
    for body, status, param in [
            ({"text": PROMPT, "sampling_params": {"max_tokens": 3}}, 400, "max_tokens"),
            ({"input_ids": [1, vocab]}, 400, None),
            ({"text": PROMPT, "lora_path": "sql"}, 404, "lora_path"),
            ({"text": "x " * 3000}, 400, None),
            ({"text": PROMPT, "sampling_params": {"regex": "("}}, 400, None)]:
        got_status, err = await _post(http, real, "/generate", body)
        assert got_status == status, err
        assert err["error"]["message"]
        if param is not None:
            assert err["error"]["param"] == param
    async with http.post(real.base + "/generate", data=b"{not json") as resp:
        assert resp.status == 400
    got = await _generate(http, real, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 2}})
    assert got["meta_info"]["completion_tokens"] == 2


async def test_model_and_server_info_flush_cache_and_health_generate(http, real):
    async with http.get(real.base + "/get_model_info") as resp:
        info = await resp.json()
    assert info["is_generation"] is True and info["served_model_name"] == "smollm2"
    assert info["max_model_len"] == real.engine.max_model_len
    async with http.get(real.base + "/get_server_info") as resp:
        server = await resp.json()
    assert server["block_size"] == 16 and server["max_num_seqs"] == 64
    assert server["internal_states"][0]["weights_version"] == 0
    await _generate(http, real, {"text": PROMPT * 8, "sampling_params": {"max_new_tokens": 1}})
    status, flushed = await _post(http, real, "/flush_cache", {})
    assert status == 200 and flushed["success"] and flushed["num_blocks_dropped"] > 0
    async with http.get(real.base + "/flush_cache") as resp:
        assert (await resp.json())["num_blocks_dropped"] == 0
    async with http.get(real.base + "/health_generate") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "ready"
