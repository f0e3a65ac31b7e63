"""/tokenizer_info, /tokenize and /detokenize on FakeCore (one character per token): vLLM's
shapes, chat messages, and 400s for bad input; the API key guards them like every route."""

from __future__ import annotations

import json

import pytest
from fake_core import EOS
from test_http_fake import post


async def get_json(r, path, headers=None):
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(r.base + path, headers=headers) as resp:
            return resp.status, await resp.json()


async def test_tokenize_and_detokenize_round_trip(fake_server):
    status, _, text = await post(fake_server, "/tokenize", {"prompt": "héllo",
                                                             "add_special_tokens": False})
    assert status == 200
    body = json.loads(text)
    assert body == {"tokens": [104, 233, 108, 108, 111], "count": 5, "max_model_len": 256}
    status, _, text = await post(fake_server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and json.loads(text) == {"prompt": "héllo"}


async def test_detokenize_keeps_special_tokens(fake_server):
    """As transformers' decode and vLLM: /tokenize's template ids come back as their text."""
    status, _, text = await post(fake_server, "/detokenize", {"tokens": [104, EOS, 105]})
    assert status == 200 and json.loads(text) == {"prompt": "h" + chr(EOS) + "i"}


async def test_tokenize_chat_messages_uses_the_template(fake_server):
    _, _, text = await post(fake_server, "/tokenize",
                            {"messages": [{"role": "user", "content": "yo"}]})
    tokens = json.loads(text)["tokens"]
    assert "".join(chr(t) for t in tokens) == "<user>yo\n<assistant>"


async def test_tokenize_chat_messages_renders_the_tools_too(fake_server):
    """vLLM's `tools` on /tokenize reach the chat template, as a chat request's do."""
    seen = []
    render = fake_server.engine.render_chat

    def spy(messages, **options):
        seen.append(options)
        return render(messages, **options)
    fake_server.engine.render_chat = spy
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [{"role": "user", "content": "yo"}]
    status, _, _ = await post(fake_server, "/tokenize", {"messages": msgs, "tools": tools})
    assert status == 200 and seen == [{"tools": tools}]
    status, _, text = await post(fake_server, "/tokenize", {"messages": msgs, "tools": "x"})
    assert status == 400 and json.loads(text)["error"]["param"] == "tools"


async def test_tokenizer_info(fake_server):
    status, info = await get_json(fake_server, "/tokenizer_info")
    assert status == 200
    assert info["eos_token"] == chr(3) and info["bos_token"] is None
    assert info["model_max_length"] == 256 and info["vocab_size"] == 512
    assert info["eos_token_ids"] == [3]


@pytest.mark.parametrize("path,body,match", [
    ("/tokenize", {}, "exactly one of"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ("/tokenize", {"prompt": 5}, "'prompt' must be a string"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "boolean"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "role"),
    ("/tokenize", [1, 2], "JSON object"),
    ("/detokenize", {"tokens": "abc"}, "list"),
    ("/detokenize", {"tokens": [1, 512]}, "0..511"),
    ("/detokenize", {"tokens": [1, True]}, "token ids"),
    ("/detokenize", {"tokens": list(range(300)) * 250}, "at most"),
])
async def test_bad_input_is_400(fake_server, path, body, match):
    status, _, text = await post(fake_server, path, body)
    assert status == 400, text
    assert match in json.loads(text)["error"]["message"]


@pytest.mark.parametrize("fake_server", [{"api_key": "k"}], indirect=True)
async def test_the_api_key_guards_the_tokenizer_routes(fake_server):
    status, _ = await get_json(fake_server, "/tokenizer_info")
    assert status == 401
    status, _, _ = await post(fake_server, "/tokenize", {"prompt": "a"})
    assert status == 401
    status, _, text = await post(fake_server, "/tokenize", {"prompt": "a"},
                                 headers={"Authorization": "Bearer k"})
    assert status == 200 and json.loads(text)["tokens"] == [97]


CONTINUED = [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "hel"}]


async def test_chat_rendering_options_of_vllm_are_honoured(fake_server):
    """add_generation_prompt, continue_final_message and text parts (joined by newlines, as
    vLLM does) on /tokenize and /v1/chat/completions alike."""
    async def rendered(body):
        status, _, text = await post(fake_server, "/tokenize", body)
        assert status == 200, text
        return "".join(chr(t) for t in json.loads(text)["tokens"])

    assert await rendered({"messages": CONTINUED}) == "<user>yo\n<assistant>hel\n<assistant>"
    assert await rendered({"messages": CONTINUED, "add_generation_prompt": False}) == \
        "<user>yo\n<assistant>hel\n"
    continued = {"messages": CONTINUED, "add_generation_prompt": False,
                 "continue_final_message": True}
    assert await rendered(continued) == "<user>yo\n<assistant>hel"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert await rendered({"messages": parts}) == "<user>a\nb\n<assistant>"
    status, _, text = await post(fake_server, "/v1/chat/completions",
                                 {**continued, "max_tokens": 2, "echo": False})
    assert status == 200, text
    assert json.loads(text)["usage"]["prompt_tokens"] == len("<user>yo\n<assistant>hel")


@pytest.mark.parametrize("body,param", [
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"continue_final_message": 1, "add_generation_prompt": False}, "continue_final_message"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"chat_template": "{{ 1 }}"}, "chat_template"),
    ({"documents": [{"text": "x"}]}, "documents"),
    ({"echo": True}, "echo"),
    ({"add_special_tokens": True}, "add_special_tokens"),
])
async def test_chat_rendering_options_that_cannot_be_honoured_are_400(fake_server, body, param):
    status, _, text = await post(fake_server, "/v1/chat/completions",
                                 {"messages": CONTINUED, "max_tokens": 2, **body})
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == param


@pytest.mark.parametrize("body,match", [
    ({"messages": [{"role": "user", "content": "yo"}], "add_generation_prompt": False,
      "continue_final_message": True}, "last message from the assistant"),
    ({"messages": CONTINUED, "chat_template_kwargs": {"messages": []}}, "may not set messages"),
    # a client cannot swap the operator's template in through the template's variables
    ({"messages": CONTINUED, "chat_template_kwargs": {"chat_template": "{{ 7 }}"}},
     "may not set chat_template"),
])
async def test_chat_rendering_options_checked_against_the_messages(fake_server, body, match):
    for path in ("/tokenize", "/v1/chat/completions"):
        status, _, text = await post(fake_server, path, {**body, "max_tokens": 2}
                                     if path != "/tokenize" else body)
        assert status == 400, text
        assert match in json.loads(text)["error"]["message"]


async def test_template_variables_named_like_parameters_are_fine(fake_server):
    """chat_template_kwargs reach the template as variables, whatever their names (a key
    such as "self" or "source" used to clash with a Python parameter: a 500)."""
    for key in ("self", "source", "extra"):
        body = {"messages": CONTINUED, "chat_template_kwargs": {key: 1}}
        status, _, text = await post(fake_server, "/tokenize", body)
        assert status == 200, text
        status, _, text = await post(fake_server, "/v1/chat/completions",
                                     {**body, "max_tokens": 2})
        assert status == 200, text
