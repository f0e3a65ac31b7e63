"""The fused CPU step (``runtime.cpu_decoder``): the same logits and KV cache as the
layer-by-layer forward on the same steps (decode, prefill and mixed), taken exactly for the
steps it accepts, and clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from step_builder import ToyScheduler

from ferrobatch.model.config import ModelConfig
from ferrobatch.model.llama import LlamaForCausalLM
from ferrobatch.model.loader import LoadedModel
from ferrobatch.model.random_init import init_random_weights
from ferrobatch.runtime.cpu_decoder import FusedLayers, unsupported
from ferrobatch.runtime.cpu_linear import packing_unsupported
from ferrobatch.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(packing_unsupported(torch.device("cpu"), torch.float32) is not None,
                                reason="the Rust CPU kernels need AVX2 (packing unsupported)")


def _random_loaded(tied: bool, bias: bool, qk_norm: bool = False) -> LoadedModel:
    config = ModelConfig(arch="qwen3" if qk_norm else "llama", vocab_size=97, hidden_size=64,
                         intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                         head_dim=16, tie_word_embeddings=tied, attention_bias=bias,
                         max_position_embeddings=512, qk_norm=qk_norm)
    model = LlamaForCausalLM(config).eval()
    init_random_weights(model, seed=3, std=0.2)
    if qk_norm:   # head norms other than ones (init_random_weights sets norms to 1)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for layer in model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5, generator=gen)
    if bias:   # random biases too (init_random_weights zeroes them)
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0.0, 0.3, generator=gen)
    return LoadedModel("random", config, model, None, None, "random")


def _record_steps(runner: ModelRunner, prompts: list[list[int]], max_new: list[int]):
    """Runs the toy scheduler greedily to the end; returns every step's batch and logits."""
    sched = ToyScheduler(runner.num_blocks, runner.block_size, token_budget=48, seed=1)
    for i, (prompt, n) in enumerate(zip(prompts, max_new, strict=True)):
        sched.add(i, prompt, max_new_tokens=n)
    steps = []
    while (batch := sched.schedule()) is not None:
        logits = runner.execute(batch).clone()
        steps.append((batch, logits))
        sched.update(logits.argmax(-1).numpy())
    return steps


def _replay_layer_by_layer(loaded_fused: LoadedModel, loaded_plain: LoadedModel, prompts,
                           max_new, block_size: int = 8,
                           kv_cache_dtype: torch.dtype | None = None,
                           logits_atol: float = 1e-5):
    """The fused runner's steps replayed by a layer-by-layer runner, their logits within
    ``logits_atol`` of the largest. Returns (the fused runner's caches, the layer path's,
    steps, steps run fused)."""
    fused = ModelRunner(loaded_fused, num_blocks=96, block_size=block_size, attn_backend="cpu",
                        kv_cache_dtype=kv_cache_dtype)
    assert isinstance(fused.fused_layers, FusedLayers)
    assert "steps fused" in fused.linear_kernels
    steps = _record_steps(fused, prompts, max_new)
    num_fused = fused.fused_layers.steps
    fused_caches = [t.clone() for t in fused.kv_cache.layers]
    plain = ModelRunner(loaded_plain, num_blocks=96, block_size=block_size, attn_backend="cpu",
                        fused_decode=False, kv_cache_dtype=kv_cache_dtype)
    assert plain.fused_layers is None
    for i, (batch, want) in enumerate(steps):
        got = plain.execute(batch)
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=logits_atol * scale,
                                   msg=lambda m, i=i: f"step {i}: {m}")
    return fused_caches, plain.kv_cache.layers, len(steps), num_fused


def _compare(loaded_fused: LoadedModel, loaded_plain: LoadedModel, prompts, max_new,
             block_size: int = 8, kv_cache_dtype: torch.dtype | None = None,
             logits_atol: float = 1e-5, cache_atol: float = 1e-4) -> tuple[int, int]:
    """The fused runner's steps replayed by a layer-by-layer runner: logits and KV caches agree
    (within ``logits_atol`` / ``cache_atol`` of their largest value). Returns (steps, steps run
    fused)."""
    fused_caches, plain_caches, num_steps, num_fused = _replay_layer_by_layer(
        loaded_fused, loaded_plain, prompts, max_new, block_size, kv_cache_dtype, logits_atol)
    for layer, (a, b) in enumerate(zip(fused_caches, plain_caches, strict=True)):
        # float32 rounding (SiLU's polynomial) carried through the layers below, amplified at
        # SmolLM2's attention sink (position 0's hidden states reach ~24,000): the layer path
        # itself, with SiLU written as g / (1 + e^-g), moves these caches by up to 2e-5 of
        # their largest value (the logits above stay within 1e-5)
        torch.testing.assert_close(a, b, rtol=0, atol=cache_atol * float(b.abs().max()),
                                   msg=lambda m, i=layer: f"layer {i}: {m}")
    return num_steps, num_fused


