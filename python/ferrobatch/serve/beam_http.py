"""Beam search on /v1/completions and /v1/chat/completions (vLLM's `use_beam_search`).

`n` is the beam width and the number of choices returned (the best beams, best first);
`length_penalty` and `early_stopping` (true, false or "never") are transformers' (the search
follows its rules, `engine/beam_search.py`); `max_tokens` (`max_completion_tokens`) and
`ignore_eos` apply. The search ranks by the model's raw log-probabilities, so `temperature`,
`top_p` and `top_k` do not apply; a field that would change the output otherwise (stop strings,
penalties, logprobs, guided decoding, tools, `echo`, `stream`, ...) is a 400, never ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web

from ferrobatch.engine.beam_search import BeamSearchOutput, BeamSearchParams
from ferrobatch.sampling_params import SamplingParams
from ferrobatch.serve.openai_protocol import OpenAIRequest, choice, envelope, usage
from ferrobatch.serve.protocol import ProtocolError
from ferrobatch.serve.reasoning import split_reasoning
from ferrobatch.serve.state import STATE

# SamplingParams fields a beam search takes (or, for the sampling ones, has no use for)
_BEAM_FIELDS = frozenset({"n", "max_tokens", "ignore_eos", "temperature", "top_p", "top_k",
                          "output_kind", "skip_special_tokens"})
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def beam_params_of(body: dict, params: SamplingParams,
                   sampling_defaults: dict[str, Any] | None = None) -> BeamSearchParams | None:
    """The request's beam search (None without `use_beam_search`); ProtocolError for a field it
    cannot honour (set by the request: the model's `sampling_defaults` are not its doing)."""
    use = body.get("use_beam_search")
    if use is None or use is False:
        for name in ("length_penalty", "early_stopping"):
            if body.get(name) is not None:
                raise ProtocolError(f"'{name}' needs 'use_beam_search': true", param=name)
        return None
    if use is not True:
        raise ProtocolError("'use_beam_search' must be a boolean", param="use_beam_search")
    if body.get("stream"):
        raise ProtocolError("'stream' cannot be combined with use_beam_search: the best beams "
                            "are known only at the end", param="stream")
    for name in ("echo", "tools", "best_of"):
        if body.get(name) not in (None, False, [], params.n):
            raise ProtocolError(f"'{name}' cannot be combined with use_beam_search", param=name)
    defaults = {**_DEFAULTS, **(sampling_defaults or {})}
    for name, default in defaults.items():
        if name not in _BEAM_FIELDS and getattr(params, name) != default:
            raise ProtocolError(f"'{name}' cannot be combined with use_beam_search", param=name)
    kw: dict[str, Any] = {}
    for name in ("length_penalty", "early_stopping"):
        if body.get(name) is not None:
            kw[name] = body[name]
    try:
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens,
                                ignore_eos=params.ignore_eos, **kw)
    except ValueError as exc:
        name = next((n for n in kw if str(exc).startswith(n)), None)
        raise ProtocolError(str(exc), param=name) from None


async def serve_beams(request: web.Request, req: OpenAIRequest) -> web.Response:
    """Runs the request's beam searches side by side (one per prompt) and answers with the best
    `n` beams of each; a client that leaves cancels them, which aborts their requests."""
    engine = request.app[STATE].engine
    if req.kind == "chat":
        searches = [engine.beam_search(None, req.beam, messages=req.messages,
                                       chat_options=req.chat_template, lora_request=req.lora)]
    else:
        searches = [engine.beam_search(p, req.beam, lora_request=req.lora)
                    for p in req.prompts]
    tasks = [asyncio.ensure_future(s) for s in searches]
    try:
        outs: list[BeamSearchOutput] = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
    choices = []
    completion = 0
    for i, out in enumerate(outs):
        for j, seq in enumerate(out.sequences):
            completion += len(seq.output_token_ids)
            reasoning, text = None, seq.text
            if req.reasoning_parser is not None:        # chat with --reasoning-parser
                reasoning, text = split_reasoning(req.reasoning_parser, text)
            choices.append(choice(req, i * req.beam.beam_width + j, text, seq.finish_reason,
                                  stream=False, reasoning=reasoning))
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return web.json_response(envelope(req, choices, chunk=False,
                                      usage_=usage(prompt_tokens, completion)))
