"""Per-request logits processors (vLLM's ``SamplingParams.logits_processors``): Python callables
that rewrite a sequence's next-token logits before the sampler sees them.

A processor is called once per generated token of each sequence of its request, as
``fn(output_token_ids, logits)`` or ``fn(prompt_token_ids, output_token_ids, logits)``: the
tokens the sequence has generated so far (a list, oldest first; the prompt's too in the second
form) and that sequence's float32 logits row ``[vocab_size]`` on the model's device. It returns
the logits to use (the row itself, changed in place, or a new tensor of the same shape; it
runs under ``torch.inference_mode``). A
request's processors run in order, each on what the one before returned, and before the
sampler's own steps (logit bias, penalties, token restrictions, temperature, top-k/p): a row
the processors set to -inf is never sampled, and logprobs are taken from the processed row.

Engine-wide processors (vLLM's ``--logits-processors``, ``EngineConfig.logits_processors``)
reach requests from every door: each is a *factory* (or the import path of one, ``module:name``)
that the engine asks, per request, for that request's processor: ``factory(params)`` returns a
processor as above, or None for requests it leaves alone. It reads what the request asks of it
from ``params.extra_args`` (the HTTP body's ``vllm_xargs``, vLLM's name). A class is created
once with no arguments; its ``new_req_logits_processor(params)`` is the factory when it has one,
else the instance is called.

A processor that raises, or returns something that is not such a tensor, fails its request
only (finish reason "error", the message names the processor); the step and every other
request go on. Processors run on the engine's step thread, between the model and the sampler:
a slow one slows every request of the batch.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

LogitsProcessor = Callable[..., torch.Tensor]


def processor_arity(fn: Any) -> int:
    """2 for ``fn(output_token_ids, logits)``, 3 for ``fn(prompt_token_ids, output_token_ids,
    logits)``; ValueError for anything else (not callable, or taking another number of
    positional arguments)."""
    if not callable(fn):
        raise ValueError(f"logits_processors must be callables, got {type(fn).__name__}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):     # a builtin without a signature: assume the short form
        return 2
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2 if len(positional) <= 2 else 3
    if len(positional) not in (2, 3):
        raise ValueError(f"logits processor {processor_name(fn)} must take (output_token_ids, "
                         f"logits) or (prompt_token_ids, output_token_ids, logits), it takes "
                         f"{len(positional)} positional argument(s)")
    return len(positional)


def processor_name(fn: Any) -> str:
    """How an error message names a processor: its qualified name, or its class's."""
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


@torch.inference_mode()
def apply_logits_processors(logits: torch.Tensor, batch: Any,
                            extras: Mapping[int, Any]) -> dict[int, str]:
    """Runs, in place on ``logits [S, V]`` (float32), the processors of every sampled row whose
    request has some (``RequestExtras.logits_processors``). Returns ``{request id: message}``
    for the requests whose processor failed, or left a row with a NaN, +inf or no finite logit
    (nothing to sample); their rows are zeroed (their tokens are dropped with the request)."""
    failures: dict[int, str] = {}
    processed: list[int] = []
    req_ids = np.asarray(batch.sample_req_ids).tolist()
    seq_indices = np.asarray(batch.sample_seq_indices).tolist()
    vocab = logits.shape[1]
    for row, (rid, si) in enumerate(zip(req_ids, seq_indices)):
        ext = extras.get(rid)
        if ext is None or not ext.logits_processors or rid in failures:
            continue
        message = _run_row(logits, row, ext.logits_processors, ext.prompt_token_ids,
                           ext.output_token_ids[si], vocab)
        if message:
            failures[rid] = message
        else:
            processed.append(row)
    if processed:       # one read-back for all of them
        rows = logits[torch.tensor(processed, device=logits.device)]
        unusable = (rows.isnan().any(dim=1) | rows.isposinf().any(dim=1)
                    | ~rows.isfinite().any(dim=1)).cpu().tolist()
        for row, bad in zip(processed, unusable):
            if bad and req_ids[row] not in failures:
                failures[req_ids[row]] = ("logits processors left a row with a NaN, +inf or no "
                                          "finite logit: nothing to sample")
    for row, rid in enumerate(req_ids):
        if rid in failures:
            logits[row] = 0.0
    return failures


