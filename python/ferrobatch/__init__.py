"""ferrobatch: a continuous-batching LLM serving engine (Rust scheduler, torch model, paged KV).

    from ferrobatch import LLM, SamplingParams
    llm = LLM(model="smollm2")
    print(llm.generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from __future__ import annotations

import os as _os
import sys as _sys
from typing import Any

# CPU serving: after every parallel region torch's OpenMP (libgomp) workers spin for ~300k
# iterations before sleeping, stealing the cores the Rust attention threads and the asyncio
# thread need between torch ops (measured: the CPU decode kernel 38 -> 22 ms per 16-row step).
# A short spin instead; libgomp reads it when torch loads, and a value set by the user wins.
if "torch" not in _sys.modules:
    _os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from ferrobatch.config import EngineConfig
from ferrobatch.lora_request import LoRARequest
from ferrobatch.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprob
from ferrobatch.pooling_params import PoolingParams
from ferrobatch.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "SamplingParams", "EngineConfig", "RequestOutput",
           "CompletionOutput", "TokenLogprob", "Logprob", "BeamSearchParams", "PoolingParams",
           "LoRARequest", "__version__"]

_LAZY = {"LLM": "ferrobatch.engine.llm", "AsyncEngine": "ferrobatch.engine.async_engine",
         "BeamSearchParams": "ferrobatch.engine.beam_search"}


def __getattr__(name: str) -> Any:
    # The engine pulls in torch and the native scheduler: import it only when asked for.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ferrobatch' has no attribute {name!r}")