@pytest.mark.parametrize("tied,bias,qk_norm", [(True, False, False), (False, True, False),
                                              (True, False, True)],
                         ids=["tied", "qkv-bias", "qwen3-head-norms"])
def test_fused_steps_match_the_layer_by_layer_forward_on_a_random_model(tied, bias, qk_norm):
    rng = np.random.default_rng(0)
    # 48-token steps: prompts chunked, mixed with decodes and short prompts
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (30, 4, 17, 3, 5, 40, 70)]
    num_steps, num_fused = _compare(_random_loaded(tied, bias, qk_norm),
                                    _random_loaded(tied, bias, qk_norm),
                                    prompts, [12, 20, 6, 9, 15, 3, 5])
    assert num_fused == num_steps          # prefill, mixed and decode steps alike


def test_fused_steps_match_the_layer_by_layer_forward_with_an_f16_cache():
    # both paths round each K/V value to float16 once (round to nearest even) and read it back
    # as float32; a value within float32 noise of a rounding boundary may round the other way
    # (one float16 unit: 2^-11 of it), hence the looser bounds
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (30, 4, 17, 3, 40)]
    num_steps, num_fused = _compare(_random_loaded(True, False), _random_loaded(True, False),
                                    prompts, [12, 20, 6, 9, 5], kv_cache_dtype=torch.float16,
                                    logits_atol=1e-4, cache_atol=2**-10)
    assert num_fused == num_steps


def test_steps_with_sdpa_chunks_stay_layer_by_layer(monkeypatch):
    # with the prefill kernel off (prefill chunks on SDPA) only steps without long chunks fuse
    monkeypatch.setenv("FERROBATCH_PREFILL_KERNEL", "0")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (30, 4, 17, 3)]
    num_steps, num_fused = _compare(_random_loaded(True, False), _random_loaded(True, False),
                                    prompts, [12, 20, 6, 9])
    assert 0 < num_fused < num_steps


def test_fused_steps_match_on_smollm2_with_gguf_blocks(loaded_smollm2):
    """Steps of more and of at most 8 rows: the panels and the GGUF blocks kernel."""
    rng = np.random.default_rng(1)
    lens = [5, 12, 3, 20, 9, 7, 30, 4, 15, 6]
    prompts = [rng.integers(100, 40000, size=n).tolist() for n in lens]
    max_new = [4, 9, 6, 12, 3, 8, 5, 10, 7, 11]
    num_steps, num_fused = _compare(loaded_smollm2, loaded_smollm2, prompts, max_new, block_size=16)
    assert num_fused == num_steps


def test_fused_decode_is_only_installed_where_it_applies(loaded_smollm2, monkeypatch):
    model = _random_loaded(True, False)
    assert "not packed" in unsupported(model.model, ModelRunner(
        model, num_blocks=8, block_size=8, attn_backend="cpu", pack_weights=False).attn_backend)
    torch_runner = ModelRunner(_random_loaded(True, False), num_blocks=8, block_size=8,
                               attn_backend="torch")
    assert torch_runner.fused_layers is None
    assert "'torch'" in unsupported(torch_runner.model, torch_runner.attn_backend)
    monkeypatch.setenv("FERROBATCH_FUSED_DECODE", "0")
    off = ModelRunner(_random_loaded(True, False), num_blocks=8, block_size=8, attn_backend="cpu")
    assert off.fused_layers is None
    assert "steps fused" not in off.linear_kernels


