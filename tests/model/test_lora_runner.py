"""Multi-LoRA at the model runner on a tiny random llama: base rows and two adapters' rows in
the same steps (prefill chunks, decodes, mixed), greedy tokens and logits against transformers
with each adapter merged into the weights. On the CPU here; the same test on CUDA (float32,
the CUDA attention backend) is marked gpu (written in session 36 without a device)."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_tiny import random_hf_model
from lora_files import ATTN, MLP, merge_into, write_peft_adapter
from step_builder import ToyScheduler, greedy_run

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 512, "tie_word_embeddings": False}


@pytest.mark.parametrize("device,graphs,base16", [
    ("cpu", False, False), ("cpu", True, False), ("cpu", False, True),
    pytest.param("cuda", False, False, marks=pytest.mark.gpu),
    pytest.param("cuda", True, False, marks=pytest.mark.gpu)])
def test_runner_mixes_base_and_adapter_rows_like_merged_transformers(tmp_path, device, graphs,
                                                                     base16):
    """With ``graphs`` the decode steps replay decode graphs and the prefill / mixed steps the
    piecewise graphs (emulated on the CPU: the same static buffers, each replay re-running the
    forward), steps with adapter rows through the LoRA ones; then slot 1 takes slot 2's
    adapter and the graphs' weights follow. With ``base16`` the base checkpoint is bfloat16
    (its linears on 16-bit panels)."""
    from ferrobatch.model.loader import load_model
    from ferrobatch.model.lora_adapter import read_lora_adapter
    from ferrobatch.runtime.model_runner import ModelRunner

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    reference = random_hf_model(CONFIG, seed=0)
    saved = reference
    if base16:
        with torch.no_grad():
            for param in reference.parameters():
                param.copy_(param.bfloat16().float())
        saved = copy.deepcopy(reference).to(torch.bfloat16)
    saved.save_pretrained(tmp_path / "model", safe_serialization=True)
    loaded = load_model(str(tmp_path / "model"), device=device, dtype=torch.float32)
    cfg = loaded.config
    specs = {1: (("q_proj", "v_proj"), 8, 0.2), 2: (ATTN + MLP, 4, 0.1)}   # slot: targets
    references = {0: reference.to(device)}
    adapters = {}
    runner = ModelRunner(loaded, num_blocks=64, block_size=16,
                         attn_backend="cuda" if device == "cuda" else None)
    assert ("bf16 weights as 16-bit panels" in runner.linear_kernels) == base16
    slots = runner.enable_lora(max_loras=2, max_rank=8)
    if graphs:
        runner.capture_decode_graphs(8, 512, emulate=device == "cpu")
        assert runner.lora_decode_graphs.captured_buckets == runner.decode_graphs.captured_buckets
        runner.capture_piecewise_graphs(48, emulate=device == "cpu")     # the prefill steps
        assert runner.lora_piecewise_graphs.captured_buckets == \
            runner.piecewise_graphs.captured_buckets
    for slot, (targets, rank, std) in specs.items():
        path = tmp_path / f"adapter{slot}"
        pairs = write_peft_adapter(str(path), cfg, targets=targets, r=rank, alpha=2 * rank,
                                   seed=slot, b_std=std)
        adapters[slot] = read_lora_adapter(str(path), cfg, device=device)
        slots.put(slot, adapters[slot])
        merged = copy.deepcopy(reference).cpu()
        merge_into(merged, pairs, 2.0)
        references[slot] = merged.to(device)
    # request i runs with slot seq_slot[i]; prompts long enough for several chunks
    prompts = [list(range(3, 60)), list(range(100, 104)), list(range(200, 250)),
               list(range(30, 90)), list(range(5, 9))]
    seq_slot = {0: 0, 1: 1, 2: 2, 3: 1, 4: 2}

    def check(reference_of_slot):
        sched = ToyScheduler(64, 16, token_budget=48)
        for i, p in enumerate(prompts):
            sched.add(i, p, 6)
        generated, last = greedy_run(runner, sched, lambda batch: runner.execute(
            batch, lora_slots=[seq_slot[int(r)] for r in batch.seq_req_ids]))
        with torch.no_grad():
            for i, p in enumerate(prompts):
                ids = torch.tensor([p + generated[i][:-1]], device=device)
                want = references[reference_of_slot[seq_slot[i]]](ids).logits[0]
                assert want[len(p) - 1:].argmax(-1).tolist() == generated[i], i
                torch.testing.assert_close(last[i], want[-1], rtol=1e-3, atol=1e-3)
                if seq_slot[i]:      # the adapter matters: the base model's logits differ
                    base = references[0](ids).logits[0][-1]
                    assert (base - want[-1]).abs().max() > 1e-2

    check({0: 0, 1: 1, 2: 2})
    if not graphs:
        assert runner.lora_graph_steps == 0
        return
    # decode steps with adapter rows replayed the LoRA decode graphs (5 tokens each, the last
    # 2+), prefill and mixed ones the LoRA pieces: no step ran eagerly
    assert runner.lora_graph_steps >= 4 and runner.lora_piecewise_steps >= 2
    assert runner.eager_steps == 0 and runner.graph_lora.syncs == 1
    slots.clear(1)
    slots.put(1, adapters[2])
    before = runner.lora_graph_steps, runner.lora_piecewise_steps
    check({0: 0, 1: 2, 2: 2})
    assert runner.lora_graph_steps > before[0] and runner.lora_piecewise_steps > before[1]
    assert runner.graph_lora.syncs == 2
