"""LoRARequest: which LoRA adapter a request runs with (vLLM's names and meaning).

An adapter is a Hugging Face PEFT directory (``adapter_config.json`` and
``adapter_model.safetensors``) trained for the served model; ``lora_int_id`` is its identity in
the engine (two requests with the same id share the loaded weights and each other's prefix
cache; requests with other adapters, or none, never share KV blocks with them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``LoRARequest(lora_name, lora_int_id, lora_path)``: an adapter by name, id (>= 1) and
    directory. Raises ValueError for a bad field."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or \
                len(self.lora_name) > 256:
            raise ValueError("lora_name must be a non-empty string of at most 256 characters")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or \
                self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string (the adapter's directory)")
