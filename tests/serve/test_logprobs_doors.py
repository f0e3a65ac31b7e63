"""Logprobs on every door (FakeCore): the OpenAI completions and chat shapes, streamed and not,
the WebSocket / TCP `delta` field, validation; and token strings on the real tokenizer."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_core import fake_logprob, fake_prompt_logprob
from test_http_fake import post, sse_events
from test_ws_tcp_fake import DOORS, clients

from ferrobatch.outputs import TokenLogprob
from ferrobatch.serve.logprobs import (
    LOGPROB_FLOOR,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    message_logprobs,
)


async def test_completion_logprobs_legacy_shape(fake_server):
    status, _, text = await post(fake_server, "/v1/completions",
                                 {"prompt": "hello", "max_tokens": 4, "logprobs": 2})
    assert status == 200
    lp = json.loads(text)["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e", "l", "l"]
    assert lp["token_logprobs"] == [fake_logprob(k) for k in range(4)]
    assert lp["text_offset"] == [0, 1, 2, 3]
    # the 2 best (the fake puts the sampled token first, then the next code point)
    assert lp["top_logprobs"][0] == {"h": fake_logprob(0), "i": fake_logprob(0) - 1}
    assert lp["top_logprobs"][2] == {"l": fake_logprob(2), "m": fake_logprob(2) - 1}


@pytest.mark.parametrize("fake_server", [{"return_tokens_as_token_ids": True}], indirect=True)
async def test_the_server_default_shows_tokens_as_ids_unless_a_request_says_no(fake_server):
    body = {"prompt": "hi", "max_tokens": 2, "logprobs": 1}
    _, _, text = await post(fake_server, "/v1/completions", body)
    lp = json.loads(text)["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{ord('h')}", f"token_id:{ord('i')}"]
    _, _, text = await post(fake_server, "/v1/completions",
                            {**body, "return_tokens_as_token_ids": False})
    assert json.loads(text)["choices"][0]["logprobs"]["tokens"] == ["h", "i"]


async def test_completion_logprobs_zero_still_names_the_sampled_token(fake_server):
    _, _, text = await post(fake_server, "/v1/completions",
                            {"prompt": "ab", "max_tokens": 2, "logprobs": 0})
    lp = json.loads(text)["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"a": fake_logprob(0)}, {"b": fake_logprob(1)}]


async def test_completion_stream_logprobs_continue_across_chunks(fake_server):
    chunks = await sse_events(fake_server, "/v1/completions",
                              {"prompt": "abcXYZ", "max_tokens": 6, "logprobs": 1,
                               "stream": True, "n": 2, "stop": ["XYZ"]})
    per_choice: dict[int, dict[str, list]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            got = per_choice.setdefault(c["index"], {"text": [], "tokens": [], "offsets": []})
            got["text"].append(c["text"])
            if c["logprobs"] is not None:
                assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["text_offset"])
                got["tokens"] += c["logprobs"]["tokens"]
                got["offsets"] += c["logprobs"]["text_offset"]
    zero = per_choice[0]
    assert "".join(zero["text"]) == "abc"                  # the stop string is never sent
    assert zero["tokens"] == list("abcXYZ")                # its tokens were generated
    assert zero["offsets"] == list(range(6))
    one = per_choice[1]                                    # starts one token in: "bcXYZa"
    assert "".join(one["text"]) == "bc" and one["tokens"][:5] == list("bcXYZ")
    assert one["offsets"] == list(range(len(one["tokens"])))


async def test_chat_logprobs_shape_streamed_and_not(fake_server):
    body = {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 2}
    _, _, text = await post(fake_server, "/v1/chat/completions", body)
    choice = json.loads(text)["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "<us"
    assert [c["token"] for c in content] == ["<", "u", "s"]
    assert content[0] == {"token": "<", "logprob": fake_logprob(0), "bytes": [60],
                          "top_logprobs": [
                              {"token": "<", "logprob": fake_logprob(0), "bytes": [60]},
                              {"token": "=", "logprob": fake_logprob(0) - 1, "bytes": [61]}]}
    chunks = await sse_events(fake_server, "/v1/chat/completions", {**body, "stream": True})
    streamed = [c for ch in chunks for x in ch["choices"] if x["logprobs"]
                for c in x["logprobs"]["content"]]
    assert streamed == content
    assert chunks[0]["choices"][0]["logprobs"] is None     # the role chunk
    # logprobs without top_logprobs: the sampled token only
    _, _, text = await post(fake_server, "/v1/chat/completions",
                            {**body, "top_logprobs": None})
    assert all(c["top_logprobs"] == [] for c in
               json.loads(text)["choices"][0]["logprobs"]["content"])


async def test_no_logprobs_field_unless_asked(fake_server):
    _, _, text = await post(fake_server, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 2,
                             "logprobs": False})
    assert json.loads(text)["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,extra,match", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "'logprobs' must be an integer"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "needs 'logprobs': true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "2"}, "integer"),
    ("/v1/chat/completions", {"logprobs": 1}, "boolean"),
])
async def test_bad_logprobs_requests_are_400(fake_server, path, extra, match):
    body = {"prompt": "hi"} if "chat" not in path else {
        "messages": [{"role": "user", "content": "hi"}]}
    status, _, text = await post(fake_server, path, {**body, "max_tokens": 2, **extra})
    assert status == 400, text
    assert match in json.loads(text)["error"]["message"]
    assert fake_server.engine.check_accounting()["open"] == 0


@pytest.mark.parametrize("door", DOORS)
async def test_message_doors_carry_logprobs_per_sequence(fake_server, door):
    async with await clients(fake_server, door) as c:
        res, plain = await asyncio.gather(c.complete("abcd", max_tokens=3, n=2, logprobs=1),
                                          c.complete("abcd", max_tokens=3))
        bad = [m async for m in c.generate("abcd", max_tokens=3, logprobs=99)]
    assert "logprobs" not in plain
    for index, text in enumerate(res["texts"]):
        entries = res["logprobs"][index]
        assert [e["token_id"] for e in entries] == [ord(ch) for ch in text]
        assert [e["logprob"] for e in entries] == [fake_logprob(k) for k in range(3)]
        assert all(e["top_logprobs"] == [[e["token_id"], e["logprob"]]] for e in entries)
    assert bad[-1]["type"] == "error" and bad[-1]["code"] == 400


async def test_echo_with_logprobs_scores_the_prompt_like_lm_eval_asks(fake_server):
    """lm-eval's loglikelihood request: echo, logprobs 1, one new token, temperature 0."""
    _, _, text = await post(fake_server, "/v1/completions",
                            {"prompt": "hello", "max_tokens": 2, "echo": True, "logprobs": 1,
                             "temperature": 0})
    c = json.loads(text)["choices"][0]
    assert c["text"] == "hellohe"
    lp = c["logprobs"]
    assert lp["tokens"] == list("hellohe")
    assert lp["token_logprobs"] == [None] + [fake_prompt_logprob(p) for p in range(4)] + [
        fake_logprob(0), fake_logprob(1)]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1:5] == [{ch: fake_prompt_logprob(p)} for p, ch in
                                       enumerate("ello")]
    assert lp["text_offset"] == list(range(7))


