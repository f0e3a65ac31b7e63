"""GGUF's k-quants: Q4_K and Q6_K dequantized by torch bit for bit as gguf-py's reference does,
and Q4_K (and Q4_0) linears read by the CPU's 4-bit kernel in the exact form
``scale * q + minimum``: a tiny Q4_K model's greedy tokens equal transformers' on the weights
the blocks hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_tiny import random_blocks, write_tiny_gguf
from hf_tiny import assert_greedy_matches, random_hf_model

from ferrobatch.model.block_weights import Q4_1, BlockWeight, block_weights_for_modules, read_block_weights
from ferrobatch.model.dequant import dequantize_tensor
from ferrobatch.model.loader import load_model
from ferrobatch.runtime.model_runner import ModelRunner


def _random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes in ``type_name``'s block layout with finite, small fp16 factors."""
    return random_blocks(type_name, rows, cols, seed)


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1",
                                       "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS"])
def test_torch_dequantization_equals_gguf_py_bit_for_bit(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    for seed, (rows, cols) in enumerate([(3, 256), (64, 1024), (17, 2816)]):
        raw = _random_blocks(type_name, rows, cols, seed)
        want = dequantize(raw, qtype)
        got = dequantize_tensor(raw, int(qtype), type_name).numpy()
        assert got.shape == (rows, cols) and np.array_equal(got, want)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0"])
def test_4_bit_types_become_the_q4_1_kernels_exact_form(type_name):
    """Their ``scale * q + minimum`` per 32 weights reproduces the dequantized weight bit for
    bit, and the Rust kernel (one row: no weight formed; several rows) computes x W^T."""
    from gguf import GGMLQuantizationType

    from ferrobatch.runtime.cpu_linear import BlockKernel

    qtype = GGMLQuantizationType[type_name]
    raw = _random_blocks(type_name, 48, 512, seed=3)
    weight = dequantize_tensor(raw, int(qtype), type_name)
    blocks = BlockWeight.from_gguf(int(qtype), torch.from_numpy(raw))
    assert blocks.type_id == Q4_1 and blocks.shape == (48, 512)
    assert torch.equal(blocks.dequantize(), weight)
    kernel = BlockKernel(blocks, amx=False, quant_panels=False)
    assert torch.equal(kernel.block_weight().dequantize(), weight)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5):
        x = torch.randn(rows, 512, generator=gen)
        out = torch.empty(rows, 48)
        kernel(x.numpy(), None, out.numpy(), 1)
        torch.testing.assert_close(out, x @ weight.T, rtol=1e-4, atol=1e-4)


# K-quants need rows of whole 256-weight super-blocks: every linear's input width is 256 or 512
TINY_256 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False}


def test_a_q4_k_model_runs_its_linears_on_the_block_kernel_and_matches_transformers(tmp_path):
    reference = random_hf_model(TINY_256, seed=14, std=0.1)
    path = tmp_path / "tiny-q4_k.gguf"
    write_tiny_gguf(path, reference, TINY_256, "qwen2", q4_k_linears=True)
    loaded = load_model(str(path))
    blocks = read_block_weights(str(path), loaded.config)
    assert blocks["model.layers.0.mlp.down_proj.weight"].type_id == Q4_1
    proven = block_weights_for_modules(loaded.model, blocks)
    assert sorted(proven) == sorted(
        [f"layers.{i}.{m}" for i in range(2)
         for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
        + ["lm_head"])
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert "GGUF blocks" in runner.linear_kernels
    assert_greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6, runner=runner)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q3_K", "Q2_K", "IQ4_NL",
                                       "IQ4_XS"])
