"""The shared request vocabulary of every door: sampling fields, error codes, WS/TCP messages.

One validation path for all doors: a field has the same name, type and range on HTTP, WebSocket
and TCP, and a bad one gets the same message. Nothing here touches the engine.

WebSocket / TCP messages (maps with a "type"):
  client -> server: hello {version, api_key?}; generate {id, prompt | messages, params?,
                    add_generation_prompt?, continue_final_message?, chat_template_kwargs?
                    (the last three with messages), model? (a served name: a LoRA adapter's
                    runs with it)}; embed {id, prompt, params? (pooling, normalize,
                    dimensions, truncate_prompt_tokens), model?}; cancel {id}
  server -> client: hello {version, model, limits}; delta {id, index, text, token_ids};
                    (+ logprobs when params.logprobs is set);
                    prompt_logprobs {id, start, logprobs} (params.prompt_logprobs: before
                    the first delta, in pieces of at most 256 prompt positions);
                    done {id, finish_reason, finish_reasons, usage}; embedding {id,
                    embedding, usage} (an embed's answer); cancelled {id};
                    error {id | None, code, message}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ferrobatch.engine.errors import DuplicateRequestError, EngineDeadError, QueueFullError
from ferrobatch.model.generation_defaults import under_door_defaults
from ferrobatch.pooling_params import PoolingParams
from ferrobatch.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
MAX_ID_LEN = 128

# Sampling fields accepted on every door (OpenAI names plus the usual vLLM extras).
INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "priority", "logprobs",
              "prompt_logprobs", "truncate_prompt_tokens")
NUM_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
SAMPLING_FIELDS = frozenset(INT_FIELDS + NUM_FIELDS + BOOL_FIELDS + GUIDED_FIELDS
                            + ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids",
                               "bad_words", "cache_salt", "extra_args"))
MAX_EXTRA_ARGS = 64           # names in `extra_args` / `vllm_xargs`
# beam search's fields (vLLM's `use_beam_search`; serve/beam_http.py checks them)
BEAM_FIELDS = ("use_beam_search", "length_penalty", "early_stopping")


class ProtocolError(ValueError):
    """A client error with the HTTP-style status code to report (400 unless stated)."""

    def __init__(self, message: str, code: int = 400, param: str | None = None,
                 close_connection: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.close_connection = close_connection      # HTTP: answer with Connection: close


def is_int(v: Any) -> bool:
    """An int that is not a bool (JSON / msgpack true is not 1 here)."""
    return isinstance(v, int) and not isinstance(v, bool)


# vLLM's `structured_outputs` object (its guided_* fields' successor): key -> our guided field
_STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                       "grammar": "guided_grammar"}
# guided-decoding fields we cannot honour: refused, never silently ignored (vLLM's
# `guided_decoding_backend` only picks an implementation, and is ignored like other unknown keys)
_UNSUPPORTED_GUIDED = ("guided_whitespace_pattern",)


def _extra_args_of(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with vLLM's `vllm_xargs` under our name, `extra_args` (a ProtocolError when both
    are given)."""
    if fields.get("vllm_xargs") is None:
        return fields
    if fields.get("extra_args") is not None:
        raise ProtocolError("give 'vllm_xargs' or 'extra_args', not both", param="vllm_xargs")
    out = {k: v for k, v in fields.items() if k != "vllm_xargs"}
    out["extra_args"] = fields["vllm_xargs"]
    return out


def _check_extra_args(v: Any) -> dict[str, Any]:
    """vLLM's `vllm_xargs` type: names to strings, numbers, booleans or lists of them."""
    def scalar(x: Any) -> bool:
        return isinstance(x, (str, int, float, bool))

    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ProtocolError("'extra_args' must be an object", param="extra_args")
    if len(v) > MAX_EXTRA_ARGS:
        raise ProtocolError(f"'extra_args' holds at most {MAX_EXTRA_ARGS} names",
                            param="extra_args")
    for key, x in v.items():
        if not (scalar(x) or (isinstance(x, list) and all(scalar(e) for e in x))):
            raise ProtocolError(f"'extra_args.{key}' must be a string, a number, a boolean or "
                                f"a list of them", param="extra_args")
    return dict(v)


