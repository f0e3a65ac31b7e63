"""Rotary fused with the K/V write (``LlamaAttention.attend`` calling a rotary module's
``rotate_and_cache`` where the backend's ``rotary_with_kv_write`` allows it), without a GPU: a torch stand-in for the CUDA kernel, rotating q / k in
place and storing k / v at the step's slots, goes through the same plumbing the CUDA module does
(eager steps, emulated decode graphs with their padding rows, emulated piecewise steps whose q / k /
v are views of the static QKV buffer). Tokens and KV caches must equal a runner that rotates and
writes apart; a module that declines, or a backend that does not allow it, must leave
everything to the unfused path. The kernel itself
is checked on the GPU (tests/gpu/test_elementwise.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_decode_graphs import MAX_MODEL_LEN, _greedy_run, _twin_runners

from ferrobatch.model.rope import ApplyRotary


class TorchRotateAndCache(ApplyRotary):
    """``rotate_and_cache`` in torch: what ``cuda/elementwise.cu``'s rotary_and_cache does."""

    def __init__(self, accept: bool = True) -> None:
        super().__init__()
        self.accept = accept
        self.fused_calls = 0
        self.plain_calls = 0

    def forward(self, query, key, tables):
        self.plain_calls += 1
        return super().forward(query, key, tables)

    def rotate_and_cache(self, query, key, value, tables, kv_cache, slot_mapping) -> bool:
        if not self.accept:
            return False
        self.fused_calls += 1
        rq, rk = super().forward(query, key, tables)
        query.copy_(rq)                          # in place, as the kernel rotates
        key.copy_(rk)
        real = slot_mapping >= 0                 # padding rows of a graph batch write nothing
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        flat[0, slot_mapping[real].long()] = key[real]
        flat[1, slot_mapping[real].long()] = value[real]
        return True


def _swap(runner, accept: bool) -> list[TorchRotateAndCache]:
    mods = []
    for layer in runner.model.layers:
        layer.self_attn.rope = TorchRotateAndCache(accept)
        mods.append(layer.self_attn.rope)
    return mods


def _run_both(accept: bool, graphs: bool, allowed: bool = True):
    plain, fused = _twin_runners(160, "torch", seed=2)
    mods = _swap(fused, accept)
    assert fused.attn_backend is not plain.attn_backend          # the choice is per runner
    fused.attn_backend.rotary_with_kv_write = allowed
    if graphs:
        fused.capture_decode_graphs(max_num_seqs=8, max_model_len=MAX_MODEL_LEN, emulate=True)
        fused.capture_piecewise_graphs(40, emulate=True)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 64, int(n)).tolist() for n in (4, 11, 19, 7, 26, 13)]
    max_new = [10, 18, 7, 22, 9, 14]
    want, _, used = _greedy_run(plain, prompts, max_new)
    got, _, used_f = _greedy_run(fused, prompts, max_new)
    assert got == want and used == used_f
    for layer_p, layer_f in zip(plain.kv_cache.layers, fused.kv_cache.layers, strict=True):
        torch.testing.assert_close(layer_f, layer_p, rtol=1e-5, atol=1e-5)   # padded buckets: other BLAS blocking
    return fused, mods


def test_fused_rotary_and_write_gives_the_unfused_tokens_and_cache_eagerly():
    runner, mods = _run_both(accept=True, graphs=False)
    assert runner.eager_steps > 0
    assert all(m.fused_calls == runner.eager_steps and m.plain_calls == 0 for m in mods)


def test_fused_rotary_and_write_through_decode_graphs_and_pieces():
    """Graph padding rows carry slot -1; piecewise q / k / v are views of ``_qkv`` (rotated in
    place between replays)."""
    runner, mods = _run_both(accept=True, graphs=True)
    assert runner.graph_steps > 0 and runner.piecewise_steps > 0 and runner.eager_steps == 0
    assert all(m.fused_calls > 0 and m.plain_calls == 0 for m in mods)


@pytest.mark.parametrize("accept,allowed", [(False, True), (True, False)])
def test_a_declining_module_or_backend_leaves_rotary_and_the_write_apart(accept, allowed):
    runner, mods = _run_both(accept=accept, graphs=True, allowed=allowed)
    assert all(m.fused_calls == 0 and m.plain_calls > 0 for m in mods)