async def test_echo_without_logprobs_and_streamed_echo(fake_server):
    _, _, text = await post(fake_server, "/v1/completions",
                            {"prompt": ["ab", "xyz"], "max_tokens": 2, "echo": True, "n": 2})
    choices = json.loads(text)["choices"]
    assert [c["text"] for c in choices] == ["abab", "abba", "xyzxy", "xyzyz"]
    assert all(c["logprobs"] is None for c in choices)
    chunks = await sse_events(fake_server, "/v1/completions",
                              {"prompt": "hello", "max_tokens": 3, "echo": True, "logprobs": 0,
                               "stream": True})
    texts = "".join(x["text"] for ch in chunks for x in ch["choices"])
    tokens = [t for ch in chunks for x in ch["choices"] if x["logprobs"]
              for t in x["logprobs"]["tokens"]]
    offsets = [o for ch in chunks for x in ch["choices"] if x["logprobs"]
               for o in x["logprobs"]["text_offset"]]
    assert texts == "hellohel" and tokens == list("hellohel") and offsets == list(range(8))
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None


@pytest.mark.parametrize("body,match", [
    ({"echo": "yes"}, "'echo' must be a boolean"),
    ({"prompt_logprobs": 1, "stream": True}, "not a stream"),
    ({"prompt_logprobs": 21}, "[0, 20]"),
    ({"prompt_logprobs": True}, "[0, 20]"),
])
async def test_bad_echo_requests_are_400(fake_server, body, match):
    status, _, text = await post(fake_server, "/v1/completions",
                                 {"prompt": "hi", "max_tokens": 2, **body})
    assert status == 400 and match in json.loads(text)["error"]["message"]


