"""Updating the served model's weights in place (``LLM.update_weights``, what RL loops do between
rollouts), on SmolLM2 as served by default on the CPU: GGUF blocks for small steps, quantized
panels, the fused step, tied embeddings. Oracle: transformers with the same tensors replaced,
greedy, token for token. Also: a cached prompt computed before an update is not reused after
it, bad tensors change nothing and leave the engine serving, and a checkpoint on disk (the GGUF
itself) brings the original weights back."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_support import REAL_ENGINE_OPTIONS  # noqa: E402

from ferrobatch.model.quantized_embedding import QuantizedEmbedding  # noqa: E402
from ferrobatch.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "You are a careful assistant. Answer in one short sentence. Question: why is the sky "
           "blue? Think about light, air and the colours of the sunset before you answer."]
NEW_TOKENS = 12


def _changed_weights(hf_model) -> dict[str, torch.Tensor]:
    """New values for a few tensors of every kind: parts of fused modules alone (layer 0's q,
    layer 7's up, not their siblings), a whole module, norms, and the tied embeddings."""
    gen = torch.Generator().manual_seed(5)
    state = hf_model.state_dict()
    out = {}
    for name, scale in [("model.layers.0.self_attn.q_proj.weight", 0.5),
                        ("model.layers.7.mlp.up_proj.weight", 0.5),
                        ("model.layers.3.self_attn.o_proj.weight", 0.5),
                        ("model.layers.11.input_layernorm.weight", 0.3),
                        ("model.norm.weight", 0.3),
                        ("model.embed_tokens.weight", 0.3)]:
        old = state[name]
        out[name] = old + scale * old.std() * torch.randn(old.shape, generator=gen)
    return out


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path):
    """An engine on its own copy of SmolLM2 (the updates change its weights)."""
    from ferrobatch.engine.llm import LLM
    from ferrobatch.model.loader import load_model
    loaded = load_model(smollm2_gguf_path, device="cpu", dtype=torch.float32, gguf_blocks=True)
    with LLM("smollm2", loaded_model=loaded, **REAL_ENGINE_OPTIONS) as llm:
        yield llm


def _greedy(llm, prompts=PROMPTS):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def _hf_greedy(model, llm, prompts=PROMPTS):
    tok = llm.get_tokenizer()
    out = []
    with torch.inference_mode():
        for text in prompts:
            x = torch.tensor([tok.encode(text, add_special_tokens=True)])
            gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, x.shape[1]:].tolist())
    return out


def test_updated_weights_give_transformers_tokens_and_no_stale_kv(llm, hf_oracle_model,
                                                                   smollm2_gguf_path):
    hf_oracle_model.generation_config.eos_token_id = None
    before = _hf_greedy(hf_oracle_model, llm)
    got, _ = _greedy(llm)
    assert got == before
    again, cached = _greedy(llm, PROMPTS[2:])
    assert cached[0] > 0                    # the long prompt's blocks are cached now
    runner = llm.engine._core.runner
    layers = runner.model.layers
    assert layers[0].self_attn.qkv_proj.blocks is not None   # served from GGUF blocks
    assert isinstance(runner.model.embed_tokens, QuantizedEmbedding)     # and Q8_0 rows

    new = _changed_weights(hf_oracle_model)
    summary = llm.update_weights(list(new.items()) + [
        ("lm_head.weight", new["model.embed_tokens.weight"]),      # tied: skipped
        ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(32))])
    assert summary["tensors"] == len(new) and summary["weights_version"] == 1
    assert sorted(summary["skipped"]) == ["lm_head.weight",
                                          "model.layers.0.self_attn.rotary_emb.inv_freq"]
    # qkv (its k and v rows rebuilt from the blocks), up, o and the tied head's packed copy
    assert summary["gguf_layers_unblocked"] == 4
    assert layers[0].self_attn.qkv_proj.blocks is None
    assert layers[1].self_attn.qkv_proj.blocks is not None
    assert type(runner.model.embed_tokens) is torch.nn.Embedding      # float32 rows now
    assert runner.fused_layers is not None

    merged = copy.deepcopy(hf_oracle_model)
    merged.load_state_dict(new, strict=False)
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    want = _hf_greedy(merged, llm)
    assert want != before                   # the update matters
    steps = runner.fused_layers.steps
    got, cached = _greedy(llm)
    assert got == want
    assert cached == [0, 0, 0]              # nothing computed with the old weights reused
    assert runner.fused_layers.steps > steps      # still in the fused step

    # the checkpoint on disk brings the original weights back (every tensor, so every GGUF
    # layer now reads float32 panels)
    summary = llm.update_weights_from_disk(smollm2_gguf_path)
    assert summary["weights_version"] == 2 and summary["tensors"] > 200
    got, cached = _greedy(llm)
    assert got == before and cached == [0, 0, 0]
    assert all(m.blocks is None for m in runner.model.modules() if hasattr(m, "blocks"))
    acc = llm.engine.check_accounting()
    assert acc["tracked_extras"] == 0


