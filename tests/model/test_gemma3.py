"""Gemma 3 text models (``gemma3_text``): sliding-window layers with their own RoPE base,
sandwich norms of ``1 + weight``, GeGLU, scaled embeddings, q / k norms. A tiny random
checkpoint written by transformers is the oracle: greedy tokens and logits through every CPU
attention path, with prompts and continuations far longer than the window."""

from __future__ import annotations

import math

import pytest
import torch
from hf_tiny import assert_greedy_matches, random_hf_model

from ferrobatch.model.hf_loader import config_from_hf
from ferrobatch.model.loader import load_model
from ferrobatch.runtime.model_runner import ModelRunner

# gemma-3-270m's layout at a tiny size: five sliding layers of six (the sixth global), a window
# far shorter than the sequences below, an attention scale that is not head_dim's
TINY_GEMMA3 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
               "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 7,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "vocab_size": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
               "sliding_window": 8, "query_pre_attn_scalar": 24, "bos_token_id": 2,
               "eos_token_id": 1, "pad_token_id": 0}

PROMPTS = [list(range(3, 43)), [5, 9, 11], [7] * 20 + list(range(60, 80))]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    reference = random_hf_model(TINY_GEMMA3, seed=41, std=0.3)
    path = tmp_path_factory.mktemp("gemma3")
    reference.save_pretrained(path, safe_serialization=True)
    return path, reference


def test_the_config_maps_every_gemma3_feature(gemma3_dir):
    path, _ = gemma3_dir
    config = load_model(str(path)).config
    assert config.arch == "gemma3" and config.sliding_layers == (0, 1, 2, 3, 4, 6)
    assert config.sliding_window == 8 and config.max_position_embeddings == 256   # not capped
    assert config.local_rope_theta == 10000.0 and config.rope_theta == 1000000.0
    assert config.sandwich_norms and config.qk_norm and config.hidden_act == "gelu_tanh"
    assert config.embedding_scale == 8.0 and config.tie_word_embeddings
    assert config.attention_scale == pytest.approx(24 ** -0.5)


def test_older_configs_name_the_pattern_and_the_local_base_at_the_top():
    cfg = {**TINY_GEMMA3, "sliding_window_pattern": 3, "rope_local_base_freq": 500.0,
           "rope_theta": 20000.0, "hidden_size": 48}
    config = config_from_hf(cfg)
    assert config.sliding_layers == (0, 1, 3, 4, 6)
    assert (config.local_rope_theta, config.rope_theta) == (500.0, 20000.0)
    assert config.embedding_scale == float(torch.tensor(math.sqrt(48), dtype=torch.float32))


@pytest.mark.parametrize("backend", ["cpu", "cpu-modules", "torch"])
@pytest.mark.parametrize("token_budget", [16, 64])
def test_a_gemma3_directory_matches_transformers(gemma3_dir, backend, token_budget,
                                                 monkeypatch):
    """Prompts of up to 40 tokens in chunks of 16 (the later ones past the window of 8) or
    whole, then decode steps to 52 tokens: every greedy token and the last logits; on the CPU
    backend through the fused step or layer by layer (both on the decode and prefill kernels'
    windows), and on the torch reference backend (SDPA with the window's mask)."""
    if backend == "cpu-modules":
        monkeypatch.setenv("FERROBATCH_FUSED_DECODE", "0")
    path, reference = gemma3_dir
    loaded = load_model(str(path))
    runner = ModelRunner(loaded, num_blocks=64, block_size=4,
                         attn_backend=backend.removesuffix("-modules"))
    assert_greedy_matches(loaded, reference, PROMPTS, 12, runner=runner,
                          token_budget=token_budget)
    fused = runner.fused_layers
    assert (fused is not None and fused.steps > 0) == (backend == "cpu")


def test_the_window_matters_here(gemma3_dir):
    """The same checkpoint attended without its windows gives other tokens: the tests above
    would see a window applied wrongly."""
    path, reference = gemma3_dir
    loaded = load_model(str(path))
    for layer in loaded.model.layers:
        layer.self_attn.window = None
    with pytest.raises(AssertionError):
        assert_greedy_matches(loaded, reference, PROMPTS[:1], 12)


