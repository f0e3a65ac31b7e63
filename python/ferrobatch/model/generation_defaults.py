"""The model's own sampling defaults (vLLM's ``--generation-config``): what its authors ship in
``generation_config.json`` (a Hugging Face directory) or in a GGUF file's
``general.sampling.*`` keys, used for every field a request leaves unset.

Read from Hugging Face: ``temperature``, ``top_k``, ``top_p``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``). From GGUF:
``general.sampling.temp`` / ``top_k`` / ``top_p`` / ``min_p``; llama.cpp's ``penalty_repeat`` is
not read (it counts only the last ``penalty_last_n`` tokens; ``repetition_penalty`` counts all).

The model's ``max_tokens`` is not a field default: it caps the requests that fill the context
(``max_tokens`` None), so a long prompt is never refused for it (``under_door_defaults``).

``generation_config``: "auto" (the model's own; nothing for ``random:`` shapes), "vllm" (none:
the engine's built-in defaults), or a directory holding a ``generation_config.json`` (or that
file). ``override`` (vLLM's ``--override-generation-config``) sets fields on top. A value in the
model's files that a request could not carry (out of range) is skipped with a warning; one in
``override`` is an error.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("ferrobatch.model")

# generation_config.json key -> SamplingParams field
HF_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata key -> SamplingParams field
GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
               "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p"}
SETTINGS = ("auto", "vllm")
OVERRIDABLE = frozenset(HF_FIELDS.values())


def check_setting(setting: Any, override: Any) -> None:
    """ValueError for a `generation_config` that is neither a setting nor an existing path, or
    an `override` that names another field or holds a value a request could not carry."""
    if not isinstance(setting, str) or not setting:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got "
                         f"{setting!r}")
    if setting not in SETTINGS and not os.path.exists(os.path.expanduser(setting)):
        raise ValueError(f"generation_config {setting!r} is neither 'auto', 'vllm' nor an "
                         f"existing directory or generation_config.json")
    if override is None:
        return
    if not isinstance(override, Mapping):
        raise ValueError("override_generation_config must be a map of sampling fields")
    unknown = sorted(str(k) for k in override if k not in OVERRIDABLE)
    if unknown:
        raise ValueError(f"override_generation_config: unknown field(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(OVERRIDABLE))})")
    _usable(dict(override), strict=True)


def resolve(source: str, setting: str = "auto",
            override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The sampling fields requests default to: the model's (from `source`, the loaded model's
    path, per `setting`), then `override`'s."""
    if setting == "vllm":
        found: dict[str, Any] = {}
    elif setting == "auto":
        found = read_model_defaults(source)
    else:
        found = _from_hf_json(_json_path(os.path.expanduser(setting)))
    found = _usable(found, strict=False)
    return {**found, **_usable(dict(override or {}), strict=True)}


def under_door_defaults(model: Mapping[str, Any], door: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults of a request on a door (``sampling_params_from``'s `defaults`): the door's
    own (completions' ``max_tokens`` 16, chat's None = fill the context) over the model's
    sampling fields. The model's ``max_tokens`` is not among them: it caps the requests that
    fill the context (``max_tokens=None``) when the engine accepts them, so that a long prompt
    is never refused for it (``AsyncEngine.add_request``)."""
    return {**{k: v for k, v in model.items() if k != "max_tokens"}, **door}


def read_model_defaults(source: str) -> dict[str, Any]:
    """The raw sampling defaults a model's files ship (``{}`` when none, or for a random shape)."""
    if os.path.isdir(source):
        return _from_hf_json(_json_path(source))
    if os.path.isfile(source) and source.endswith(".gguf"):
        stat = os.stat(source)
        return dict(_gguf_defaults(source, stat.st_mtime_ns, stat.st_size))
    return {}


@functools.lru_cache(maxsize=8)
def _gguf_defaults(path: str, mtime_ns: int, size: int) -> tuple[tuple[str, Any], ...]:
    """A GGUF file's sampling keys, read once per version of the file (its header takes ~0.1 s
    to parse, and every engine started on the file asks)."""
    from ferrobatch.model.gguf_file import GGUFFile
    metadata = GGUFFile(path).metadata
    return tuple((name, metadata[key]) for key, name in GGUF_FIELDS.items()
                 if metadata.get(key) is not None)


def _json_path(path: str) -> str:
    return os.path.join(path, "generation_config.json") if os.path.isdir(path) else path


def _from_hf_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return {name: data[key] for key, name in HF_FIELDS.items() if data.get(key) is not None}


def _usable(fields: dict[str, Any], *, strict: bool) -> dict[str, Any]:
    """The fields a SamplingParams accepts one by one (numpy scalars as Python numbers); a
    refused one is an error (`strict`) or skipped with a warning."""
    from ferrobatch.sampling_params import SamplingParams
    out = {}
    for name, value in fields.items():
        if hasattr(value, "item"):
            value = value.item()
        if name == "top_k" and value == -1:
            value = 0
        try:
            SamplingParams(**{name: value, **({"min_tokens": 0} if name == "max_tokens" else {})})
        except (TypeError, ValueError) as exc:
            if strict:
                raise ValueError(f"override_generation_config: {exc}") from None
            logger.warning("the model's default %s=%r is not usable (%s): ignored", name, value,
                           exc)
            continue
        out[name] = value
    return out
