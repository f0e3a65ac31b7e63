"""GGUF blocks on the CPU decode path: every linear of the shipped SmolLM2 is found as blocks that
reproduce its float32 weight bit for bit, small steps read them and larger ones the blocks
packed as quantized panels (or, where the CPU has AMX, as AMX tiles; or the float32 panels), and
greedy decoding through them still matches transformers token for token."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from parity_data import NUM_NEW_TOKENS
from step_builder import ToyScheduler

from ferrobatch.model.block_weights import (
    Q4_1,
    Q8_0,
    BlockWeight,
    block_weights_for_modules,
    read_block_weights,
)
from ferrobatch.model.loader import load_model
from ferrobatch.runtime.cpu_linear import (
    AMX_MIN_ROWS,
    QUANT_MAX_ROWS,
    TILES_ALONE_MIN_INPUTS,
    BlockKernel,
    PanelLinear,
    amx_min_rows,
    pack_linear_layers,
    quant_panels_min_rows,
)
from ferrobatch.runtime.model_runner import ModelRunner
from ferrobatch.runtime.sampler import Sampler


@pytest.fixture(scope="module")
def fresh_smollm2():
    """A private copy: the session's shared model is packed already (no float32 weights left)."""
    return load_model("smollm2")


@pytest.fixture(scope="module")
def gguf_blocks(fresh_smollm2):
    return read_block_weights(fresh_smollm2.source, fresh_smollm2.config)


def test_every_linear_of_smollm2_is_found_and_proven_exact(fresh_smollm2, gguf_blocks):
    cfg = fresh_smollm2.config
    types = {name.split(".")[-2]: b.type_id for name, b in gguf_blocks.items()}
    assert types["q_proj"] == types["down_proj"] == Q4_1
    assert gguf_blocks["model.embed_tokens.weight"].type_id == Q8_0
    modules = block_weights_for_modules(fresh_smollm2.model, gguf_blocks)
    assert len(modules) == 4 * cfg.num_layers + 1 and "lm_head" in modules
    qkv = modules["layers.0.self_attn.qkv_proj"]
    assert qkv.shape == tuple(fresh_smollm2.model.layers[0].self_attn.qkv_proj.weight.shape)


def test_a_block_that_does_not_reproduce_its_weight_is_left_out(fresh_smollm2, gguf_blocks):
    """The exactness proof is real: one changed nibble (or the Q rows left in llama.cpp's
    order) and that module keeps the float32 panels only."""
    changed = dict(gguf_blocks)
    down = gguf_blocks["model.layers.2.mlp.down_proj.weight"]
    qs = down.qs.clone()
    qs[5, 3, 3] ^= 0x01
    changed["model.layers.2.mlp.down_proj.weight"] = BlockWeight(down.type_id, down.scale, qs,
                                                                 down.minimum)
    q = gguf_blocks["model.layers.4.self_attn.q_proj.weight"]
    changed["model.layers.4.self_attn.q_proj.weight"] = q.rows_permuted(lambda t: t.flip(0))
    modules = block_weights_for_modules(fresh_smollm2.model, changed)
    assert "layers.2.mlp.down_proj" not in modules
    assert "layers.4.self_attn.qkv_proj" not in modules
    assert len(modules) == 4 * fresh_smollm2.config.num_layers + 1 - 2


def _counted(kernel: BlockKernel, attr: str) -> list[int]:
    """Rows of every call of the Rust function ``kernel.<attr>`` (wrapped on the instance)."""
    calls: list[int] = []
    inner = getattr(kernel, attr)
    setattr(kernel, attr, lambda *a: (calls.append(a[0].shape[0]), inner(*a)))
    return calls