def test_a_bfloat16_gemma3_checkpoint_keeps_its_weights_in_16_bits(tmp_path):
    """Norm weights become ``1 + weight`` in float32 (transformers' arithmetic), the linears
    and the tied embedding stay 16-bit on the CPU kernels, the tokens transformers'."""
    import transformers

    random_hf_model(TINY_GEMMA3, seed=42, std=0.3).to(torch.bfloat16).save_pretrained(
        tmp_path, safe_serialization=True)
    # the oracle reads the bfloat16 file in float32 (its RoPE buffers made afresh, not the
    # bfloat16-rounded ones a converted model keeps)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32).eval()
    loaded = load_model(str(tmp_path))
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert loaded.model.layers[0].self_attn.qkv_proj.half is not None
    assert type(loaded.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert_greedy_matches(loaded, reference, PROMPTS[:2], 12, runner=runner)


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "soft-capping"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"model_type": "gemma3"}, "multimodal"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
])
def test_what_is_not_served_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**TINY_GEMMA3, **change})


def test_a_backend_without_windows_is_refused(gemma3_dir):
    from ferrobatch.runtime.attention.base import AttentionBackend
    from ferrobatch.runtime.attention.torch_ref import TorchReferenceBackend

    class NoWindows(TorchReferenceBackend):
        name = "no-windows"
        supports_window = AttentionBackend.supports_window

    path, _ = gemma3_dir
    with pytest.raises(ValueError, match="sliding-window layers"):
        ModelRunner(load_model(str(path)), num_blocks=8, block_size=4,
                    attn_backend=NoWindows(4))


@pytest.mark.parametrize("linears", [None, "Q8_0"])
def test_a_gemma3_gguf_matches_transformers(tmp_path, linears):
    """llama.cpp's gemma3: norms stored as ``1 + weight``, the layer pattern, local RoPE base and
    attention scale as llama.cpp's constants (so the reference's scale is head_dim's); float32
    or Q8_0 linears (the reference takes what the blocks hold)."""
    from gguf_tiny import write_tiny_gguf

    cfg = {**TINY_GEMMA3, "query_pre_attn_scalar": 16}
    reference = random_hf_model(cfg, seed=43, std=0.3)
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gguf(path, reference, cfg, "gemma3", q8_0_linears=linears == "Q8_0")
    loaded = load_model(str(path))
    config = loaded.config
    assert config.arch == "gemma3" and config.sliding_layers == (0, 1, 2, 3, 4, 6)
    assert config.local_rope_theta == 10000.0 and config.embedding_scale == 8.0
    assert_greedy_matches(loaded, reference, PROMPTS, 12)


def test_lora_and_weight_updates_on_gemma3(tmp_path):
    """A trainer's new weights under transformers' names (its norms as ``weight``, kept as
    ``1 + weight`` under the layer's own names) and a LoRA adapter on every projection give
    transformers' tokens."""
    from lora_files import ATTN, MLP, assert_update_and_lora_match_transformers

    assert_update_and_lora_match_transformers(tmp_path, TINY_GEMMA3, ATTN + MLP, (44, 45, 6))


def test_on_a_gpu_auto_picks_a_backend_that_takes_windows(caplog):
    """The CUDA kernels take no window yet: "auto" gives such a model the torch reference (no
    GPU is needed to choose), and says so; models without windows are not affected."""
    from ferrobatch.runtime.attention import get_attention_backend

    with caplog.at_level("WARNING"):
        assert get_attention_backend("auto", "cuda", windows=True).name == "torch"
    assert "sliding window" in caplog.text
    assert get_attention_backend("auto", "cpu", windows=True).name == "cpu"


def test_the_engine_serves_gemma3_with_drafts_chunks_and_a_prefix_cache(tmp_path):
    """Through ``LLM`` as users run it: prompts in chunks of 16 past the window, prompt-lookup
    drafts (repeating prompts: several query rows a sequence, each from its own window start)
    and a second round whose prompts hit the prefix cache; every greedy token transformers'."""
    from ferrobatch import LLM, SamplingParams
    from ferrobatch.model.loader import smollm2_gguf_path

    cfg = {**TINY_GEMMA3, "vocab_size": 49152}    # the borrowed tokenizer's ids fit
    reference = random_hf_model(cfg, seed=46, std=0.3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(model=str(tmp_path), tokenizer=smollm2_gguf_path(), max_num_batched_tokens=16,
              kv_cache_gb=0.02)
    prompts = [[5, 6, 7, 8, 9] * 8, list(range(100, 137)), [40, 41, 42] * 7]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20,
                                   do_sample=False)[0, len(p):].tolist() for p in prompts]
    for round_ in range(2):     # the second round reads the prompts' blocks from the cache
        outs = llm.generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert all((o.num_cached_tokens or 0) > 0 for o in outs) == (round_ == 1)
    assert llm.engine.stats().get("num_draft_tokens_total", 0) > 0     # drafts were verified