@pytest.mark.parametrize("weights,message", [
    ([("model.layers.0.self_attn.q_proj.weight", torch.zeros(576, 576)),
      ("model.layers.99.mlp.up_proj.weight", torch.zeros(1536, 576))], "not a tensor"),
    ([("model.layers.0.self_attn.k_proj.weight", torch.zeros(576, 576))],
     r"shape \(576, 576\), the model's is \(192, 576\)"),
    ([("model.norm.weight", torch.full((576,), float("nan")))], "NaN or infinite"),
    ([("model.norm.weight", torch.ones(576, dtype=torch.int64))], "not a floating-point"),
    ([("model.norm.weight", torch.ones(576)), ("model.norm.weight", torch.ones(576))],
     "given twice"),
    ([("model.layers.0.self_attn.q_proj.bias", torch.zeros(576))], "has no bias"),
    ([("model.norm.weight",)], r"\(name, torch.Tensor\) pairs"),
])
def test_bad_tensors_change_nothing(llm, weights, message):
    """Every tensor is checked before any is written: the good q_proj before the bad name is
    not written either, and the engine serves on, as before."""
    runner = llm.engine._core.runner
    qkv = runner.model.layers[0].self_attn.qkv_proj
    panels = qkv.packed_weight.clone()
    version = llm.engine._core.weights_version
    before, _ = _greedy(llm, PROMPTS[:1])
    with pytest.raises(ValueError, match=message):
        llm.update_weights(weights)
    assert torch.equal(qkv.packed_weight, panels)
    assert llm.engine._core.weights_version == version
    assert _greedy(llm, PROMPTS[:1])[0] == before


def test_a_checkpoint_of_another_shape_is_refused(llm, tmp_path):
    from hf_tiny import random_hf_model
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": True}
    random_hf_model(config, seed=0).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="hidden_size 64 .served: 576."):
        llm.update_weights_from_disk(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not found"):
        llm.update_weights_from_disk(str(tmp_path / "nowhere"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        llm.update_weights_from_disk(str(tmp_path / "weights.bin"))


def test_kv_of_a_request_running_across_an_update_serves_no_later_request(llm):
    """A request still running at the update holds its blocks (they are not free, so not
    dropped); it finishes with them, and the same prompt after it is computed afresh."""

    engine = llm.engine
    prompt = PROMPTS[2] + " Once more."
    norm = engine._core.runner.model.norm.weight

    async def run():
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                output_kind="delta")
        deltas = 0
        async for _ in engine.generate(prompt, params, request_id="across"):
            deltas += 1
            if deltas == 2:      # mid-stream: its prompt's blocks are held and hashed
                summary = await engine.update_weights({"model.norm.weight": norm * 1.01})
                assert summary["prefix_blocks_dropped"] >= 0
        assert deltas > 2
        final = [o async for o in engine.generate(prompt, SamplingParams(
            max_tokens=2, temperature=0.0), request_id="after")][-1]
        return final.num_cached_tokens

    assert llm._run(run()) == 0
    assert engine.check_accounting()["tracked_extras"] == 0


def test_apply_model_runs_a_function_on_the_served_model(llm):
    """vLLM's `apply_model`: a list of one result; an exception reaches the caller and the
    engine serves on."""
    assert llm.apply_model(lambda model: model.config.num_layers) == [30]
    with pytest.raises(ZeroDivisionError):
        llm.apply_model(lambda model: 1 / 0)
    assert len(_greedy(llm, PROMPTS[:1])[0][0]) == NEW_TOKENS


def test_finite_values_whose_sum_overflows_are_accepted(llm):
    """The fast check (a tensor's sum) only sends a tensor to the exact one: finite values
    whose sum is infinite pass, one NaN among them does not."""
    from ferrobatch.runtime.weight_update import plan_update
    model = llm.engine._core.runner.model
    huge = torch.full((576,), 3e38)
    assert not torch.isfinite(huge.sum())
    assert plan_update(model, [("model.norm.weight", huge)]).num_tensors == 1
    huge[7] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        plan_update(model, [("model.norm.weight", huge)])


@pytest.mark.parametrize("out_features", [37, 48, 50])
def test_rows_written_into_panels_equal_panels_packed_anew(out_features):
    """`PanelLinear.write_rows` (whole panels at once where the rows allow, else row by row)
    leaves the panels `pack_panels` makes of the edited weight, zero padding included."""
    from ferrobatch.runtime.cpu_linear import PanelLinear, pack_panels
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 20, generator=gen)
    linear = PanelLinear(weight)
    assert torch.equal(linear.dense_weight(), weight)
    for start, rows in ((0, 16), (16, out_features - 16), (32, out_features - 32), (3, 5),
                        (0, out_features)):
        new = torch.randn(rows, 20, generator=gen)
        linear.write_rows(start, new)
        weight[start:start + rows] = new
        assert torch.equal(linear.packed_weight, pack_panels(weight)), (start, rows)
    with pytest.raises(ValueError, match="do not fit"):
        linear.write_rows(out_features - 2, torch.zeros(3, 20))