@pytest.mark.parametrize("mode", ["panels", "quant-panels", "amx"])
def test_small_steps_read_the_blocks_and_agree_with_the_panels(fresh_smollm2, gguf_blocks, mode):
    """Steps of <= 8 rows read the blocks and larger ones the float32 panels; with quantized
    panels, steps of >= 6 rows read those instead, bit for bit what the float32 panels give;
    where the CPU has AMX, steps of >= amx_min_rows rows read the blocks' AMX tiles. (The float32 panels
    are zeroed in the last two modes, to prove that no step reads them.)"""
    from ferrobatch._scheduler import amx_available
    amx = mode == "amx"
    if amx and not amx_available():
        pytest.skip("this CPU has no AMX (or FERROBATCH_CPU_ISA caps it)")
    modules = block_weights_for_modules(fresh_smollm2.model, gguf_blocks)
    for path in ("layers.1.mlp.gate_up_proj", "lm_head"):
        dense = (fresh_smollm2.model.lm_head_weight if path == "lm_head"
                 else fresh_smollm2.model.get_submodule(path).weight)
        plain = PanelLinear(dense, num_threads=2)       # float32 panels only
        layer = PanelLinear(dense, num_threads=2)
        layer.blocks = BlockKernel(modules[path], amx=amx, quant_panels=mode == "quant-panels")
        assert (layer.blocks.tiles is not None) == amx
        assert (layer.blocks.qpanels is not None) == (mode == "quant-panels")
        if mode != "panels":
            layer.packed_weight.zero_()
            packed = layer.blocks.tiles if amx else layer.blocks.qpanels
            assert packed.ctypes.data % 64 == 0
        small = _counted(layer.blocks, "_fn")
        large = None if mode == "panels" else \
            _counted(layer.blocks, "_panels" if mode == "quant-panels" else "_amx")
        sizes = [*range(1, QUANT_MAX_ROWS + 3), 17, 40]
        for rows in sizes:
            x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
            got = layer(x)
            want = x.double() @ dense.double().T
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
            if mode == "quant-panels" and rows >= quant_panels_min_rows():
                assert torch.equal(got, plain(x))   # the same floats, bit for bit
        # AMX from amx_min_rows(in_features) rows (SmolLM2's 576 inputs: AMX_MIN_ROWS), quantized
        # panels from quant_panels_min_rows(); otherwise the blocks up to QUANT_MAX_ROWS, then the
        # float32 panels
        if amx:
            assert layer.blocks.amx_min_rows == amx_min_rows(576) == AMX_MIN_ROWS
        last_block_rows = {"panels": QUANT_MAX_ROWS, "quant-panels": quant_panels_min_rows() - 1,
                           "amx": AMX_MIN_ROWS - 1}[mode]
        assert small == list(range(1, last_block_rows + 1))
        if large is not None:
            assert large == sizes[last_block_rows:]


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_layers_with_longer_rows_take_the_amx_tiles_from_fewer_rows(kind):
    """The crossover from the blocks to the AMX tiles depends on the layer's inputs
    (cpu_amx_linear.rs min_rows): 4 rows below 2048 inputs, 3 from 2048. Every step
    size still agrees with the dense weights."""
    from ferrobatch._scheduler import amx_available
    if not amx_available():
        pytest.skip("this CPU has no AMX (or FERROBATCH_CPU_ISA caps it)")
    assert [amx_min_rows(k) for k in (32, 576, 2047, 2048, 4095, 4096, 14336)] == \
        [4, 4, 4, 3, 3, 3, 3]
    gen = torch.Generator().manual_seed(5)
    for k, first_amx in ((576, 4), (2048, 3), (4096, 3)):
        n, nb = 40, k // 32
        scale = torch.rand(n, nb, generator=gen) * 0.01
        if kind == "q8_0":
            weight = BlockWeight(Q8_0, scale, torch.randint(-128, 128, (n, nb, 32), generator=gen,
                                                            dtype=torch.int8))
        else:
            weight = BlockWeight(Q4_1, scale, torch.randint(0, 256, (n, nb, 16), generator=gen,
                                                            dtype=torch.uint8),
                                 -torch.rand(n, nb, generator=gen) * 0.05)
        layer = PanelLinear.from_blocks(BlockKernel(weight, amx=True, quant_panels=False))
        assert layer.blocks.amx_min_rows == first_amx
        assert f"amx tiles{' alone' if k >= TILES_ALONE_MIN_INPUTS else ''} (rows >= {first_amx}" \
            in repr(layer)
        # (the 4096-input layer keeps its tiles alone: its small steps read them without tile
        # instructions)
        small = _counted(layer.blocks, "_tile_rows" if layer.blocks.tiles_alone else "_fn")
        large = _counted(layer.blocks, "_amx")
        dense = weight.dequantize().double()
        for rows in range(1, QUANT_MAX_ROWS + 1):
            x = torch.randn(rows, k, generator=gen)
            torch.testing.assert_close(layer(x).double(), x.double() @ dense.T, rtol=1e-5,
                                       atol=1e-4)
        assert small == list(range(1, first_amx))
        assert large == list(range(first_amx, QUANT_MAX_ROWS + 1))