def with_structured_outputs(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with vLLM's `structured_outputs` ({"json" | "regex" | "choice": ...} or
    {"json_object": true}) turned into the matching guided field; guided-decoding requests
    this engine cannot honour (a grammar, a structural tag, ...) are a ProtocolError."""
    for name in _UNSUPPORTED_GUIDED:
        if fields.get(name) is not None:
            raise ProtocolError(f"'{name}' is not supported (guided_json, guided_regex, "
                                f"guided_choice and guided_grammar are)", param=name)
    spec = fields.get("structured_outputs")
    if spec is None:
        return fields
    if not isinstance(spec, dict):
        raise ProtocolError("'structured_outputs' must be an object", param="structured_outputs")
    out = {k: v for k, v in fields.items() if k != "structured_outputs"}
    given = [f for f in GUIDED_FIELDS if out.get(f) is not None]
    for key, value in spec.items():
        if value is None or value is False:
            continue
        if key == "json_object":
            if value is not True:
                raise ProtocolError("'structured_outputs.json_object' must be a boolean",
                                    param="structured_outputs")
            key, value = "json", {"type": "object"}
        if key not in _STRUCTURED_OUTPUTS:
            raise ProtocolError(f"'structured_outputs.{key}' is not supported (json, regex, "
                                f"choice, grammar and json_object are)",
                                param="structured_outputs")
        if given:
            raise ProtocolError(f"'structured_outputs' cannot be combined with '{given[0]}'",
                                param="structured_outputs")
        out[_STRUCTURED_OUTPUTS[key]] = value
        given.append(_STRUCTURED_OUTPUTS[key])
    return out


def sampling_params_from(fields: dict[str, Any], *, defaults: dict[str, Any] | None = None,
                         **fixed: Any) -> SamplingParams:
    """Type-check the sampling fields of `fields` (unknown keys ignored) and build the params."""
    fields = _extra_args_of(with_structured_outputs(fields))
    kw: dict[str, Any] = dict(defaults or {})
    for name in SAMPLING_FIELDS:
        if name not in fields or fields[name] is None:
            continue
        v = fields[name]
        if name in INT_FIELDS and not is_int(v):
            raise ProtocolError(f"'{name}' must be an integer", param=name)
        if name in NUM_FIELDS and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ProtocolError(f"'{name}' must be a number", param=name)
        if name in BOOL_FIELDS and not isinstance(v, bool):
            raise ProtocolError(f"'{name}' must be a boolean", param=name)
        if name == "stop":
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
                raise ProtocolError("'stop' must be a string or a list of strings", param=name)
            v = tuple(v)
        if name in ("stop_token_ids", "allowed_token_ids"):
            if not isinstance(v, list) or not all(is_int(t) for t in v):
                raise ProtocolError(f"'{name}' must be a list of integers", param=name)
            v = tuple(v)
        if name == "cache_salt" and not isinstance(v, str):
            raise ProtocolError("'cache_salt' must be a string", param=name)
        if name == "bad_words":
            if not isinstance(v, list) or not all(isinstance(w, str) for w in v):
                raise ProtocolError("'bad_words' must be a list of strings", param=name)
            v = tuple(v)
        if name == "extra_args":
            v = _check_extra_args(v)
        if name == "logit_bias" and not isinstance(v, dict):
            raise ProtocolError("'logit_bias' must be a map of token id -> bias", param=name)
        if name == "guided_json" and not isinstance(v, (dict, str)):
            raise ProtocolError("'guided_json' must be a JSON Schema (an object or its JSON "
                                "text)", param=name)
        if name in ("guided_regex", "guided_grammar") and not isinstance(v, str):
            raise ProtocolError(f"'{name}' must be a string", param=name)
        if name == "guided_choice":
            if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
                raise ProtocolError("'guided_choice' must be a list of strings", param=name)
            v = tuple(v)
        kw[name] = v
    kw.update(fixed)
    try:
        return SamplingParams(**kw)
    except ValueError as exc:
        # SamplingParams' messages start with the field at fault ("top_p must be ..."): name it
        # as the error's `param`, as OpenAI does, when the request set that field
        field = re.match(r"\w+", str(exc))
        param = field.group() if field and field.group() in kw else None
        raise ProtocolError(str(exc), param=param) from None


def error_status(exc: BaseException) -> tuple[int, str]:
    """(status code, OpenAI error type) of an exception raised while accepting a request."""
    if isinstance(exc, ProtocolError):
        kind = {401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error"}.get(exc.code,
                                                                           "invalid_request_error")
        return exc.code, kind
    if isinstance(exc, QueueFullError):
        return 429, "rate_limit_error"
    if isinstance(exc, EngineDeadError):
        return 503, "server_error"
    if isinstance(exc, (ValueError, DuplicateRequestError)):
        return 400, "invalid_request_error"
    return 500, "server_error"


# vLLM's chat-rendering fields (the OpenAI chat body, and a WS / TCP `generate` with messages)
CHAT_OPTION_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def chat_template_options(body: dict) -> dict[str, Any]:
    """vLLM's chat-rendering fields of a request body that differ from the defaults, as
    `AsyncEngine.render_chat` keywords: `add_generation_prompt` (true), `continue_final_message`
    (false), `chat_template_kwargs` (an object of extra template variables)."""
    options: dict[str, Any] = {}
    for key, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(key, default)
        if not isinstance(value, bool):
            raise ProtocolError(f"'{key}' must be a boolean", param=key)
        if value != default:
            options[key] = value
    if options.get("continue_final_message") and "add_generation_prompt" not in options:
        raise ProtocolError("'continue_final_message' needs 'add_generation_prompt': false",
                            param="continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ProtocolError("'chat_template_kwargs' must be an object",
                                param="chat_template_kwargs")
        if kwargs:
            options["template_kwargs"] = kwargs
    return options


# -- WebSocket / TCP messages ------------------------------------------------------------------

@dataclass
class GenerateMsg:
    id: str | int
    prompt: Any
    messages: Any
    params: SamplingParams
    chat_options: dict[str, Any] | None = None    # `AsyncEngine.render_chat` keywords
    model: Any = None                             # a served model name, or None (unchecked)
    beam: Any = None          # a BeamSearchParams with `use_beam_search` (vLLM's)


@dataclass
class EmbedMsg:
    id: str | int
    prompt: Any
    pooling: PoolingParams
    truncate_prompt_tokens: int | None = None
    model: Any = None                             # a served model name, or None (unchecked)


EMBED_FIELDS = ("pooling", "normalize", "dimensions", "truncate_prompt_tokens")


def pooling_params_from(fields: dict[str, Any]) -> PoolingParams:
    """The embedding fields of `fields` (`pooling`, `normalize`, `dimensions`; absent or null:
    the default) as PoolingParams; a bad one is a ProtocolError naming it. Every door's."""
    try:
        return PoolingParams(**{k: fields[k] for k in ("pooling", "normalize", "dimensions")
                                if fields.get(k) is not None})
    except ValueError as exc:
        raise ProtocolError(str(exc), param=str(exc).split()[0]) from None


