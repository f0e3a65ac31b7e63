"""OpenAI request parsing and response shapes for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ferrobatch.model.generation_defaults import under_door_defaults
from ferrobatch.sampling_params import MAX_LOGPROBS, SamplingParams
from ferrobatch.serve.protocol import (
    GUIDED_FIELDS,
    ProtocolError,
    chat_template_options,
    sampling_params_from,
    with_structured_outputs,
)
from ferrobatch.serve.tools import ToolPlan, parse_tools

MAX_PROMPTS = 64


@dataclass
class OpenAIRequest:
    kind: str                                  # "completion" or "chat"
    prompts: list[Any]                         # text or token-id prompts (completions)
    messages: Any                              # chat messages (chat)
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    continuous_usage: bool = False             # stream: every chunk carries the usage so far
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    echo: bool = False                         # completions: the prompt leads each choice
    tools: ToolPlan | None = None              # chat: how the output becomes tool calls
    # chat: `AsyncEngine.render_chat`'s options when any differs from its defaults (vLLM's
    # add_generation_prompt, continue_final_message, chat_template_kwargs; the tools)
    chat_template: dict[str, Any] | None = None
    beam: Any = None          # a `BeamSearchParams` with `use_beam_search` (serve/beam_http.py)
    reasoning_parser: str | None = None   # chat: the reply's <think> part (serve/reasoning.py)
    lora: Any = None          # the LoRARequest its `model` names (serve/lora_api.py), or None
    # vLLM's `return_token_ids`: each choice's `token_ids` (a chunk's: its new ones) and the
    # prompt's `prompt_token_ids` (completions: on each choice; chat: on the response)
    return_token_ids: bool = False
    # vLLM's `return_tokens_as_token_ids`: logprobs show `token_id:<id>` (None: the server's)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's `prompt_logprobs` (not streamed): each prompt token's logprob and the k most
    # likely there, in vLLM's shape (completions: per choice; chat: on the response)
    prompt_logprobs: int | None = None


def check_model(body: dict, model_names: str | Sequence[str]) -> str:
    """The model name a response reports: the body's `model`, which must be one of the served
    names (404 otherwise, as OpenAI), or the first name when the body gives none."""
    names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("'model' must be a string", param="model")
    if model is None:
        return names[0]
    if model not in names:
        raise ProtocolError(f"The model '{model}' does not exist; this server serves "
                            f"'{names[0]}'", code=404, param="model")
    return model


def stream_flag(body: dict) -> bool:
    """The body's `stream` (false when absent or null)."""
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise ProtocolError("'stream' must be a boolean", param="stream")
    return stream


