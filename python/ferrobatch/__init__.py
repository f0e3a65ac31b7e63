"""ferrobatch: a continuous-batching LLM serving engine (Rust scheduler, torch model, paged KV)."""

__version__ = "0.1.0"