def truncate_prompt_tokens_of(fields: dict[str, Any]) -> int | None:
    """The `truncate_prompt_tokens` of a pooling request's fields (None when absent); a
    non-integer is a ProtocolError (the range is checked with the prompt)."""
    truncate = fields.get("truncate_prompt_tokens")
    if truncate is not None and not is_int(truncate):
        raise ProtocolError("'truncate_prompt_tokens' must be an integer",
                            param="truncate_prompt_tokens")
    return truncate


def check_id(v: Any) -> str | int:
    if isinstance(v, str) and 0 < len(v) <= MAX_ID_LEN:
        return v
    if is_int(v) and -(2**63) <= v < 2**64:
        return v
    raise ProtocolError(f"'id' must be a non-empty string (<= {MAX_ID_LEN} chars) or an integer")


def parse_message(msg: Any, sampling_defaults: dict[str, Any] | None = None
                  ) -> tuple[str, Any]:
    """Validate one client message; returns (type, payload). ProtocolError when malformed.
    `sampling_defaults`: the model's, for the sampling fields a `generate` leaves unset."""
    if not isinstance(msg, dict):
        raise ProtocolError("each message must be a map with a 'type'")
    kind = msg.get("type")
    if kind == "hello":
        version = msg.get("version")
        if not is_int(version) or version != PROTOCOL_VERSION:      # true == 1 in Python
            raise ProtocolError(f"unsupported protocol version {version!r}; this server speaks "
                                f"version {PROTOCOL_VERSION}")
        key = msg.get("api_key")
        if key is not None and not isinstance(key, str):
            raise ProtocolError("'api_key' must be a string")
        return "hello", key
    if kind == "cancel":
        _only(msg, {"type", "id"})
        return "cancel", check_id(msg.get("id"))
    if kind == "generate":
        _only(msg, {"type", "id", "prompt", "messages", "params", "model",
                    *CHAT_OPTION_FIELDS})
        rid = check_id(msg.get("id"))
        prompt, messages = msg.get("prompt"), msg.get("messages")
        if (prompt is None) == (messages is None):
            raise ProtocolError("'generate' needs exactly one of 'prompt' or 'messages'")
        given = [k for k in CHAT_OPTION_FIELDS if k in msg]
        if given and messages is None:
            raise ProtocolError(f"'{given[0]}' needs 'messages'", param=given[0])
        chat_options = chat_template_options(msg) or None
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise ProtocolError("'prompt' must be a string or a list of token ids")
        params = msg.get("params")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise ProtocolError("'params' must be a map of sampling fields")
        unknown = sorted(str(k) for k in params
                         if k not in SAMPLING_FIELDS
                         and k not in ("structured_outputs", "vllm_xargs") + BEAM_FIELDS)
        if unknown:
            raise ProtocolError(f"unknown sampling field(s): {', '.join(unknown)}")
        sp = sampling_params_from(params, defaults=under_door_defaults(sampling_defaults or {},
                                                                       {}),
                                  output_kind="delta")
        from ferrobatch.serve.beam_http import beam_params_of
        beam = beam_params_of(params, sp, sampling_defaults)
        return "generate", GenerateMsg(rid, prompt, messages, sp, chat_options,
                                       msg.get("model"), beam)
    if kind == "embed":
        _only(msg, {"type", "id", "prompt", "params", "model"})
        rid = check_id(msg.get("id"))
        prompt = msg.get("prompt")
        if not isinstance(prompt, (str, list)):
            raise ProtocolError("'embed' needs a 'prompt': a string or a list of token ids")
        params = msg.get("params") or {}
        if not isinstance(params, dict):
            raise ProtocolError("'params' must be a map")
        unknown = sorted(str(k) for k in params if k not in EMBED_FIELDS)
        if unknown:
            raise ProtocolError(f"unknown embedding field(s): {', '.join(unknown)} (known: "
                                f"{', '.join(EMBED_FIELDS)})")
        return "embed", EmbedMsg(rid, prompt, pooling_params_from(params),
                                 truncate_prompt_tokens_of(params),
                                 msg.get("model"))
    raise ProtocolError(f"unknown message type {kind!r}; expected hello, generate, embed or "
                        "cancel")


def _only(msg: dict, allowed: set[str]) -> None:
    extra = sorted(str(k) for k in msg if k not in allowed)
    if extra:
        raise ProtocolError(f"unexpected field(s) in '{msg.get('type')}': {', '.join(extra)}")


def error_msg(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"type": "error", "id": rid, "code": code, "message": message}