def test_other_types_become_the_q8_g16_kernels_exact_form(type_name):
    """``scale * q + minimum`` per 16 weights with int8 ``q``: the dequantized weight bit for
    bit; the Rust kernel's x W^T for 1..8 rows, and each weight exactly (one-hot rows); the
    quantized panels, kept alone by default, for every step, and the blocks unpacked from them
    exactly (40 features: a partial panel)."""
    from gguf import GGMLQuantizationType

    from ferrobatch.model.block_weights import Q8_G16
    from ferrobatch.runtime.cpu_linear import BlockKernel

    qtype = GGMLQuantizationType[type_name]
    raw = _random_blocks(type_name, 40, 512, seed=4)
    weight = dequantize_tensor(raw, int(qtype), type_name)
    blocks = BlockWeight.from_gguf(int(qtype), torch.from_numpy(raw))
    assert blocks.type_id == Q8_G16 and blocks.shape == (40, 512)
    assert torch.equal(blocks.dequantize(), weight)
    kernel = BlockKernel(blocks)
    assert kernel.kind == "q8_g16" and kernel.tiles is None and kernel.qpanels is not None
    assert kernel.panels_alone and kernel.arrays is None
    # blocks whose minimums are all +0 (Q6_K's, among others) pack without them: 640-byte
    # records (3 panels of 16 features x 16 blocks of 32 inputs) instead of 768
    no_minimums = not blocks.minimum.view(torch.int32).any()
    assert no_minimums or type_name != "Q6_K"
    assert kernel.panel_kind == ("q8_s16" if no_minimums else "q8_g16")
    assert kernel.qpanels.nbytes == 3 * 16 * (640 if no_minimums else 768)
    unpacked = kernel.block_weight()
    for got, want in ((unpacked.scale, blocks.scale), (unpacked.minimum, blocks.minimum),
                      (unpacked.qs, blocks.qs)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 5, 8, 40):               # the quantized panels: every step size
        x = torch.randn(rows, 512, generator=gen)
        out = torch.empty(rows, 40)
        kernel.panels(x.numpy(), None, out.numpy(), 2)
        torch.testing.assert_close(out, x @ weight.T, rtol=1e-4, atol=1e-4)
    kernel = BlockKernel(blocks, quant_panels=False)     # the blocks' own kernel
    assert not kernel.panels_alone and kernel.qpanels is None
    assert torch.equal(kernel.block_weight().dequantize(), weight)
    for rows in (1, 2, 5, 8):
        x = torch.randn(rows, 512, generator=gen)
        out = torch.empty(rows, 40)
        kernel(x.numpy(), None, out.numpy(), 2)
        torch.testing.assert_close(out, x @ weight.T, rtol=1e-4, atol=1e-4)
    one_hot = torch.eye(512)[:8 * 64:64].contiguous()      # 8 rows, inputs 0, 64, ...
    out = torch.empty(8, 40)
    kernel(one_hot.numpy(), None, out.numpy(), 1)
    assert torch.equal(out, weight[:, :8 * 64:64].T)


def test_a_fused_module_of_mixed_formats_is_stacked_as_q8_g16():
    """Q4_K q and k beside a Q6_K v (llama.cpp's Q4_K_M mix): one Q8_G16 weight whose rows
    are each part's, value for value."""
    from gguf import GGMLQuantizationType as T

    from ferrobatch.model.block_weights import Q8_G16, _concat

    parts, weights = [], []
    for i, name in enumerate(("Q4_K", "Q4_K", "Q6_K", "Q8_0")):
        raw = _random_blocks(name, 8 * (i + 1), 256, seed=10 + i)
        parts.append(BlockWeight.from_gguf(int(T[name]), torch.from_numpy(raw)))
        weights.append(dequantize_tensor(raw, int(T[name]), name))
    fused = _concat(parts)
    assert fused.type_id == Q8_G16 and fused.shape == (80, 256)
    assert torch.equal(fused.dequantize(), torch.cat(weights))
    assert _concat(parts[:2]).type_id == Q4_1            # one format: its own kernel


def q4_k_m(name: str) -> str:
    """The type of llama.cpp tensor ``name`` in a two-layer Q4_K_M mix: v and down Q6_K in
    layer 0, Q5_K in layer 1 (llama.cpp alternates more bits in some layers), the output Q6_K,
    the rest Q4_K."""
    if name == "output.weight":
        return "Q6_K"
    if ".attn_v." in name or ".ffn_down." in name:
        return "Q6_K" if name.startswith("blk.0.") else "Q5_K"
    return "Q4_K"


def test_a_q4_k_m_mix_model_runs_every_linear_on_a_block_kernel(tmp_path):
    """llama.cpp's Q4_K_M mix (q / k / o / gate / up Q4_K; v and down Q6_K in every other layer,
    Q5_K in the others; the output matrix Q6_K): every module is proven exact on a block
    kernel, the fused ones with a Q6_K part as Q8_G16, and greedy tokens equal transformers'."""
    from ferrobatch.model.block_weights import Q8_G16

    cfg = {**TINY_256, "tie_word_embeddings": False}
    reference = random_hf_model(cfg, seed=16, std=0.1)
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_tiny_gguf(path, reference, cfg, "qwen2", linear_types=q4_k_m)
    loaded = load_model(str(path))
    proven = block_weights_for_modules(loaded.model, read_block_weights(str(path), loaded.config))
    assert len(proven) == 4 * 2 + 1
    assert proven["layers.0.self_attn.qkv_proj"].type_id == Q8_G16
    assert proven["layers.0.mlp.gate_up_proj"].type_id == Q4_1
    assert proven["lm_head"].type_id == Q8_G16
    assert_greedy_matches(loaded, reference, [list(range(3, 40)), [5, 9, 11]], 6)
