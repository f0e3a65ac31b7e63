"""The LoRA decode graphs' pieces (``runtime.lora_graphs``): the static weights by slot and
the masked update each hooked linear adds from a row -> block buffer, against each row's own
adapter; the static LoRA-block buffer's padding; the errors for what the graphs cannot hold."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ferrobatch.model.lora_adapter import LoraAdapter, LoraWeights
from ferrobatch.runtime.cuda_graphs import PAD_LORA_BLOCK, DecodeGraphRunner, pad_decode_batch
from ferrobatch.runtime.lora import MODULES, LayerLora, LoraHooks, LoraSlots
from ferrobatch.runtime.lora_graphs import GraphLoraWeights, module_features

CONFIG = SimpleNamespace(hidden_size=12, num_heads=2, head_dim=4, num_kv_heads=1,
                         intermediate_size=10, num_layers=2)
PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}


def _adapter(gen, rank: int, modules_by_layer) -> LoraAdapter:
    """Random weights of ``rank`` per part (every part of a fused module adapted)."""
    features = module_features(CONFIG)
    layers = [{m: LoraWeights(torch.randn(features[m][0], PARTS[m] * rank, generator=gen),
                              torch.randn(PARTS[m] * rank, features[m][1], generator=gen))
               for m in modules} for modules in modules_by_layer]
    return LoraAdapter(f"rank{rank}", rank, layers)


def test_graph_step_adds_each_rows_own_adapter():
    """Slots 1 and 3 of 3 loaded (ranks 2 and 4, different modules), rows of both, of the base
    model and of the empty slot 2: each row gains its own adapter's update, others exact
    zeros; after slot 3 empties and slot 2 fills, the weights follow on the next sync only."""
    gen = torch.Generator().manual_seed(0)
    adapters = {1: _adapter(gen, 2, [MODULES, ["o_proj"]]),
                3: _adapter(gen, 4, [["qkv_proj", "down_proj"], MODULES])}
    slots = LoraSlots(CONFIG.num_layers, 3, max_rank=4)
    for slot, adapter in adapters.items():
        slots.put(slot, adapter)
    weights = GraphLoraWeights(CONFIG, 3, 4, torch.float32, "cpu")
    hooks = LoraHooks()
    features = module_features(CONFIG)

    def check(seq_slots, held):
        blocks = GraphLoraWeights.row_blocks(slots.stacked, seq_slots)
        step = weights.step(torch.from_numpy(blocks))
        for layer in range(CONFIG.num_layers):
            for m in MODULES:
                x = torch.randn(len(seq_slots), features[m][0], generator=gen)
                base = torch.randn(len(seq_slots), features[m][1], generator=gen)
                want = base.clone()
                for row, slot in enumerate(seq_slots):
                    w = held[slot].layers[layer].get(m) if slot in held else None
                    if w is not None:
                        want[row] += (x[row] @ w.a_t) @ w.b_t
                with hooks.step(step):
                    got = LayerLora(hooks, layer).add(m, x, base.clone())
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                unchanged = [r for r, s in enumerate(seq_slots) if s not in held or
                             m not in held[s].layers[layer]]
                assert torch.equal(got[unchanged], base[unchanged])    # exact zeros added

    weights.sync(slots.stacked)
    assert weights.syncs == 1
    seq_slots = [3, 0, 1, 2, 3, 1, 0]
    check(seq_slots, adapters)
    assert GraphLoraWeights.row_blocks(slots.stacked, seq_slots).tolist() == \
        [2, -1, 0, -1, 2, 0, -1]
    weights.sync(slots.stacked)
    assert weights.syncs == 1                 # unchanged slots: nothing copied
    slots.clear(3)
    slots.put(2, adapters[3])
    moved = {1: adapters[1], 2: adapters[3]}
    with pytest.raises(AssertionError):       # not synced yet: block 2 still holds slot 3's
        check([2, 2, 1], moved)
    weights.sync(slots.stacked)
    check([2, 3, 1, 0], moved)                # slot 3 is empty now: its rows add nothing
    weights.sync(None)                        # no adapters at all: every block zero
    assert all(not t.any() for layer in weights.layers for pair in layer.values()
               for t in pair)


def test_what_the_graphs_cannot_hold_is_refused():
    gen = torch.Generator().manual_seed(1)
    slots = LoraSlots(CONFIG.num_layers, 2, max_rank=4)
    with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank 4"):
        slots.put(1, _adapter(gen, 8, [MODULES, MODULES]))
    assert slots.stacked is None
    big = LoraSlots(CONFIG.num_layers, 2, max_rank=8)
    big.put(1, _adapter(gen, 8, [MODULES, MODULES]))
    weights = GraphLoraWeights(CONFIG, 2, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="graphs hold 12"):
        weights.sync(big.stacked)
    with pytest.raises(ValueError, match=">= 1"):
        GraphLoraWeights(CONFIG, 0, 4, torch.float32, "cpu")


def _decode_batch(n: int):
    return SimpleNamespace(
        input_ids=np.arange(n, dtype=np.int64) + 5, positions=np.arange(n, dtype=np.int64),
        slot_mapping=np.arange(n, dtype=np.int64) + 16, seq_lens=np.full(n, 3, np.int32),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        block_tables=np.ones((n, 2), np.int32), logits_indices=np.arange(n))


def test_lora_blocks_are_padded_and_copied_into_the_static_buffer():
    """Padding rows get no adapter; a runner with the buffer needs blocks and one without
    refuses them; the forward sees the step's blocks, then padding."""
    padded = pad_decode_batch(_decode_batch(3), 8, 4, np.array([1, -1, 0]))
    assert padded.lora_blocks.tolist() == [1, -1, 0] + [PAD_LORA_BLOCK] * 5
    assert pad_decode_batch(_decode_batch(3), 8, 4).lora_blocks is None
    with pytest.raises(ValueError, match="one block per sequence"):
        pad_decode_batch(_decode_batch(3), 8, 4, np.array([1, 0]))
    seen = []

    def forward(inputs):
        seen.append(inputs.lora_blocks.tolist())
        return inputs.input_ids.to(torch.float32)[:, None] + inputs.lora_blocks[:, None]

    graphs = DecodeGraphRunner(forward, max_blocks_per_seq=4, max_seq_len=64, device="cpu",
                               buckets=(4, 8), emulate=True, lora_blocks=True)
    graphs.capture()
    out = graphs.run(_decode_batch(3), lora_blocks=np.array([1, -1, 0]))
    assert seen[-1] == [1, -1, 0, PAD_LORA_BLOCK] and out[:, 0].tolist() == [6, 5, 7]
    with pytest.raises(ValueError, match="LoRA blocks go with"):
        graphs.run(_decode_batch(3))
    plain = DecodeGraphRunner(lambda i: i.input_ids.to(torch.float32), max_blocks_per_seq=4,
                              max_seq_len=64, device="cpu", buckets=(4,), emulate=True)
    plain.capture()
    assert plain.static_inputs(4).lora_blocks is None
    with pytest.raises(ValueError, match="LoRA blocks go with"):
        plain.run(_decode_batch(3), lora_blocks=np.zeros(3, np.int64))