def _check_common(body: Any, model_name: str | Sequence[str]) -> tuple[bool, bool, bool, str]:
    """(stream, include_usage, continuous usage, model name) of a valid body; ProtocolError
    otherwise. `stream_options.continuous_usage_stats` (vLLM's extension) puts the running
    usage in every chunk; like vLLM, only together with `include_usage`."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = check_model(body, model_name)
    stream = stream_flag(body)
    k = body.get("prompt_logprobs")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
            raise ProtocolError(f"'prompt_logprobs' must be an integer in [0, {MAX_LOGPROBS}]",
                                param="prompt_logprobs")
        if stream:
            raise ProtocolError("'prompt_logprobs' come with a whole answer, not a stream "
                                "(or send 'echo': true with 'logprobs' on completions)",
                                param="prompt_logprobs")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ProtocolError("'stream_options' must be an object", param="stream_options")
    for key in ("include_usage", "continuous_usage_stats"):
        if opts and not isinstance(opts.get(key, False), bool):
            raise ProtocolError(f"'stream_options.{key}' must be a boolean",
                                param="stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    continuous_usage = include_usage and bool(opts.get("continuous_usage_stats"))
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ProtocolError("'best_of' other than n is not supported", param="best_of")
    for name in ("return_token_ids", "return_tokens_as_token_ids"):
        if not isinstance(body.get(name, False), (bool, type(None))):
            raise ProtocolError(f"'{name}' must be a boolean", param=name)
    return stream, include_usage, continuous_usage, model


def parse_completion(body: Any, model_name: str | Sequence[str],
                     sampling_defaults: Mapping[str, Any] | None = None) -> OpenAIRequest:
    """A completions request; `sampling_defaults`: the model's (the engine's
    ``default_sampling_fields``) for the fields the body leaves unset."""
    stream, include_usage, continuous_usage, model = _check_common(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = list(prompt)
    elif prompt is None or prompt == [] or prompt == "":
        raise ProtocolError("'prompt' must not be empty", param="prompt")
    else:
        raise ProtocolError("'prompt' must be a string, a list of strings, a list of token ids "
                            "or a list of token-id lists", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ProtocolError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise ProtocolError("'echo' must be a boolean", param="echo")
    if body.get("suffix"):
        raise ProtocolError("'suffix' is not supported", param="suffix")
    params = sampling_params_from(with_response_format(body),
                                  defaults=under_door_defaults(sampling_defaults or {},
                                                               {"max_tokens": 16}),
                                  output_kind="delta" if stream else "final")
    if echo and params.logprobs is not None:          # the echoed prompt gets logprobs too
        params = params.replace(prompt_logprobs=max(params.logprobs,
                                                    params.prompt_logprobs or 0))
    return OpenAIRequest("completion", prompts, None, params, stream, include_usage, model,
                         continuous_usage=continuous_usage, id=f"cmpl-{secrets.token_hex(12)}",
                         echo=echo, return_token_ids=bool(body.get("return_token_ids")),
                         return_tokens_as_token_ids=body.get("return_tokens_as_token_ids"),
                         prompt_logprobs=body.get("prompt_logprobs"))


def parse_chat(body: Any, model_name: str | Sequence[str], tool_parser: str | None = None,
               sampling_defaults: Mapping[str, Any] | None = None) -> OpenAIRequest:
    """A chat request; `tool_parser`: how the model writes its own tool calls
    (`tools.AUTO_PARSERS`), so tool_choice "auto" is served; `sampling_defaults` as for
    `parse_completion`."""
    stream, include_usage, continuous_usage, model = _check_common(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list", param="messages")
    fields = with_response_format(body)
    tools = parse_tools(body, tool_parser)
    if tools is not None and tools.keeps_special_tokens and \
            fields.get("skip_special_tokens") is None:
        fields["skip_special_tokens"] = False
    if tools is not None and tools.forced:
        given = [f for f in GUIDED_FIELDS if fields.get(f) is not None]
        if given:
            clash = next((f for f in ("response_format", "structured_outputs") if body.get(f)),
                         given[0])
            raise ProtocolError(f"a forced tool call cannot be combined with '{clash}'",
                                param="tool_choice")
        fields["guided_json"] = tools.schema
    mct = body.get("max_completion_tokens")
    if mct is not None:
        fields["max_tokens"] = mct
    fields["logprobs"] = _chat_logprobs_count(body)
    params = sampling_params_from(fields, defaults=under_door_defaults(sampling_defaults or {},
                                                                       {"max_tokens": None}),
                                  output_kind="delta" if stream else "final")
    for key, why in (("echo", "a completions field"), ("chat_template", "not supported: the "
                     "model's own template is used"), ("documents", "not supported")):
        if body.get(key) not in (None, False, []):
            raise ProtocolError(f"'{key}' is {why}", param=key)
    if body.get("add_special_tokens") not in (None, False):
        raise ProtocolError("'add_special_tokens' must be false on chat: the chat template "
                            "places the special tokens", param="add_special_tokens")
    options = chat_template_options(body)
    if tools is not None:
        options["tools"] = body["tools"]
    return OpenAIRequest("chat", [], messages, params, stream, include_usage, model,
                         continuous_usage=continuous_usage,
                         id=f"chatcmpl-{secrets.token_hex(12)}", tools=tools,
                         chat_template=options or None,
                         return_token_ids=bool(body.get("return_token_ids")),
                         return_tokens_as_token_ids=body.get("return_tokens_as_token_ids"),
                         prompt_logprobs=body.get("prompt_logprobs"))


def with_response_format(body: dict) -> dict:
    """The body's fields with OpenAI's `response_format` turned into the engine's guided field:
    `{"type": "json_object"}` -> any JSON object, `{"type": "json_schema", "json_schema":
    {"schema": ...}}` -> that schema, `{"type": "text"}` (or none) -> unconstrained."""
    fmt = body.get("response_format")
    fields = with_structured_outputs(dict(body))
    if fmt is None:
        return fields
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ProtocolError("'response_format' must be {'type': 'text' | 'json_object' | "
                            "'json_schema', ...}", param="response_format")
    if kind == "text":
        return fields
    given = [f for f in GUIDED_FIELDS if fields.get(f) is not None]
    if given:
        clash = "structured_outputs" if body.get("structured_outputs") else given[0]
        raise ProtocolError(f"'response_format' cannot be combined with '{clash}'",
                            param="response_format")
    if kind == "json_object":
        fields["guided_json"] = {"type": "object"}
        return fields
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ProtocolError("'response_format.json_schema' must be an object with a 'schema'",
                            param="response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise ProtocolError("'response_format.json_schema.schema' must be a JSON Schema object",
                            param="response_format")
    fields["guided_json"] = schema
    return fields


def _chat_logprobs_count(body: dict) -> int | None:
    """Chat's `logprobs` (bool) and `top_logprobs` (0..20, needs logprobs) as the engine's
    `SamplingParams.logprobs` (None: none; N: the token's logprob and N alternatives)."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ProtocolError("'logprobs' must be a boolean", param="logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int):
            raise ProtocolError("'top_logprobs' must be an integer", param="top_logprobs")
        if not wanted:
            raise ProtocolError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if not 0 <= top <= MAX_LOGPROBS:
            raise ProtocolError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}]",
                                param="top_logprobs")
    return (top or 0) if wanted else None


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """The usage object; `cached_tokens`: prompt tokens the prefix cache held (OpenAI's
    `prompt_tokens_details`), left out when not known yet; `reasoning_tokens`: completion
    tokens that were reasoning (`completion_tokens_details`, with a reasoning parser)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def cached_total(outputs: Any) -> int | None:
    """The prompts' cached tokens over these RequestOutputs (None if none is known yet)."""
    known = [o.num_cached_tokens for o in outputs if o.num_cached_tokens is not None]
    return sum(known) if known else None


