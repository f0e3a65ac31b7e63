"""SGLang's native ``POST /generate`` on ferrobatch: its request read into ferrobatch's
SamplingParams, and ferrobatch's outputs written in its answer's shape (serve/native_api.py
serves it). What RL frameworks and scripts written against SGLang send, answered as they expect.

Request (one JSON object)::

    {"text": "..." | ["...", ...]            # or "input_ids": [ids] | [[ids], ...]
     "sampling_params": {...} | [{...}, ...],  # one for all prompts, or one per prompt
     "rid": "..." | [...],                   # request ids (default: random); abort_request's
     "return_logprob": false, "top_logprobs_num": 0, "logprob_start_len": -1,
     "return_text_in_logprobs": false,       # (each of these four: one, or one per prompt)
     "lora_path": "name" | [...],            # a served LoRA adapter, by name
     "stream": false}

Sampling fields, SGLang's names: ``max_new_tokens`` (128; null: fill the context),
``min_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``frequency_penalty``,
``presence_penalty``, ``repetition_penalty``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens``, ``no_stop_trim`` (the stop string stays in the text), ``n``,
``json_schema`` / ``regex`` / ``ebnf`` (guided decoding), ``logit_bias``, ``sampling_seed``. Fields
the request leaves unset take the model's generation_config defaults, as SGLang's
``--sampling-defaults model``. A field ferrobatch cannot honour is refused by name, never ignored.

Answer: per prompt and sample (prompt-major: prompt i's sample j is item ``i * n + j``)::

    {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
     (return_logprob) "output_token_logprobs": [[logprob, token_id, text | null], ...],
     (and top_logprobs_num > 0) "output_top_logprobs": [[[logprob, id, text], ...], ...],
     (and logprob_start_len >= 0) "input_token_logprobs", "input_top_logprobs"}}

a single object for one prompt and one sample, else a list. ``finish_reason`` is
``{"type": "length", "length": n}``, ``{"type": "stop", "matched": <token id or stop
string>}`` or ``{"type": "abort", "message"}`` (null while running). Streaming sends one
``data: {...}`` event per item that changed, its text, ids and logprobs so far (with
``"index"`` when there are several items), then ``data: [DONE]``. Logprobs are the model's raw
ones (before temperature, penalties and top-k / p), as on the OpenAI routes.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ferrobatch.model.generation_defaults import under_door_defaults
from ferrobatch.sampling_params import MAX_LOGPROBS, SamplingParams
from ferrobatch.serve.logprobs import wire_logprob
from ferrobatch.serve.openai_protocol import MAX_PROMPTS
from ferrobatch.serve.protocol import ProtocolError, is_int, sampling_params_from

DEFAULT_MAX_NEW_TOKENS = 128          # SGLang's SamplingParams default

# SGLang sampling field -> ferrobatch's (same meaning; sampling_params_from checks the types)
SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "include_stop_str_in_output", "n": "n", "json_schema": "guided_json",
    "regex": "guided_regex", "ebnf": "guided_grammar", "logit_bias": "logit_bias",
    "sampling_seed": "seed",
}
_SGLANG_NAME = {ours: theirs for theirs, ours in SAMPLING_NAMES.items()}
# SGLang fields accepted only at the value ferrobatch always behaves as
_FIXED_SAMPLING = {"spaces_between_special_tokens": True}
_UNSUPPORTED_SAMPLING = ("structural_tag", "custom_params", "stream_interval")

# top-level fields: each may be one value for every prompt or a list of one per prompt
_PER_PROMPT = ("sampling_params", "rid", "return_logprob", "logprob_start_len",
               "top_logprobs_num", "return_text_in_logprobs", "lora_path")
_TOP_LEVEL = frozenset(("text", "input_ids", "stream") + _PER_PROMPT)
_UNSUPPORTED_TOP = ("input_embeds", "image_data", "audio_data", "video_data",
                    "token_ids_logprob", "custom_logit_processor", "return_hidden_states",
                    "session_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass
class GenerateItem:
    """One prompt of a ``/generate`` request, ready for ``AsyncEngine.add_request``."""

    prompt: str | list[int]
    params: SamplingParams
    rid: str
    lora_name: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1          # >= 0: the prompt's logprobs from this position on
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False


@dataclass
class GenerateRequest:
    items: list[GenerateItem]
    batched: bool                        # the prompts came as a list: the answer is a list
    stream: bool

    @property
    def n(self) -> int:
        return self.items[0].params.n

    @property
    def answers_a_list(self) -> bool:
        return self.batched or self.n > 1


def _prompts(body: dict) -> tuple[list[str | list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise ProtocolError("give 'text' or 'input_ids', not both", param="text")
    if text is None and ids is None:
        raise ProtocolError("'text' or 'input_ids' is required", param="text")
    if text is not None:
        if isinstance(text, str):
            prompts: list[Any] = [text]
            batched = False
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            prompts, batched = list(text), True
        else:
            raise ProtocolError("'text' must be a string or a list of strings", param="text")
        if not prompts or any(p == "" for p in prompts):
            raise ProtocolError("'text' must not be empty", param="text")
    else:
        if isinstance(ids, list) and ids and all(is_int(t) for t in ids):
            prompts, batched = [list(ids)], False
        elif (isinstance(ids, list) and ids
              and all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in ids)):
            prompts, batched = [list(p) for p in ids], True
        else:
            raise ProtocolError("'input_ids' must be a non-empty list of token ids or of "
                                "token-id lists", param="input_ids")
    if len(prompts) > MAX_PROMPTS:
        raise ProtocolError(f"at most {MAX_PROMPTS} prompts per request", param="text")
    return prompts, batched


def _per_prompt(body: dict, name: str, count: int, batched: bool) -> list[Any]:
    """The field's value for each prompt: one value for all, or (a batch) one per prompt."""
    value = body.get(name)
    if isinstance(value, list):
        if not batched:
            raise ProtocolError(f"'{name}' is a list, but the request has one prompt",
                                param=name)
        if len(value) != count:
            raise ProtocolError(f"'{name}' has {len(value)} entries for {count} prompts",
                                param=name)
        return list(value)
    if name == "rid" and value is not None and batched and count > 1:
        raise ProtocolError("a batch takes a list of request ids, one per prompt", param="rid")
    return [value] * count


