"""Engine-wide logits processors on every door, on the real SmolLM2 (one server for the module,
CPU): a factory given to the engine acts on the requests whose `vllm_xargs` / `extra_args` ask
for it, and gives what the same ban written as `logit_bias` gives; requests that do not ask run
as before; bad arguments are 400s that name what is wrong."""

from __future__ import annotations

import aiohttp
import openai
import pytest
import pytest_asyncio
import torch
from engine_support import REAL_ENGINE_OPTIONS
from serve_support import sdk_client, start_server, stop_server

from ferrobatch.client import TCPClient, WSClient
from ferrobatch.engine.async_engine import AsyncEngine
from ferrobatch.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The capital of France is"
MAX_TOKENS = 8


def ban_tokens_factory(params):
    """Bans the token ids in ``extra_args["ban_token_ids"]``; None for requests without it."""
    ban = (params.extra_args or {}).get("ban_token_ids")
    if ban is None:
        return None
    if not isinstance(ban, list) or not all(isinstance(t, int) and t >= 0 for t in ban):
        raise ValueError("ban_token_ids must be a list of token ids")
    index = torch.tensor(ban, dtype=torch.int64)

    def ban_tokens(history, row):
        row[index] = float("-inf")
        return row
    return ban_tokens


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real(loaded_smollm2):
    engine = AsyncEngine(loaded_model=loaded_smollm2, logits_processors=[ban_tokens_factory],
                         **REAL_ENGINE_OPTIONS)
    r = await start_server(engine, served_model_name="smollm2")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            output_kind="final")
    r.plain = await _tokens(engine, params)
    r.ban = r.plain[:2]                       # the plain output's first two tokens
    r.banned = await _tokens(engine, params.replace(logit_bias={t: -100.0 for t in r.ban}))
    assert r.banned != r.plain and not set(r.ban) & set(r.banned)
    yield r
    await stop_server(r)


async def _tokens(engine, params) -> list[int]:
    outs = [o async for o in engine.generate(PROMPT, params)]
    return outs[-1].outputs[0].token_ids


async def test_http_vllm_xargs_reach_the_factory(real):
    tok = real.engine.tokenizer
    async with sdk_client(real) as sdk:
        banned = await sdk.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True, "vllm_xargs": {"ban_token_ids": real.ban}})
        plain = await sdk.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True})
        assert banned.choices[0].text == tok.decode(real.banned)
        assert plain.choices[0].text == tok.decode(real.plain)
        messages = [{"role": "user", "content": "Say hello."}]
        plain_chat = await sdk.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=6, temperature=0.0, logprobs=True)
        first = tok.encode(plain_chat.choices[0].logprobs.content[0].token)[:1]
        by_bias = await sdk.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=6, temperature=0.0,
            logit_bias={str(first[0]): -100})
        by_fn = await sdk.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=6, temperature=0.0,
            extra_body={"vllm_xargs": {"ban_token_ids": first}})
        assert by_fn.choices[0].message.content == by_bias.choices[0].message.content \
            != plain_chat.choices[0].message.content
        kw = dict(model="smollm2", input="Say hello.", max_output_tokens=6, temperature=0.0)
        plain_resp = await sdk.responses.create(**kw)
        first = tok.encode(plain_resp.output_text)[:1]
        resp_bias = await sdk.responses.create(**kw, extra_body={
            "logit_bias": {str(first[0]): -100}})
        resp_fn = await sdk.responses.create(**kw, extra_body={
            "vllm_xargs": {"ban_token_ids": first}})
        assert resp_fn.output_text == resp_bias.output_text != plain_resp.output_text


@pytest.mark.parametrize("body, message", [
    ({"vllm_xargs": {"ban_token_ids": "x"}}, "ban_tokens_factory refused the request: "
                                             "ValueError: ban_token_ids must be a list"),
    ({"vllm_xargs": {"ban_token_ids": [{"a": 1}]}}, "'extra_args.ban_token_ids' must be"),
    ({"vllm_xargs": [1]}, "'extra_args' must be an object"),
    ({"vllm_xargs": {}, "extra_args": {}}, "not both"),
])
async def test_bad_arguments_are_400s(real, body, message):
    async with aiohttp.ClientSession() as session:
        async with session.post(real.base + "/v1/completions", json={
                "model": "smollm2", "prompt": PROMPT, "max_tokens": 2, **body}) as resp:
            text = await resp.text()
            assert resp.status == 400, text
            assert message in text
    await real.engine.check_idle_clean(10.0)


async def test_ws_and_tcp_extra_args_reach_the_factory(real):
    tok = real.engine.tokenizer
    ws = await WSClient.connect(real.ws_url)
    tcp = await TCPClient.connect("127.0.0.1", real.tcp_port)
    try:
        for client in (ws, tcp):
            for key in ("extra_args", "vllm_xargs"):
                got = await client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                            ignore_eos=True, **{key: {"ban_token_ids": real.ban}})
                assert got["text"] == tok.decode(real.banned)
            with pytest.raises(RuntimeError, match="ban_token_ids must be a list"):
                await client.complete(PROMPT, max_tokens=2, extra_args={"ban_token_ids": 1})
    finally:
        await ws.close()
        await tcp.close()
    await real.engine.check_idle_clean(10.0)


async def test_the_openai_sdk_sees_a_refusal_as_a_bad_request(real):
    async with sdk_client(real) as sdk:
        with pytest.raises(openai.BadRequestError, match="ban_token_ids must be a list"):
            await sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2,
                                         extra_body={"vllm_xargs": {"ban_token_ids": 5}})