def choice(req: OpenAIRequest, index: int, text: str, finish_reason: str | None,
           stream: bool, logprobs: dict[str, Any] | None = None,
           tool_calls: list[dict[str, Any]] | None = None,
           reasoning: str | None = None) -> dict[str, Any]:
    """One choice of a response or chunk; `logprobs` is already in the route's shape
    (`serve.logprobs`), None when not asked for. With `tool_calls` (chat) the choice carries
    them, with `text` (what the model wrote before them) as content or null, and a finish by
    the model's own end reads "tool_calls". With a reasoning parser (chat), `reasoning` is the
    reply's reasoning part (`reasoning_content`; a message without one says null, a chunk
    leaves it out)."""
    if req.kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}
    if tool_calls is not None and finish_reason == "stop":
        finish_reason = "tool_calls"
    if stream:
        delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        if text:
            delta["content"] = text
        if tool_calls:       # with any text that came in the same piece of output before them
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls is not None:       # any text the model wrote before its calls, else null
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    if req.reasoning_parser is not None:
        message["reasoning_content"] = reasoning
        if reasoning is not None and not text:
            message["content"] = None
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason}


def envelope(req: OpenAIRequest, choices: list[dict[str, Any]], *, chunk: bool,
             usage_: dict[str, int] | None = None) -> dict[str, Any]:
    if req.kind == "completion":
        obj = "text_completion"
    else:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    out: dict[str, Any] = {"id": req.id, "object": obj, "created": req.created,
                           "model": req.model, "choices": choices}
    if not chunk or req.include_usage:
        out["usage"] = usage_
    return out

