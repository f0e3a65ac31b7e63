"""The engine: step loop thread, AsyncEngine, the synchronous LLM."""

from ferrobatch.engine.async_engine import AsyncEngine, RequestStream
from ferrobatch.engine.errors import EngineDeadError, QueueFullError
from ferrobatch.engine.llm import LLM

__all__ = ["AsyncEngine", "EngineDeadError", "LLM", "QueueFullError", "RequestStream"]
