"""16-bit float panels (`cpu_half_panels.rs`): a checkpoint whose weights bfloat16 or float16
holds exactly keeps them in 16 bits on the CPU, with the float32 panels' outputs bit for bit
(bfloat16 steps of many rows on AMX tiles, `cpu_half_amx.rs`: float32 accuracy, another
summation order)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hf_tiny import assert_greedy_matches, random_hf_model
from step_builder import ToyScheduler, greedy_run
from test_model_loader import TINY_CONFIGS

from ferrobatch import _scheduler
from ferrobatch.model.loader import load_model
from ferrobatch.model.quantized_embedding import QuantizedEmbedding
from ferrobatch.runtime.cpu_linear import PanelLinear, pack_panels
from ferrobatch.runtime.model_runner import ModelRunner

ROUND = {"bf16": torch.bfloat16, "f16": torch.float16}
# the fewest rows of a bfloat16 step on AMX tiles, or None where AMX does not run
AMX_ROWS = _scheduler.half_panels_amx_rows()


def _on_amx(kind: str, rows: int) -> bool:
    return kind == "bf16" and AMX_ROWS is not None and rows >= AMX_ROWS


def _assert_same(got: torch.Tensor, want: torch.Tensor, on_amx: bool) -> None:
    """Bit for bit; on AMX tiles within float32 rounding of the largest value."""
    if on_amx and want.numel():
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    else:
        assert torch.equal(got, want)


def _checkpoint(tmp_path, kind: str | None, name: str = "llama"):
    """A tiny transformers model whose every weight is a ``kind`` value (None: float32 ones),
    saved in that type; the float32 reference model with the same values."""
    reference = random_hf_model(TINY_CONFIGS[name], seed=3)
    saved = copy.deepcopy(reference)
    if kind is not None:
        with torch.no_grad():
            for param in reference.parameters():
                param.copy_(param.to(ROUND[kind]).float())
        saved = copy.deepcopy(reference).to(ROUND[kind])
    saved.save_pretrained(tmp_path, safe_serialization=True)
    return reference


def _linears(loaded) -> list[PanelLinear]:
    return [m for m in loaded.model.modules() if isinstance(m, PanelLinear)]


def _logits(runner, prompts, new_tokens: int = 6) -> list[tuple[int, torch.Tensor]]:
    """Every step's rows and logits of a greedy run of ``prompts`` (prefill chunks of 16, then
    decode)."""
    sched = ToyScheduler(64, 4, token_budget=16)
    for i, prompt in enumerate(prompts):
        sched.add(i, prompt, new_tokens)
    steps = []

    def execute(batch):
        steps.append((int(np.asarray(batch.input_ids).shape[0]), runner.execute(batch).clone()))
        return steps[-1][1]

    greedy_run(runner, sched, execute=execute)
    return steps


@pytest.mark.parametrize("kind, name", [("bf16", "llama"), ("f16", "llama"), ("bf16", "qwen3")])
def test_a_16_bit_checkpoint_takes_16_bit_panels_with_the_float32_panels_logits(
        tmp_path, monkeypatch, kind, name):
    # (qwen3's tiny config ties its LM head to the embedding)
    reference = _checkpoint(tmp_path, kind, name)
    prompts = [list(range(3, 40)), list(range(50, 53)), list(range(7, 27))]
    loaded = load_model(str(tmp_path))
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    linears = _linears(loaded)
    # every linear and the LM head: 16-bit panels alone, half the float32 panels' bytes
    assert linears and all(m.half is not None and m.half[0] == kind for m in linears)
    assert all(m.packed_weight.numel() == 0 for m in linears)
    assert f"{kind} weights as 16-bit panels" in runner.linear_kernels
    # the token embedding too: its 16-bit rows, looked up as the float32 table's
    table = loaded.model.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and table.type_name == kind.upper()
    want = reference.get_input_embeddings().weight.detach()
    assert torch.equal(table.dense_weight(), want)
    assert torch.equal(torch.from_numpy(table.rows(np.array([[5, 0], [127, 5]]))),
                       want[torch.tensor([[5, 0], [127, 5]])])
    assert runner.fused_layers is not None       # decode steps: one Rust call, 16-bit too
    assert_greedy_matches(loaded, reference, prompts[:2], 8, runner=runner)

    monkeypatch.setenv("FERROBATCH_QUANT_PANELS", "0")   # the float32 panels, side by side
    plain = load_model(str(tmp_path))
    plain_runner = ModelRunner(plain, num_blocks=64, block_size=4)
    assert all(m.half is None and m.packed_weight.numel() for m in _linears(plain))
    assert type(plain.model.embed_tokens) is torch.nn.Embedding
    ours, theirs = _logits(runner, prompts), _logits(plain_runner, prompts)
    assert len(ours) == len(theirs) > 3
    # bit for bit until a step on AMX tiles (whose K / V later steps read), then close
    amx = False
    for (rows, a), (_, b) in zip(ours, theirs):
        amx = amx or _on_amx(kind, rows)
        _assert_same(a, b, amx)


def test_a_float32_checkpoint_keeps_its_float32_panels(tmp_path):
    _checkpoint(tmp_path, None)
    loaded = load_model(str(tmp_path))
    runner = ModelRunner(loaded, num_blocks=16, block_size=4)
    assert all(m.half is None and m.packed_weight.numel() for m in _linears(loaded))
    assert "16-bit" not in runner.linear_kernels
    assert type(loaded.model.embed_tokens) is torch.nn.Embedding


def test_layer_forward_and_dense_weight_at_every_row_count():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 96, generator=gen).bfloat16().float()
    bias = torch.randn(70, generator=gen)
    layer = PanelLinear(weight, bias, num_threads=2, half_panels=True)
    assert layer.half[0] == "bf16" and layer.half[1].nbytes == 5 * 3 * 1024
    plain = PanelLinear(weight, bias, num_threads=2)
    assert layer.packed_weight.numel() == 0 and layer.covered_without_panels()
    assert torch.equal(layer.dense_weight(), weight)
    for rows in (1, 2, 5, 8, 15, 17, 64, 300):
        x = torch.randn(rows, 96, generator=gen)
        got, want = layer(x), plain(x)
        _assert_same(got, want, _on_amx("bf16", rows))
        # as close to the exact products as the float32 panels
        exact = x.double() @ weight.double().T + bias.double()
        assert (got - exact).abs().max() <= 2e-6 * exact.abs().max(), rows
    # float16 values bfloat16 cannot hold: float16 panels
    f16 = torch.randn(20, 64, generator=gen).half().float()
    assert torch.equal(PanelLinear(f16, half_panels=True).dense_weight(), f16)
    assert PanelLinear(f16, half_panels=True).half[0] == "f16"
    # neither holds these, or the inputs are not whole blocks of 32: float32 panels only
    assert PanelLinear(torch.randn(8, 64, generator=gen), half_panels=True).half is None
    assert PanelLinear(torch.randn(8, 48, generator=gen).bfloat16().float(),
                       half_panels=True).half is None


def test_written_rows_keep_16_bit_panels_where_they_can():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 64, generator=gen).bfloat16().float()
    layer = PanelLinear(weight, half_panels=True)
    layer.drop_panels()
    new = torch.randn(5, 64, generator=gen).bfloat16().float()
    layer.write_rows(10, new)
    weight[10:15] = new
    assert layer.half[0] == "bf16" and layer.packed_weight.numel() == 0
    assert torch.equal(layer.dense_weight(), weight)
    # rows no 16-bit float holds: float32 panels from then on
    odd = torch.randn(3, 64, generator=gen)
    layer.write_rows(0, odd)
    weight[0:3] = odd
    assert layer.half is None and layer.packed_weight.numel()
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(layer(x), PanelLinear(weight)(x))


def test_bad_16_bit_panels_are_refused():
    weight = np.zeros((16, 64), np.float32)
    kind, panels = _scheduler.pack_half_panels(weight)
    assert kind == "bf16" and panels.ctypes.data % 64 == 0
    out = np.empty((1, 16), np.float32)
    with pytest.raises(ValueError, match="packed panels has"):
        _scheduler.linear_quant_panels_f32(np.zeros((1, 64), np.float32), panels[:-1024], kind,
                                           None, out, 1)
    with pytest.raises(ValueError, match="'bf16', 'f16'"):
        _scheduler.linear_quant_panels_f32(np.zeros((1, 64), np.float32), panels, "bf8", None,
                                           out, 1)
    assert _scheduler.pack_half_panels(np.zeros((16, 40), np.float32)) is None
    with pytest.raises(ValueError, match="C-contiguous"):
        _scheduler.pack_half_panels(np.zeros((64, 16), np.float32).T)
    # the float32 panels of the same weight read the same (the reference is pack_panels')
    assert pack_panels(torch.from_numpy(weight)).shape == (1, 64, 16)


def test_a_gguf_of_f16_linears_takes_float16_panels(tmp_path, monkeypatch):
    """A GGUF whose linears are F16 (dequantized to float32 at load, not block types) packs
    them as float16 panels, with the float32 panels' logits and transformers' greedy tokens."""
    from gguf_tiny import write_tiny_gguf

    cfg = TINY_CONFIGS["qwen2"]
    reference = random_hf_model(cfg, seed=5)
    path = tmp_path / "f16.gguf"
    write_tiny_gguf(path, reference, cfg, "qwen2", linear_types=lambda name: "F16")
    prompts = [list(range(3, 40)), list(range(50, 53))]
    loaded = load_model(str(path))
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    assert all(m.half is not None and m.half[0] == "f16" for m in _linears(loaded))
    assert "f16 weights as 16-bit panels" in runner.linear_kernels
    assert_greedy_matches(loaded, reference, prompts, 8, runner=runner)
    monkeypatch.setenv("FERROBATCH_QUANT_PANELS", "0")
    plain_runner = ModelRunner(load_model(str(path)), num_blocks=64, block_size=4)
    for (_, a), (_, b) in zip(_logits(runner, prompts), _logits(plain_runner, prompts)):
        assert torch.equal(a, b)