def _random_blocks(kind: str, n: int, k: int, gen) -> BlockWeight:
    nb, scale = k // 32, torch.rand(n, k // 32, generator=gen) * 0.01
    if kind == "q8_0":
        return BlockWeight(Q8_0, scale, torch.randint(-128, 128, (n, nb, 32), generator=gen,
                                                      dtype=torch.int8))
    return BlockWeight(Q4_1, scale, torch.randint(0, 256, (n, nb, 16), generator=gen,
                                                  dtype=torch.uint8),
                       -torch.rand(n, nb, generator=gen) * 0.05)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_wide_layers_keep_their_amx_tiles_alone(kind):
    """Layers of TILES_ALONE_MIN_INPUTS inputs or more keep no blocks beside their AMX tiles:
    steps below amx_min_rows read the tiles through linear_tile_rows_f32, larger ones through the
    tile instructions, and the blocks come back from the tiles value for value."""
    from ferrobatch._scheduler import amx_available
    if not amx_available():
        pytest.skip("this CPU has no AMX (or FERROBATCH_CPU_ISA caps it)")
    gen = torch.Generator().manual_seed(9)
    narrow = BlockKernel(_random_blocks(kind, 40, 2048, gen), amx=True, quant_panels=False)
    assert narrow.arrays is not None and not narrow.tiles_alone
    k = TILES_ALONE_MIN_INPUTS
    weight = _random_blocks(kind, 40, k, gen)
    kernel = BlockKernel(weight, amx=True, quant_panels=False)
    assert kernel.tiles_alone and kernel.arrays is None and not kernel.panels_alone
    back = kernel.block_weight()
    assert back.type_id == weight.type_id
    for name in ("scale", "qs", "minimum"):
        a, b = getattr(back, name), getattr(weight, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert kernel.nbytes == kernel.tiles.nbytes
    layer = PanelLinear.from_blocks(kernel)
    assert layer.covered_without_panels() and layer.packed_weight.numel() == 0
    few, amx = _counted(kernel, "_tile_rows"), _counted(kernel, "_amx")
    dense = weight.dequantize().double()
    sizes = [1, 2, 3, 4, 8, 17]
    for rows in sizes:
        x = torch.randn(rows, k, generator=gen)
        torch.testing.assert_close(layer(x).double(), x.double() @ dense.T, rtol=1e-5, atol=1e-4)
    first_amx = amx_min_rows(k)
    assert few == [r for r in sizes if r < first_amx]
    assert amx == [r for r in sizes if r >= first_amx]
    assert f"{kind} amx tiles alone (rows >= {first_amx} on tile instructions" in repr(layer)
    # a weight update writes float32 panels rebuilt from the tiles' blocks
    new_rows = torch.randn(3, k, generator=gen)
    layer.write_rows(5, new_rows)
    dense = dense.clone()
    dense[5:8] = new_rows.double()
    x = torch.randn(2, k, generator=gen)
    torch.testing.assert_close(layer(x).double(), x.double() @ dense.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (33, 4096)])
def test_blocks_come_back_from_their_amx_tiles(kind, n, k):
    """``_blocks_from_tiles`` inverts ``pack_amx_*``: every integer, scale and minimum, with the
    padding features of the last tile dropped."""
    from ferrobatch import _scheduler
    from ferrobatch.runtime.cpu_linear import _blocks_from_tiles
    gen = torch.Generator().manual_seed(n + k)
    weight = _random_blocks(kind, n, k, gen)
    tiles = getattr(_scheduler, f"pack_amx_{kind}")(*weight.kernel_arrays())
    back = _blocks_from_tiles(tiles, kind, n, k)
    assert torch.equal(back.scale, weight.scale) and torch.equal(back.qs, weight.qs)
    assert (back.minimum is None) == (kind == "q8_0")
    if kind == "q4_1":
        assert torch.equal(back.minimum, weight.minimum)


