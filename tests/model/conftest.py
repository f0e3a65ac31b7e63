"""Fixtures of the model tests: prompts, the transformers oracle (computed once per session)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step_builder

from parity_data import CHAT_PROMPTS, NUM_NEW_TOKENS, RAW_PROMPTS


@pytest.fixture(scope="session", autouse=True)
def _cpu_threads():
    """One intra-op thread when the CPUs are oversubscribed (OpenMP spin-waits then cost ~8x)."""
    import torch

    previous = torch.get_num_threads()
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    torch.set_num_threads(1 if busy else previous)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer(loaded_smollm2):
    return loaded_smollm2.tokenizer


@pytest.fixture(scope="session")
def parity_prompts(tokenizer) -> list[list[int]]:
    """Token ids of chat-templated and raw prompts (the same ids go to both models)."""
    chat = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}]))
            for c in CHAT_PROMPTS]
    return chat + [tokenizer.encode(r) for r in RAW_PROMPTS]


def _skip_weight_init():
    """transformers' context that skips random init (the weights are overwritten anyway)."""
    import contextlib

    for module_name in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            module = __import__(module_name, fromlist=["no_init_weights"])
            return module.no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


@pytest.fixture(scope="session")
def hf_oracle_model(smollm2_gguf_path):
    """transformers' LlamaForCausalLM with the GGUF weights as transformers itself dequantizes them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, filename = os.path.split(smollm2_gguf_path)
    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=filename)
    with _skip_weight_init():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(smollm2_gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    incompatible = model.load_state_dict(tensors, strict=False)
    assert set(incompatible.missing_keys) <= {"lm_head.weight"}, incompatible
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy_outputs(hf_oracle_model, parity_prompts) -> list[list[int]]:
    """transformers' greedy continuation (NUM_NEW_TOKENS, EOS disabled) of each prompt alone."""
    import torch

    hf_oracle_model.generation_config.eos_token_id = None  # always NUM_NEW_TOKENS tokens
    outputs = []
    with torch.inference_mode():
        for prompt in parity_prompts:
            ids = torch.tensor([prompt])
            out = hf_oracle_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0)
            assert out.shape[1] == len(prompt) + NUM_NEW_TOKENS
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