def _sampling(fields: Any, defaults: dict[str, Any]) -> SamplingParams:
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        raise ProtocolError("'sampling_params' must be an object", param="sampling_params")
    mapped: dict[str, Any] = {}
    for key, value in fields.items():
        if key in SAMPLING_NAMES:
            mapped[SAMPLING_NAMES[key]] = value
        elif key in _FIXED_SAMPLING:
            if value is not None and value != _FIXED_SAMPLING[key]:
                raise ProtocolError(f"'sampling_params.{key}' = {value!r} is not supported "
                                    f"(only {_FIXED_SAMPLING[key]!r})", param=key)
        elif key in _UNSUPPORTED_SAMPLING:
            if value is not None:
                raise ProtocolError(f"'sampling_params.{key}' is not supported", param=key)
        else:
            raise ProtocolError(f"unknown sampling parameter {key!r} (accepted: "
                                f"{', '.join(sorted(SAMPLING_NAMES))})", param=key)
    guided = [k for k in ("json_schema", "regex", "ebnf") if fields.get(k) is not None]
    if len(guided) > 1:
        raise ProtocolError(f"give one of json_schema, regex and ebnf, not {guided}",
                            param=guided[1])
    door_max: int | None = DEFAULT_MAX_NEW_TOKENS
    if "max_new_tokens" in fields and fields["max_new_tokens"] is None:
        door_max = None          # fill the context (capped by the model's own max_tokens)
    try:
        return sampling_params_from(mapped, defaults=under_door_defaults(
            defaults, {"max_tokens": door_max}))
    except ProtocolError as exc:             # named as the request named it
        theirs = _SGLANG_NAME.get(exc.param or "")
        if theirs is None:
            raise
        raise ProtocolError(re.sub(rf"\b{exc.param}\b", theirs, str(exc), count=1),
                            code=exc.code, param=theirs) from None