@pytest.mark.parametrize("cap", ["avx2", "avx512", "portable"])
def test_the_quantized_panels_take_over_at_the_row_count_measured_for_the_isa(cap):
    # the crossover from the blocks to the quantized panels depends on the instruction set the
    # kernels run (cpu_quant_panels.rs min_rows): 4 rows on AVX2, 6 on AVX-512 (and portable)
    code = ("from ferrobatch._scheduler import linear_isa, quant_panels_min_rows; "
            "print(linear_isa(), quant_panels_min_rows())")
    env = {**os.environ, "FERROBATCH_CPU_ISA": cap}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    isa, min_rows = out[0], int(out[1])
    assert isa in {"avx2": ("avx2", "portable"), "avx512": ("avx512", "avx2", "portable"),
                   "portable": ("portable",)}[cap]
    assert min_rows == (4 if isa == "avx2" else 6)
    assert min_rows <= QUANT_MAX_ROWS + 1   # the blocks still cover every smaller step
    if cap == "avx512" and "FERROBATCH_CPU_ISA" not in os.environ:   # uncapped here too
        assert quant_panels_min_rows() == min_rows


@pytest.mark.parametrize("keep_panels", [False, True])
@pytest.mark.parametrize("mode", ["quant-panels", "amx"])
def test_layers_whose_blocks_cover_every_step_release_their_panels(gguf_blocks, mode, keep_panels):
    """Where the blocks (< 5 or < 6 rows) and their AMX tiles or quantized panels (from there)
    cover every step, the float32 panels are released (unless kept), and every step size still
    gets the right result."""
    from ferrobatch._scheduler import amx_available
    if mode == "amx" and not amx_available():
        pytest.skip("this CPU has no AMX (or FERROBATCH_CPU_ISA caps it)")
    loaded = load_model("smollm2")
    dense = {"layers.3.mlp.down_proj": loaded.model.get_submodule("layers.3.mlp.down_proj")
             .weight.clone(), "lm_head": loaded.model.lm_head_weight.clone()}
    modules = block_weights_for_modules(loaded.model, gguf_blocks)
    pack_linear_layers(loaded.model, 2, modules, amx=mode == "amx", keep_panels=keep_panels)
    packed = [m for m in loaded.model.modules() if isinstance(m, PanelLinear)]
    assert len(packed) == 4 * loaded.config.num_layers + 1
    assert all(m.covered_without_panels() for m in packed)
    assert all((m.packed_weight.numel() == 0) != keep_panels for m in packed)
    assert all((m.blocks.qpanels is not None) == (mode == "quant-panels") for m in packed)
    for path, weight in dense.items():
        layer = loaded.model.packed_lm_head if path == "lm_head" else \
            loaded.model.get_submodule(path)
        for rows in (1, 4, 5, 6, 9, 40):
            x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
            want = x.double() @ weight.double().T
            torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-4)
    if not keep_panels:
        assert "packed=none" in repr(packed[0])


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "layer-by-layer"])
def test_greedy_decoding_through_the_blocks_matches_transformers(
        fresh_smollm2, parity_prompts, hf_greedy_outputs, monkeypatch, fused):
    """Each prompt alone (every decode step has one row, so every linear reads its blocks: in
    the fused decode step inside Rust, layer by layer through ``BlockKernel``)."""
    calls = [0]
    original = BlockKernel.__call__

    def counting(self, *args):
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(BlockKernel, "__call__", counting)
    runner = ModelRunner(fresh_smollm2, num_blocks=256, block_size=16, attn_backend="cpu",
                         fused_decode=fused)
    sampler = Sampler(fresh_smollm2.config.vocab_size, fresh_smollm2.tokenizer.eos_token_ids,
                      "cpu")
    for i in (0, 2, len(parity_prompts) - 1):
        sched = ToyScheduler(256, 16, token_budget=512)
        seq = sched.add(i, parity_prompts[i], NUM_NEW_TOKENS)
        while (batch := sched.schedule()) is not None:
            sched.update(sampler.sample(runner.execute(batch), batch).token_ids)
        assert seq.output_ids == hf_greedy_outputs[i], i
    decode_steps = 3 * (NUM_NEW_TOKENS - 1)
    if fused:   # the layers' blocks are read in Rust; the LM head's still through BlockKernel
        assert runner.fused_layers.steps >= decode_steps
        assert calls[0] >= decode_steps
    else:
        assert calls[0] >= decode_steps * (4 * fresh_smollm2.config.num_layers + 1)
