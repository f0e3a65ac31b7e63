"""A GGUF model loaded with ``gguf_blocks=True`` (what the engine does on a CPU that packs
weights): the linear layers in block formats are never dequantized; the model holds their blocks
and a ModelRunner packs them for the block kernels, or dequantizes them when it does not pack.

The oracle is the float32 path: the blocks must be exactly those the runner would otherwise
read back from the file and prove against the dequantized weights
(``block_weights_for_modules``), the weights made from them equal the dequantized ones bit for
bit, and greedy tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch
from gguf_tiny import write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model
from test_granite import TINY_GRANITE
from test_kquants import TINY_256, q4_k_m
from test_phi3 import TINY_PHI3

from ferrobatch.model.block_weights import (
    block_weights_for_modules,
    materialize_block_linears,
    read_block_weights,
)
from ferrobatch.model.loader import load_model
from ferrobatch.model.quantized_embedding import QuantizedEmbedding
from ferrobatch.runtime.cpu_linear import PanelLinear, pack_linear_layers
from ferrobatch.runtime.model_runner import ModelRunner

TINY_LLAMA_256 = {**TINY_256, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                  "tie_word_embeddings": True}


def _no_v_blocks(name: str) -> str | None:
    """Q4_K but for layer 1's v (float32): that layer's q / k / v module is dequantized whole."""
    return None if name == "blk.1.attn_v.weight" else "Q4_K"


def _q5_k_m(name: str) -> str:
    """Q5_K_M in two layers: layer 0's v and down and the output Q6_K, the rest Q5_K."""
    if name == "output.weight" or (name.startswith("blk.0.") and (
            ".attn_v." in name or ".ffn_down." in name)):
        return "Q6_K"
    return "Q5_K"


def granite_keys(writer) -> None:
    writer.add_embedding_scale(6.0)
    writer.add_residual_scale(0.3)
    writer.add_logit_scale(4.0)
    writer.add_attention_scale(0.1)