def _flag(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be a boolean", param=name)
    return value


def _top_logprobs_num(value: Any) -> int:
    if value is None:
        return 0
    if not is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise ProtocolError(f"'top_logprobs_num' must be an integer >= 0 and at most "
                            f"{MAX_LOGPROBS}", param="top_logprobs_num")
    return value


def parse_generate(body: Any, sampling_defaults: dict[str, Any] | None = None,
                   check_lora: Callable[[str], None] | None = None) -> GenerateRequest:
    """A ``/generate`` body read and checked whole (a ProtocolError naming the field at fault,
    before anything reaches the engine). `check_lora` refuses an adapter name not served."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    for name in _UNSUPPORTED_TOP:
        if body.get(name) not in (None, False):
            raise ProtocolError(f"'{name}' is not supported", param=name)
    unknown = sorted(k for k in body if k not in _TOP_LEVEL and k not in _UNSUPPORTED_TOP)
    if unknown:
        raise ProtocolError(f"unknown field {unknown[0]!r} (accepted: "
                            f"{', '.join(sorted(_TOP_LEVEL))})", param=unknown[0])
    stream = _flag(body.get("stream"), "stream")
    prompts, batched = _prompts(body)
    count = len(prompts)
    per = {name: _per_prompt(body, name, count, batched) for name in _PER_PROMPT}
    items = []
    for i, prompt in enumerate(prompts):
        params = _sampling(per["sampling_params"][i], sampling_defaults or {})
        return_logprob = _flag(per["return_logprob"][i], "return_logprob")
        start = per["logprob_start_len"][i]
        if start is not None and not is_int(start):
            raise ProtocolError("'logprob_start_len' must be an integer",
                                param="logprob_start_len")
        start = -1 if start is None or start < 0 else start
        top = _top_logprobs_num(per["top_logprobs_num"][i])
        if return_logprob:
            params = params.replace(logprobs=top, prompt_logprobs=top if start >= 0 else None)
        rid = per["rid"][i]
        if rid is None:
            rid = uuid.uuid4().hex            # not guessable: abort_request takes ids
        elif not isinstance(rid, str) or not rid:
            raise ProtocolError("'rid' must be a non-empty string", param="rid")
        lora = per["lora_path"][i]
        if lora is not None:
            if not isinstance(lora, str):
                raise ProtocolError("'lora_path' must be a served adapter's name",
                                    param="lora_path")
            if check_lora is not None:
                check_lora(lora)
        items.append(GenerateItem(prompt, params.replace(
            output_kind="cumulative" if stream else "final"), rid, lora, return_logprob, start,
            top, _flag(per["return_text_in_logprobs"][i], "return_text_in_logprobs")))
    if len({it.params.n for it in items}) > 1:
        raise ProtocolError("every prompt of a batch takes the same 'n'", param="n")
    if len({it.rid for it in items}) < len(items):
        raise ProtocolError("the request ids of a batch must differ", param="rid")
    return GenerateRequest(items, batched, stream)


# -- the answer --------------------------------------------------------------------------------

def finish_reason(completion: Any, length: int) -> dict[str, Any] | None:
    """SGLang's finish reason object of a CompletionOutput (None while it runs)."""
    reason = completion.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "stop":
        matched = completion.stop_reason
        if matched is None and completion.token_ids:
            matched = completion.token_ids[-1]            # EOS (kept in output_ids)
        return {"type": "stop", "matched": matched}
    if reason == "abort":
        return {"type": "abort", "message": "the request was aborted"}
    return {"type": reason}


def _triple(logprob: float | None, token_id: int, text: Callable[[int], str] | None) -> list:
    return [None if logprob is None else wire_logprob(logprob), token_id,
            text(token_id) if text is not None else None]


def _tops(entry: Any, text: Callable[[int], str] | None) -> list[list]:
    return [_triple(lp, t, text) for t, lp in entry.top]


def logprob_fields(item: GenerateItem, completion: Any, prompt_ids: Sequence[int],
                   prompt_logprobs: Sequence[Any] | None,
                   text: Callable[[int], str] | None) -> dict[str, Any]:
    """meta_info's logprob lists of one sample (empty unless `item.return_logprob`);
    `text(token_id)` names tokens when ``return_text_in_logprobs`` asked for it."""
    if not item.return_logprob:
        return {}
    text = text if item.return_text_in_logprobs else None
    entries = completion.logprobs or []
    out: dict[str, Any] = {
        "output_token_logprobs": [_triple(e.logprob, e.token_id, text) for e in entries]}
    if item.top_logprobs_num > 0:
        out["output_top_logprobs"] = [_tops(e, text) for e in entries]
    if item.logprob_start_len >= 0:
        positions = range(min(item.logprob_start_len, len(prompt_ids)), len(prompt_ids))
        given = prompt_logprobs or []
        got = [given[k] if k < len(given) else None for k in positions]
        out["input_token_logprobs"] = [_triple(None if e is None else e.logprob,
                                               prompt_ids[k], text)
                                       for k, e in zip(positions, got)]
        if item.top_logprobs_num > 0:
            out["input_top_logprobs"] = [None if e is None else _tops(e, text) for e in got]
    return out


def answer_item(item: GenerateItem, output: Any, completion: Any, *, weight_version: int,
                e2e_latency: float, text: Callable[[int], str] | None) -> dict[str, Any]:
    """One sample's ``{"text", "output_ids", "meta_info"}`` from the engine's RequestOutput
    `output` and its CompletionOutput `completion` (cumulative: everything so far)."""
    ids = list(completion.token_ids)
    meta = {"id": output.request_id, "finish_reason": finish_reason(completion, len(ids)),
            "prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(ids),
            "cached_tokens": output.num_cached_tokens or 0,
            "weight_version": str(weight_version), "e2e_latency": round(e2e_latency, 6)}
    meta.update(logprob_fields(item, completion, output.prompt_token_ids,
                               output.prompt_logprobs, text))
    return {"text": completion.text, "output_ids": ids, "meta_info": meta}
