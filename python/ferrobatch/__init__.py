"""ferrobatch: a continuous-batching LLM serving engine (Rust scheduler, torch model, paged KV).

    from ferrobatch import LLM, SamplingParams
    llm = LLM(model="smollm2")
    print(llm.generate("Hello", SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from __future__ import annotations

from typing import Any

from ferrobatch.config import EngineConfig
from ferrobatch.outputs import CompletionOutput, RequestOutput
from ferrobatch.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "SamplingParams", "EngineConfig", "RequestOutput",
           "CompletionOutput", "__version__"]

_LAZY = {"LLM": "ferrobatch.engine.llm", "AsyncEngine": "ferrobatch.engine.async_engine"}


def __getattr__(name: str) -> Any:
    # The engine pulls in torch and the native scheduler: import it only when asked for.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ferrobatch' has no attribute {name!r}")