def test_the_stack_rejects_bad_input_with_value_errors():
    runner = ModelRunner(_random_loaded(False, True), num_blocks=16, block_size=8, attn_backend="cpu")
    stack = runner.fused_layers._stack
    assert stack.num_layers == 3
    caches = [t.numpy() for t in runner.kv_cache.layers]
    before = [c.copy() for c in caches]
    hidden = np.ones((2, 64), np.float32)
    cos = np.ones((2, 16), np.float32)
    sin = np.zeros((2, 16), np.float32)
    tables = np.array([[1, 2], [3, 0]], np.int32)
    ctx = np.array([9, 2], np.int32)
    slots = np.array([16, 25], np.int64)

    def call(**changes):
        args = dict(hidden=hidden.copy(), cos=cos, sin=sin, caches=caches, slots=slots,
                    block_tables=tables, ctx_lens=ctx, num_threads=2, decode_rows=None,
                    prefill=None) | changes
        stack.forward(args["hidden"], args["cos"], args["sin"], args["caches"], args["slots"],
                      args["block_tables"], args["ctx_lens"], args["num_threads"],
                      args["decode_rows"], args["prefill"])
        return args["hidden"]

    one = np.array([1], np.int32)
    # row 1 as a prefill chunk of one query over 2 keys; row 0 through the decode kernel
    chunk = (one, one, np.array([2], np.int32), tables[1:])
    mixed = dict(decode_rows=np.array([0], np.int64), block_tables=tables[:1], ctx_lens=ctx[:1],
                 prefill=chunk)

    for changes, match in [
        (dict(slots=np.array([16, 16 * 8], np.int64)), "slot"),
        (dict(ctx_lens=np.array([9, 17], np.int32)), "ctx_lens"),
        (dict(block_tables=np.array([[1, 16], [3, 0]], np.int32)), "block id"),
        (dict(cos=np.ones((3, 16), np.float32)), "cos"),
        (dict(caches=caches[:2]), "caches for"),
        (dict(caches=[c[:, :8] for c in caches]), "C-contiguous"),
        (dict(caches=[c[0] for c in caches]), "dimensions"),
        (dict(hidden=np.ones((2, 63), np.float32)), "hidden"),
        (mixed | dict(decode_rows=np.array([0, 1], np.int64), block_tables=tables, ctx_lens=ctx),
         "row 1 is attended by 2 kernels"),
        (mixed | dict(prefill=None), "attended by 0 kernels"),
        (mixed | dict(decode_rows=np.array([2], np.int64)), "decode row 2 outside"),
        (mixed | dict(prefill=(one, one, one - 1, tables[1:])), "seq_lens"),
        (mixed | dict(prefill=(one, one, one + 1, tables[1:, :1].copy() + 15)), "block id"),
    ]:
        with pytest.raises(ValueError, match=match):
            call(**changes)
    for c, b in zip(caches, before, strict=True):
        np.testing.assert_array_equal(c, b)
    assert np.isfinite(call()).all()      # the unchanged arguments are a valid step
    assert np.isfinite(call(**mixed)).all()
    from ferrobatch._scheduler import CpuDecoderStack
    norm = np.ones(64, np.float32)
    bad_panels = (160, 64, np.zeros((10, 64, 16), np.float32), None, None)
    with pytest.raises(ValueError, match="qkv"):
        CpuDecoderStack(64, 4, 2, 16, 96, 1e-5, 0.25, [(norm, bad_panels, bad_panels, norm,
                                                        bad_panels, bad_panels)])
    with pytest.raises(ValueError, match="group"):
        CpuDecoderStack(64, 3, 2, 16, 96, 1e-5, 0.25, [])
    odd_blocks = (128, 64, np.zeros((8, 64, 16), np.float32), None, ("q5_0", norm))
    with pytest.raises(ValueError, match="blocks must be"):
        CpuDecoderStack(64, 4, 2, 16, 96, 1e-5, 0.25, [(norm, odd_blocks, odd_blocks, norm,
                                                        odd_blocks, odd_blocks)])


def test_the_engine_switch_reaches_the_runner(loaded_smollm2):
    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.core import EngineCore
    for fused in (True, False):
        core = EngineCore.build(EngineConfig(num_blocks=64, fused_decode=fused), loaded_smollm2)
        assert (core.runner.fused_layers is not None) is fused
        assert ("steps fused" in core.runner.linear_kernels) is fused


def test_no_amx_keeps_prompt_attention_off_amx_too():
    """``amx_tiles=False`` (``--no-amx``) reaches the prefill kernel's AMX path as well: the
    backend's and the fused stack's ``amx`` flags, which they pass to every prefill call."""
    for amx in (True, False):
        runner = ModelRunner(_random_loaded(True, False), num_blocks=8, block_size=8,
                             attn_backend="cpu", amx_tiles=amx)
        assert runner.attn_backend.amx is amx
        assert runner.fused_layers.amx is amx


def test_attention_description_says_amx_only_where_the_head_dim_allows_it():
    """The banner's ``attention:`` line: long prompt chunks go to AMX tiles only where the CPU
    has AMX and the head dim is a multiple of 64 (``cpu_amx_prefill.rs``)."""
    from ferrobatch._scheduler import amx_available
    from ferrobatch.runtime.attention.cpu import CpuPagedBackend
    for head_dim, amx in ((64, True), (128, True), (48, True), (64, False), (None, True)):
        text = CpuPagedBackend(block_size=16, head_dim=head_dim, amx=amx).description
        on_amx = amx and amx_available() and (head_dim or 64) % 64 == 0
        assert ("AMX" in text) is on_amx, (head_dim, amx, text)
        assert text.startswith("Rust ")