async def test_vllms_prompt_logprobs_on_completions_and_chat(fake_server):
    """vLLM's `prompt_logprobs` field: per prompt position null (the first) or the prompt
    token and the k most likely, keyed by token id, with rank and text; per choice on
    completions, on the response on chat."""
    status, _, text = await post(fake_server, "/v1/completions",
                                 {"prompt": "hello", "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200
    got = json.loads(text)["choices"][0]["prompt_logprobs"]
    assert len(got) == 5 and got[0] is None
    want = {str(ord("e")): {"logprob": fake_prompt_logprob(0), "rank": 1, "decoded_token": "e"},
            str(ord("f")): {"logprob": fake_prompt_logprob(0) - 1, "rank": 2,
                            "decoded_token": "f"}}
    assert got[1] == want
    status, _, text = await post(fake_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "yo"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    body = json.loads(text)
    prompt = "<user>yo\n<assistant>"
    assert len(body["prompt_logprobs"]) == len(prompt) and body["prompt_logprobs"][0] is None
    assert body["prompt_logprobs"][1] == {str(ord("u")): {
        "logprob": fake_prompt_logprob(0), "rank": None, "decoded_token": "u"}}
    assert "prompt_logprobs" not in body["choices"][0]


@pytest.mark.parametrize("door", DOORS)
async def test_message_doors_send_prompt_logprobs_in_pieces_before_the_first_delta(
        fake_server, door, monkeypatch):
    """A long prompt's logprobs come in several `prompt_logprobs` messages (each under the frame
    limit), all before the request's first delta; `complete` puts them back together."""
    from ferrobatch.serve import session

    monkeypatch.setattr(session, "PROMPT_LOGPROBS_PER_MESSAGE", 64)
    prompt = "".join(chr(97 + i % 26) for i in range(150))
    async with await clients(fake_server, door) as c:
        msgs = [m async for m in c.generate(prompt, max_tokens=3, prompt_logprobs=1)]
        done = await c.complete(prompt, max_tokens=2, prompt_logprobs=0)
    kinds = [m["type"] for m in msgs]
    pieces = [m for m in msgs if m["type"] == "prompt_logprobs"]
    assert kinds[:3] == ["prompt_logprobs"] * 3 and kinds[3] == "delta"
    assert [p["start"] for p in pieces] == [0, 64, 128]
    entries = [e for p in pieces for e in p["logprobs"]]
    ids = [ord(ch) for ch in prompt]
    assert entries == [None] + [
        {"token_id": t, "logprob": fake_prompt_logprob(p),
         "top_logprobs": [[t, fake_prompt_logprob(p)]]} for p, t in enumerate(ids[1:])]
    assert len(done["prompt_logprobs"]) == 150 and done["prompt_logprobs"][0] is None
    assert done["prompt_logprobs"][1]["top_logprobs"] == []


def test_minus_infinity_becomes_a_json_number():
    e = TokenLogprob(7, float("-inf"), [(7, float("-inf")), (8, float("nan"))])
    strings = TokenStrings(_OneCharTokenizer())
    body = json.dumps([completion_logprobs([e], strings)[0], chat_logprobs([e], strings),
                       message_logprobs([e])], allow_nan=False)
    assert body.count(str(LOGPROB_FLOOR)) == 9      # 3 values in each of the 3 shapes


class _OneCharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i) for i in ids)


def test_token_strings_on_the_shipped_tokenizer(loaded_smollm2):
    """Byte-level BPE: a token holding part of a character shows its bytes escaped and `bytes`
    has them exactly; the tokens of a text, their bytes joined, are the text; a special token
    keeps its text."""
    tok = loaded_smollm2.tokenizer
    strings = TokenStrings(tok)
    text = "héllo 🦀 wörld 日本"
    ids = tok.encode(text)
    joined = b"".join(strings.get(i)[1] for i in ids)
    assert joined.decode("utf-8") == text
    partial = [i for i in ids if not _valid_utf8(strings.get(i)[1])]
    assert partial, "the crab emoji should span several byte-level tokens"
    for i in partial:
        shown, raw = strings.get(i)
        assert "\\x" in shown and shown == raw.decode("utf-8", "backslashreplace")
    eos = tok.eos_token_ids[0]
    assert strings.text(eos) == tok.decode([eos], skip_special_tokens=False) != ""


def _valid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
