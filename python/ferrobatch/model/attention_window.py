"""Sliding attention windows on every layer (Mistral 7B v0.1, Phi-3-mini): the fused CPU step
and the CUDA kernels attend to a sequence's whole context, so such a model is served a context
no longer than the window, where the two agree. (Gemma 3's windows, on five layers of six, are
attended as windows: ``LlamaAttention.window``, ``model.gemma3``.)"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def sliding_window_of(cfg: dict[str, Any]) -> int | None:
    """The attention window a ``config.json`` switches on for every layer (Mistral 7B v0.1's
    4096, Phi-3-mini's 2047; Qwen's only with ``use_sliding_window``), or None. Gemma 3's
    windows, on some layers only, are served as windows (``model.gemma3``), not as a cap."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("model_type") == "gemma3_text" or (
            cfg.get("model_type") in ("qwen2", "qwen3", "smollm3")
            and not cfg.get("use_sliding_window", False)):
        return None
    return int(window)


def capped_to_window(context: int, window: int | None, source: str) -> int:
    """The context a model with an attention window serves: at most the window, where every
    token sees all the tokens before it, so full attention is exactly the model's windowed one
    (the kernels attend to the whole context; longer contexts would drift from the model)."""
    if window is None or window >= context:
        return context
    logger.warning("%s attends over a sliding window of %d tokens; serving a context of %d "
                   "tokens (not %d), where full attention equals the window's", source, window,
                   window, context)
    return window