def test_two_runners_sharing_one_model_step_concurrently():
    """Two engines may share one loaded model (each runner installs the same fused stack); their
    step threads call it at once, each with its own KV cache. With the GIL switching as often as
    it can, every step's logits equal the same steps run alone. (When the stack remembered the
    last caches it was given, this failed every time: a step ran on the other runner's caches,
    "already borrowed"; a full CI run once lost a request to it as non-finite logits.)"""
    import sys
    import threading

    loaded = _random_loaded(True, False)
    rng = np.random.default_rng(5)
    prompts = [[rng.integers(0, 97, size=n).tolist() for n in (12, 5, 30)] for _ in range(2)]
    max_new = [6, 9, 4]
    alone = []
    for p in prompts:
        runner = ModelRunner(loaded, num_blocks=96, block_size=8, attn_backend="cpu")
        alone.append(_record_steps(runner, p, max_new))
    runners = [ModelRunner(loaded, num_blocks=96, block_size=8, attn_backend="cpu")
               for _ in prompts]
    assert runners[0].fused_layers is not None and runners[1].fused_layers is not None
    got: list = [None, None]
    errors: list = []

    def run(i: int) -> None:
        try:
            for _ in range(60):
                steps = [(batch, runners[i].execute(batch).clone()) for batch, _ in alone[i]]
            got[i] = steps
        except Exception as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for i in range(2):
        for (_, want), (_, logits) in zip(alone[i], got[i], strict=True):
            torch.testing.assert_close(logits, want, rtol=0, atol=0)


def test_runners_sharing_a_model_keep_their_own_backend_and_fused_step():
    """A second runner over the same loaded model, layer by layer on the torch backend, takes
    neither the first one's fused step away nor its backend (each runner's steps run bound to
    its own); the same steps through both give the same logits. A weight update through one
    reaches the other's fused step too (rebuilt over the new arrays before its next step)."""
    loaded = _random_loaded(True, False)
    prompts, max_new = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], [5, 3]
    first = ModelRunner(loaded, num_blocks=96, block_size=8, attn_backend="cpu")
    second = ModelRunner(loaded, num_blocks=96, block_size=8, attn_backend="torch",
                         fused_decode=False)
    assert second.fused_layers is None and loaded.model.fused_layers is None
    steps = _record_steps(first, prompts, max_new)
    assert first.fused_layers.steps == len(steps)       # every step still fused
    for batch, want in steps:
        torch.testing.assert_close(second.execute(batch), want, rtol=1e-4, atol=1e-4)
    assert first.fused_layers.steps == len(steps)       # the second runner's ran layered
    # new weights through the second runner: the first one's fused step follows
    new = {"model.layers.1.mlp.down_proj.weight":
           torch.randn(64, 96, generator=torch.Generator().manual_seed(9)) * 0.2}
    stale = first.fused_layers
    second.update_weights(new)
    after = _record_steps(second, prompts, max_new)
    for batch, want in after:
        torch.testing.assert_close(first.execute(batch), want, rtol=1e-4, atol=1e-4)
    assert first.fused_layers is not stale and first.fused_layers.steps > len(steps)
    assert any(not torch.allclose(a, b) for (_, a), (_, b) in zip(steps, after))


def test_phase_timing_counts_fused_steps_only_when_on():
    """The opt-in phase accounting (``cpu_step_timing.rs``): off, fused steps count nothing;
    on, every fused step is counted and its linear, attention and other time is there, and
    their sum stays within the steps' wall time."""
    import time

    from ferrobatch import _scheduler
    runner = ModelRunner(_random_loaded(tied=True, bias=False), num_blocks=96, block_size=8,
                         attn_backend="cpu")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    _scheduler.set_decoder_phase_timing(False)
    _scheduler.take_decoder_phase_times()
    before = runner.fused_layers.steps
    _record_steps(runner, prompts, [4, 4])
    assert runner.fused_layers.steps > before
    assert _scheduler.take_decoder_phase_times() == {
        "linear_ns": 0, "attention_ns": 0, "other_ns": 0, "steps": 0}
    _scheduler.set_decoder_phase_timing(True)
    try:
        before = runner.fused_layers.steps
        t0 = time.perf_counter_ns()
        _record_steps(runner, prompts, [4, 4])
        wall = time.perf_counter_ns() - t0
        got = _scheduler.take_decoder_phase_times()
    finally:
        _scheduler.set_decoder_phase_timing(False)
    assert got["steps"] == runner.fused_layers.steps - before > 0
    assert got["linear_ns"] > 0 and got["attention_ns"] > 0 and got["other_ns"] > 0
    assert got["linear_ns"] + got["attention_ns"] + got["other_ns"] < wall
