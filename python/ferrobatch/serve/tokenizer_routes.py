"""The served model's tokenizer over HTTP, in vLLM's shapes (what lm-eval's remote tokenizer and
vLLM users' scripts call):

- ``GET /tokenizer_info`` -> ``{eos_token, bos_token, pad_token, chat_template,
  model_max_length, vocab_size, eos_token_ids}``
- ``POST /tokenize`` ``{prompt: str, add_special_tokens?: bool}`` or ``{messages: [...],
  add_generation_prompt?: bool, continue_final_message?: bool, chat_template_kwargs?: {...},
  tools?: [...]}``
  -> ``{tokens, count, max_model_len}``
- ``POST /detokenize`` ``{tokens: [int]}`` -> ``{prompt}``

Input is checked like every other door (400 with the OpenAI error object); nothing here touches
the engine's queue.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ferrobatch.engine.inputs import check_prompt_text
from ferrobatch.serve.codec import MAX_ARRAY_LEN
from ferrobatch.serve.http import read_json
from ferrobatch.serve.protocol import ProtocolError, chat_template_options
from ferrobatch.serve.state import STATE


def _token_text(tokenizer: Any, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    if hasattr(tokenizer, "id_to_token"):
        return tokenizer.id_to_token(token_id)
    return tokenizer.decode([token_id], skip_special_tokens=False)


async def tokenizer_info(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    tok = engine.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    if eos is None and tok.eos_token_ids:
        eos = tok.eos_token_ids[0]
    return web.json_response({
        "eos_token": _token_text(tok, eos),
        "bos_token": _token_text(tok, getattr(tok, "bos_token_id", None)),
        "pad_token": None,
        "chat_template": getattr(tok, "chat_template", None),
        "model_max_length": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "eos_token_ids": list(tok.eos_token_ids),
    })


async def tokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    engine = request.app[STATE].engine
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise ProtocolError("'add_special_tokens' must be a boolean", param="add_special_tokens")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError("send exactly one of 'prompt' (text) or 'messages' (chat)")
    if messages is not None:
        options = chat_template_options(body)
        tools = body.get("tools")
        if tools is not None:                  # vLLM's: the template renders them too
            if not isinstance(tools, list):
                raise ProtocolError("'tools' must be a list", param="tools")
            options["tools"] = tools
        try:
            prompt = engine.render_chat(messages, **options)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="messages") from None
        special = False                 # the template already placed the special tokens
    if not isinstance(prompt, str):
        raise ProtocolError("'prompt' must be a string", param="prompt")
    try:
        check_prompt_text(prompt)
    except ValueError as exc:
        raise ProtocolError(str(exc), param="prompt") from None
    tokens = list(engine.tokenizer.encode(prompt, add_special_tokens=special))
    return web.json_response({"tokens": tokens, "count": len(tokens),
                              "max_model_len": engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    engine = request.app[STATE].engine
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_ARRAY_LEN:
        raise ProtocolError(f"'tokens' must be a list of at most {MAX_ARRAY_LEN} token ids",
                            param="tokens")
    vocab = engine.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
               for t in tokens):
        raise ProtocolError(f"'tokens' must be token ids in 0..{vocab - 1}", param="tokens")
    # special tokens kept (as transformers' decode and vLLM do): /tokenize of chat messages
    # returns the template's <|im_start|> ids, and they must come back as text
    return web.json_response({"prompt": engine.tokenizer.decode(tokens,
                                                                skip_special_tokens=False)})


def add_tokenizer_routes(app: web.Application) -> None:
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