# name -> (config, arch, write_tiny_gguf keywords, modules expected as blocks)
_ALL = [f"layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                      "mlp.gate_up_proj", "mlp.down_proj")]
CASES = {
    # Qwen2 (q / k / v biases), llama.cpp's Q4_K_M mix: fused modules of mixed formats
    "qwen2-q4_k_m": (TINY_256, "qwen2", {"linear_types": q4_k_m}, _ALL + ["lm_head"]),
    # llama.cpp's Q5_K_M mix: Q5_K, with Q6_K v / down in layer 0 (a fused q / k / v of both
    # types made in one pass) and a Q6_K output
    "qwen2-q5_k_m": (TINY_256, "qwen2", {"linear_types": _q5_k_m}, _ALL + ["lm_head"]),
    # Llama: Q / K rows permuted in the file; a tied Q4_K embedding is the LM head's blocks;
    # one module only partly in blocks
    "llama-tied-q4_k": (TINY_LLAMA_256, "llama", {"linear_types": _no_v_blocks,
                                                  "embedding_type": "Q4_K"},
                        [m for m in _ALL if m != "layers.1.self_attn.qkv_proj"] + ["lm_head"]),
    # Phi-3: fused attn_qkv / ffn_up blocks
    "phi3-q8_0": (TINY_PHI3, "phi3", {"q8_0_linears": True}, _ALL + ["lm_head"]),
    # Granite: o / down are scaled by the folded residual multiplier, so they stay float32
    "granite-q8_0": ({**TINY_GRANITE, "tie_word_embeddings": False}, "granite",
                     {"q8_0_linears": True, "metadata": granite_keys},
                     [m for m in _ALL if "o_proj" not in m and "down_proj" not in m]
                     + ["lm_head"]),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    cfg, arch, keywords, expected = CASES[request.param]
    reference = random_hf_model(cfg, seed=41, std=0.1)
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    write_tiny_gguf(path, reference, cfg, arch, **keywords)
    return str(path), reference, expected


def test_the_blocks_are_those_the_float32_path_proves_and_make_the_same_weights(case):
    path, _, expected = case
    dense = load_model(path)
    proven = block_weights_for_modules(dense.model, read_block_weights(path, dense.config))
    loaded = load_model(path, gguf_blocks=True)
    blocks = loaded.model.gguf_block_weights
    assert sorted(blocks) == sorted(proven) == sorted(expected)
    for name, weight in blocks.items():
        want = proven[name]
        assert weight.type_id == want.type_id, name
        assert torch.equal(weight.scale, want.scale) and torch.equal(weight.qs, want.qs), name
        assert (weight.minimum is None) == (want.minimum is None), name
        assert weight.minimum is None or torch.equal(weight.minimum, want.minimum), name
    unmade = {name for name, p in loaded.model.named_parameters() if p.is_meta}
    assert unmade == {f"{m}.weight" for m in blocks
                      if m != "lm_head" or not loaded.config.tie_word_embeddings}
    # a tied table kept in its format (quantized_embedding) is the head's matrix: made too
    tied_table = loaded.config.tie_word_embeddings and \
        isinstance(loaded.model.embed_tokens, QuantizedEmbedding)
    assert materialize_block_linears(loaded.model, blocks) == len(unmade) + tied_table
    made = dict(loaded.model.named_parameters())
    for name, param in dense.model.named_parameters():
        assert torch.equal(made[name], param), name


def test_a_runner_packs_the_blocks_alone_and_matches_transformers(case):
    path, reference, expected = case
    loaded = load_model(path, gguf_blocks=True)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert loaded.model.gguf_block_weights is None        # taken by the runner
    assert "GGUF blocks" in runner.linear_kernels
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    assert not any(t.is_meta for t in tensors)
    layers = {name: m for name, m in loaded.model.named_modules() if isinstance(m, PanelLinear)}
    head = loaded.model.packed_lm_head
    for name in expected:
        layer = head if name == "lm_head" else layers[name]
        assert layer.blocks is not None and layer.packed_weight.numel() == 0, name
        packed = layer.blocks.qpanels if layer.blocks.tiles is None else layer.blocks.tiles
        assert packed.ctypes.data % 64 == 0, name   # whole 64-byte records (AMX: tiles)
        assert layer.blocks.panels_alone == (layer.blocks.kind == "q8_g16"), name
    if path.endswith("qwen2-q5_k_m.gguf"):
        # Q6_K alone (layer 0's down, the output) packs without minimums; layer 0's q / k / v
        # (Q5_K q / k, Q6_K v) keeps them
        kinds = {name: (head if name == "lm_head" else layers[name]).blocks.panel_kind
                 for name in ("lm_head", "layers.0.mlp.down_proj", "layers.0.self_attn.qkv_proj",
                              "layers.1.mlp.down_proj")}
        assert kinds == {"lm_head": "q8_s16", "layers.0.mlp.down_proj": "q8_s16",
                         "layers.0.self_attn.qkv_proj": "q8_g16",
                         "layers.1.mlp.down_proj": "q8_g16"}
    assert_greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6, runner=runner)


def test_a_runner_that_does_not_pack_dequantizes_the_blocks(tmp_path):
    cfg, arch, keywords, _ = CASES["qwen2-q4_k_m"]
    reference = random_hf_model(cfg, seed=42, std=0.1)
    path = tmp_path / "q4_k_m.gguf"
    write_tiny_gguf(path, reference, cfg, arch, **keywords)
    loaded = load_model(str(path), gguf_blocks=True)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4, pack_weights=False)
    assert runner.linear_kernels == "torch" and loaded.model.gguf_block_weights is None
    dense = dict(load_model(str(path)).model.named_parameters())
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, dense[name]), name
    assert_greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6, runner=runner)


def test_only_cpu_float32_loads_leave_weights_as_blocks(case):
    path = case[0]
    loaded = load_model(path, gguf_blocks=True, dtype=torch.bfloat16)
    assert loaded.model.gguf_block_weights is None
    assert not any(p.is_meta for p in loaded.model.parameters())


def test_a_weight_neither_loaded_nor_in_blocks_is_refused(case):
    loaded = load_model(case[0], gguf_blocks=True)
    blocks = loaded.model.gguf_block_weights
    del blocks["layers.0.mlp.gate_up_proj"]
    with pytest.raises(ValueError, match="layers.0.mlp.gate_up_proj: the weight was never loaded"):
        pack_linear_layers(loaded.model, 1, blocks)


def test_the_engine_loads_a_gguf_s_linears_as_blocks_on_the_cpu(case, monkeypatch):
    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.core import EngineCore
    from ferrobatch.model import gguf_loader

    def refused(*args, **kwargs):
        raise AssertionError("the engine dequantized the whole GGUF")

    monkeypatch.setattr(gguf_loader, "load_gguf", refused)
    core = EngineCore.build(EngineConfig(model=case[0], device="cpu", num_blocks=16))
    assert "GGUF blocks" in core.runner.linear_kernels
    with pytest.raises(AssertionError, match="dequantized the whole GGUF"):
        EngineCore.build(EngineConfig(model=case[0], device="cpu", num_blocks=16,
                                      gguf_blocks=False))
