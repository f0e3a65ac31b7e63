"""Reasoning parsers: the splitter against its whole-text form on every way of cutting a reply
into pieces, both parsers' rules, and `reasoning_content` on the chat route (FakeCore)."""

from __future__ import annotations

import json
import random

import aiohttp
import pytest

from ferrobatch.serve.reasoning import ReasoningSplitter, split_reasoning

CASES = {
    # (parser, reply): (reasoning, content)
    ("deepseek_r1", "Let me think.</think>\n\nThe answer is 4."): ("Let me think.",
                                                                 "The answer is 4."),
    ("deepseek_r1", "<think>\nhm</think>4"): ("\nhm", "4"),
    ("deepseek_r1", "cut off before the end"): ("cut off before the end", ""),
    ("deepseek_r1", "</think>only an answer"): ("", "only an answer"),
    ("deepseek_r1", "a < b and </thin is not a tag</think> ok"): ("a < b and </thin is not a tag",
                                                                 "ok"),
    ("qwen3", "<think>\nfirst, 2 + 2\n</think>\n\n4"): ("\nfirst, 2 + 2\n", "4"),
    ("qwen3", "  <think>x</think>y"): ("x", "y"),
    ("qwen3", "No thinking here </think> at all"): (None, "No thinking here </think> at all"),
    ("qwen3", "<thin"): (None, "<thin"),
    ("qwen3", "<think>never closed"): ("never closed", ""),
    ("qwen3", ""): (None, ""),
}


@pytest.mark.parametrize("parser, reply", sorted(CASES))
def test_whole_replies_split_by_each_parsers_rules(parser, reply):
    assert split_reasoning(parser, reply) == CASES[parser, reply]


@pytest.mark.parametrize("parser, reply", sorted(CASES))
def test_any_cut_into_pieces_gives_the_whole_replys_split(parser, reply):
    """Pieces of every size (1 character up): the joined pieces equal the whole-text split,
    and nothing of a tag ever leaves as text."""
    rng = random.Random(hash((parser, reply)) & 0xFFFF)
    want_reasoning, want_content = CASES[parser, reply]
    for _ in range(40):
        splitter, reasoning, content, at = ReasoningSplitter(parser), [], [], 0
        while at < len(reply):
            step = rng.randint(1, 4)
            r, c = splitter.feed(reply[at:at + step])
            reasoning.append(r)
            content.append(c)
            at += step
        r, c = splitter.finish()
        assert "".join(reasoning) + r == (want_reasoning or "")
        assert "".join(content) + c == want_content
        assert all("<think>" not in p and "</think>" not in p for p in reasoning)


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningSplitter("r2d2")


REPLY = "<user>ponder</think>\n\nanswer"     # FakeCore echoes the rendered chat prompt
BODY = {"messages": [{"role": "user", "content": "ponder</think>\n\nanswer"}],
        "max_tokens": len(REPLY)}


