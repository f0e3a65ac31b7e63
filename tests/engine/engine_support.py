"""Shared settings of the real-model engine tests (imported by name; conftest is not importable)."""

# A small KV cache and a moderate batch keep the real-model tests quick on two CPU cores.
REAL_ENGINE_OPTIONS = dict(num_blocks=384, max_num_seqs=64, max_num_batched_tokens=512,
                           max_model_len=2048, device="cpu")