def _run_row(logits: torch.Tensor, row: int, processors: Sequence[tuple[LogitsProcessor, int]],
             prompt: Sequence[int], history: Sequence[int], vocab: int) -> str:
    """Runs one row's processors in order and stores the result in ``logits[row]``; returns
    '' or what went wrong."""
    current = logits[row]
    for fn, arity in processors:
        try:
            out = fn(list(history), current) if arity == 2 else \
                fn(list(prompt), list(history), current)
        except Exception as exc:        # a user's code: its request fails, the engine goes on
            return f"logits processor {processor_name(fn)} raised {type(exc).__name__}: {exc}"
        problem = _not_a_row(out, vocab)
        if problem:
            return f"logits processor {processor_name(fn)} returned {problem}"
        current = out
    if current.data_ptr() != logits[row].data_ptr():
        try:
            logits[row] = current.to(device=logits.device, dtype=logits.dtype)
        except Exception as exc:        # e.g. a tensor on a device the logits cannot reach
            return (f"logits processor {processor_name(fn)} returned a row that cannot be "
                    f"used: {type(exc).__name__}: {exc}")
    return ""


def _not_a_row(out: Any, vocab: int) -> str:
    """'' when `out` is a logits row of `vocab` floats, else what it is instead."""
    if not isinstance(out, torch.Tensor):
        return f"a {type(out).__name__}, not a torch.Tensor of the logits"
    if tuple(out.shape) != (vocab,):
        return f"a tensor of shape {tuple(out.shape)}, not ({vocab},)"
    if not out.is_floating_point():
        return f"a {out.dtype} tensor, not floating point logits"
    return ""


def checked_processors(fns: Sequence[Any]) -> tuple[tuple[LogitsProcessor, int], ...]:
    """Each processor with its arity (``processor_arity``), in order."""
    return tuple((fn, processor_arity(fn)) for fn in fns)


def resolve_factories(entries: Sequence[Any]) -> tuple[Callable[[Any], Any], ...]:
    """The engine-wide processor factories of `entries` (callables, classes or import paths
    ``package.module:name`` / ``package.module.name``); ValueError naming an entry that cannot
    be imported or called."""
    out = []
    for entry in entries:
        obj = _imported(entry) if isinstance(entry, str) else entry
        if inspect.isclass(obj):
            try:
                obj = obj()
            except Exception as exc:
                raise ValueError(f"logits processor {entry!r}: creating {obj.__qualname__}() "
                                 f"failed: {type(exc).__name__}: {exc}") from None
        factory = getattr(obj, "new_req_logits_processor", obj)
        if not callable(factory):
            raise ValueError(f"logits processor {entry!r} is not a callable factory "
                             f"(params -> processor or None)")
        out.append(factory)
    return tuple(out)


def _imported(path: str) -> Any:
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ValueError(f"logits processor {path!r} is not an import path (package.module:name)")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as exc:
        raise ValueError(f"logits processor {path!r}: cannot import {module!r}: "
                         f"{type(exc).__name__}: {exc}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"logits processor {path!r}: {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def request_processors(params: Any, factories: Sequence[Callable[[Any], Any]]
                       ) -> tuple[tuple[LogitsProcessor, int], ...]:
    """A request's processors with their arities: its own (``params.logits_processors``), then
    what each engine-wide factory gives it. ValueError (the request is refused) when a factory
    raises or gives something that is not a processor."""
    fns = list(params.logits_processors)
    for factory in factories:
        try:
            fn = factory(params)
        except Exception as exc:
            raise ValueError(f"logits processor {processor_name(factory)} refused the request: "
                             f"{type(exc).__name__}: {exc}") from None
        if fn is not None:
            fns.append(fn)
    return checked_processors(fns)