@pytest.mark.parametrize("fake_server", [{"reasoning_parser": "deepseek_r1"}], indirect=True)
async def test_chat_serves_reasoning_content_whole_and_streamed(fake_server):
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/chat/completions", json=BODY) as resp:
            message = (await resp.json())["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "answer",
                           "reasoning_content": "<user>ponder"}
        async with s.post(fake_server.base + "/v1/chat/completions",
                          json={**BODY, "stream": True}) as resp:
            chunks = [json.loads(line[6:]) for line in (await resp.text()).split("\n\n")
                      if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "<user>ponder"
        assert "".join(d.get("content") or "" for d in deltas) == "answer"
        first = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert all("reasoning_content" not in d for d in deltas[first:])
        # completions are left alone
        async with s.post(fake_server.base + "/v1/completions", json={
                "prompt": "a</think>b", "max_tokens": 10}) as resp:
            assert (await resp.json())["choices"][0]["text"] == "a</think>b"


@pytest.mark.parametrize("fake_server", [{"reasoning_parser": "deepseek_r1"}], indirect=True)
async def test_a_guided_reply_is_split_too(fake_server):
    """A guided reply reasons first (its grammar applies after `</think>`: engine side in
    tests/guided/test_after_reasoning.py), so the route splits it like any other; the engine is
    told which parser (`add_request(reasoning_parser=...)`)."""
    seen = []
    add_request = fake_server.engine.add_request

    def spy(*args, **kw):
        seen.append(kw.get("reasoning_parser"))
        return add_request(*args, **kw)
    async def no_grammar(*args, **kw):      # FakeCore compiles no grammar (nor applies one)
        return None
    fake_server.engine.add_request = spy
    fake_server.engine.prepare = no_grammar
    body = {"messages": [{"role": "user", "content": "ponder</think>\n\n{}"}],
            "max_tokens": len("<user>ponder</think>\n\n{}"),
            "response_format": {"type": "json_object"}}
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/chat/completions", json=body) as resp:
            message = (await resp.json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "{}", "reasoning_content": "<user>ponder"}
    assert seen == ["deepseek_r1"]


@pytest.mark.parametrize("fake_server", [{}], indirect=True)
async def test_without_a_parser_the_reply_is_all_content(fake_server):
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/chat/completions", json=BODY) as resp:
            message = (await resp.json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": REPLY}


async def _responses_events(r, body) -> list[dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + "/v1/responses", json={**body, "stream": True}) as resp:
            raw = (await resp.read()).decode()
    return [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in raw.split("\n\n") if b]


@pytest.mark.parametrize("fake_server", [{"reasoning_parser": "deepseek_r1"}], indirect=True)
async def test_responses_carry_a_reasoning_item_before_the_message(fake_server):
    """`/v1/responses` with a reasoning parser: output 0 is the `reasoning` item, output 1 the
    message, whole and streamed; every object and event validates against the SDK's types, and
    the streamed final response equals the whole one."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"input": "ponder</think>\n\nanswer", "max_output_tokens": len(REPLY)}
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/responses", json=body) as resp:
            whole = await resp.json()
    typed = Response.model_validate(whole)
    assert [o.type for o in typed.output] == ["reasoning", "message"]
    assert typed.output[0].content[0].text == "<user>ponder"
    assert typed.output_text == "answer"
    datas = await _responses_events(fake_server, body)
    adapter = TypeAdapter(ResponseStreamEvent)
    assert [adapter.validate_python(d).sequence_number for d in datas] == \
        list(range(len(datas)))
    kinds = [(d["type"], d.get("output_index")) for d in datas]
    first_message = kinds.index(("response.output_item.added", 1))
    assert kinds[2] == ("response.output_item.added", 0)
    assert kinds[first_message - 1] == ("response.output_item.done", 0)
    assert "".join(d["delta"] for d in datas if d["type"] == "response.reasoning_text.delta") \
        == "<user>ponder"
    assert "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta") \
        == "answer"
    final = datas[-1]["response"]
    assert final["status"] == whole["status"] == "incomplete"     # cut by max_output_tokens
    for a, b in zip(final["output"], whole["output"]):
        assert {**a, "id": None} == {**b, "id": None}


@pytest.mark.parametrize("fake_server", [{"reasoning_parser": "qwen3"}], indirect=True)
async def test_a_reply_without_reasoning_has_no_reasoning_item(fake_server):
    body = {"input": "just an answer", "max_output_tokens": 8}
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/responses", json=body) as resp:
            whole = await resp.json()
    assert [o["type"] for o in whole["output"]] == ["message"]
    datas = await _responses_events(fake_server, body)
    assert not any("reasoning" in d["type"] for d in datas)
    assert {d.get("output_index") for d in datas if "output_index" in d} == {0}


@pytest.mark.parametrize("parser, tokens, want", [
    ("deepseek_r1", ["Let", " me", " think", "</think>", "\n\n", "4"], 4),
    ("deepseek_r1", ["hm", "</thi", "nk>", "4"], 3),              # the tag in pieces
    ("deepseek_r1", ["never", " closed"], 2),                     # cut before the end: all
    ("qwen3", ["<think>", "x", "</think>", "y"], 3),
    ("qwen3", ["No", " thinking"], 0),
    ("qwen3", [], 0),
])
def test_reasoning_tokens_are_counted_up_to_the_closing_tag(parser, tokens, want):
    from ferrobatch.serve.reasoning import count_reasoning_tokens
    assert count_reasoning_tokens(parser, tokens) == want


@pytest.mark.parametrize("fake_server", [{"reasoning_parser": "deepseek_r1"}], indirect=True)
async def test_usage_counts_the_reasoning_tokens(fake_server):
    """FakeCore writes one character per token: the reply's reasoning is `<user>ponder` and its
    `</think>`, 20 tokens, in chat's `completion_tokens_details` (whole and in the streamed
    usage chunk) and in the Responses API's `output_tokens_details`."""
    want = len("<user>ponder</think>")
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/chat/completions", json=BODY) as resp:
            whole = (await resp.json())["usage"]
        async with s.post(fake_server.base + "/v1/chat/completions", json={
                **BODY, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            chunks = [json.loads(line[6:]) for line in (await resp.text()).split("\n\n")
                      if line.startswith("data: {")]
        async with s.post(fake_server.base + "/v1/responses", json={
                "input": "ponder</think>\n\nanswer", "max_output_tokens": len(REPLY)}) as resp:
            responses = (await resp.json())["usage"]
    assert whole["completion_tokens_details"] == {"reasoning_tokens": want}
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
    assert responses["output_tokens_details"] == {"reasoning_tokens": want}
    for event in await _responses_events(fake_server, {"input": "ponder</think>\n\nanswer",
                                                       "max_output_tokens": len(REPLY)}):
        if event["type"] == "response.incomplete":
            assert event["response"]["usage"]["output_tokens_details"] == \
                {"reasoning_tokens": want}


@pytest.mark.parametrize("fake_server", [{}], indirect=True)
async def test_without_a_parser_usage_has_no_reasoning_details(fake_server):
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/chat/completions", json=BODY) as resp:
            assert "completion_tokens_details" not in (await resp.json())["usage"]


@pytest.mark.parametrize("fake_server", [{"reasoning_parser": "deepseek_r1"}], indirect=True)
async def test_anthropic_messages_carry_a_thinking_block_before_the_text(fake_server):
    """`/v1/messages` with a reasoning parser: a `thinking` block, then the text, whole and
    streamed (the `anthropic` SDK's own accumulation of the events gives the same message)."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.AsyncAnthropic(base_url=fake_server.base, api_key="unused",
                                      max_retries=0)
    ask = dict(model="fake", max_tokens=len(REPLY),
               messages=[{"role": "user", "content": "ponder</think>\n\nanswer"}])
    try:
        whole = await client.messages.create(**ask)
        async with client.messages.stream(**ask) as stream:
            kinds = [(e.type, getattr(e, "index", None)) async for e in stream]
            streamed = await stream.get_final_message()
    finally:
        await client.close()
    for message in (whole, streamed):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "<user>ponder"
        assert message.content[1].text == "answer"
        assert message.stop_reason == "max_tokens"
    assert ("content_block_start", 0) in kinds and ("content_block_start", 1) in kinds
    assert kinds.index(("content_block_stop", 0)) < kinds.index(("content_block_start", 1))
