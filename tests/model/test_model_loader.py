"""Loaders: GGUF dequantization and Q/K permutation, HF directories vs transformers, random shapes, errors."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from gguf_tiny import write_tiny_gguf
from hf_tiny import random_hf_model
from step_builder import ToyScheduler

from ferrobatch.model.dequant import dequantize_tensor
from ferrobatch.model.gguf_file import GGUFFile
from ferrobatch.model.gguf_loader import llama_permute, reverse_llama_permute
from ferrobatch.model.loader import load_model
from ferrobatch.model.random_init import RANDOM_SHAPES
from ferrobatch.runtime.model_runner import ModelRunner


def test_gguf_file_parser_agrees_with_gguf_reader(smollm2_gguf_path):
    from gguf import GGUFReader

    ours = GGUFFile(smollm2_gguf_path)
    reference = GGUFReader(smollm2_gguf_path)
    assert [t.name for t in reference.tensors] == list(ours.tensors)
    for tensor in reference.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type_id == int(tensor.tensor_type)
        assert mine.shape == tuple(reversed([int(d) for d in tensor.shape]))
        assert np.array_equal(np.asarray(tensor.data).view(np.uint8).reshape(-1), mine.data.reshape(-1))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.chat_template", "llama.rope.freq_base", "llama.attention.head_count_kv"):
        assert reference.fields[key].contents() == ours.metadata[key], key


def test_torch_dequant_matches_gguf_reference(smollm2_gguf_path):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    checked = set()
    for tensor in GGUFFile(smollm2_gguf_path).tensors.values():
        if tensor.type_name in checked:
            continue
        checked.add(tensor.type_name)
        ours = dequantize_tensor(tensor.data, tensor.type_id, tensor.type_name)
        assert tuple(ours.shape) == tensor.shape
        qtype = GGMLQuantizationType(tensor.type_id)
        raw = tensor.data.view(np.float32) if qtype == GGMLQuantizationType.F32 else tensor.data
        np.testing.assert_array_equal(ours.numpy(), dequantize(raw, qtype))
    assert checked == {"Q8_0", "Q4_1", "F32"}
    weights = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    for qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                  GGMLQuantizationType.F16):
        packed = quantize(weights, qtype)
        np.testing.assert_array_equal(dequantize_tensor(packed, int(qtype), qtype.name).numpy(),
                                      dequantize(packed, qtype))


def test_qk_permutation_round_trip():
    weight = torch.randn(3 * 8, 5)
    assert torch.equal(llama_permute(reverse_llama_permute(weight, 3), 3), weight)
    assert torch.equal(reverse_llama_permute(llama_permute(weight, 3), 3), weight)
    assert not torch.equal(reverse_llama_permute(weight, 3), weight)


def test_smollm2_config(loaded_smollm2):
    c = loaded_smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0
    assert loaded_smollm2.model.lm_head_weight is loaded_smollm2.model.embed_tokens.weight
    assert loaded_smollm2.chat_template and loaded_smollm2.dtype == torch.float32


def test_random_shape_loads_without_tokenizer_and_runs():
    loaded = load_model("random:smollm2-135m")
    assert loaded.source == "random" and loaded.config == RANDOM_SHAPES["smollm2-135m"]
    runner = ModelRunner(loaded, num_blocks=16, block_size=16)
    sched = ToyScheduler(16, 16)
    sched.add(0, [1, 2, 3, 4, 5], 1)
    logits = runner.execute(sched.schedule())
    assert logits.shape == (1, 49152) and torch.isfinite(logits).all()


def test_a_tokenizer_less_random_model_is_refused_before_it_is_built(monkeypatch):
    """The engine cannot serve a model without a tokenizer; `random:llama3-8b` used to build
    32 GB of float32 weights before saying so."""
    import ferrobatch.model.loader as loader
    from ferrobatch.config import EngineConfig
    from ferrobatch.engine.core import EngineCore

    def no_build(*args, **kwargs):
        raise AssertionError("the weights were built")

    monkeypatch.setattr(loader, "build_model", no_build)
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_model("random:llama3-8b", require_tokenizer=True)
    with pytest.raises(ValueError, match="has no tokenizer"):
        EngineCore.build(EngineConfig(model="random:llama3-8b", device="cpu"))


@pytest.mark.parametrize("name, error", [
    ("random:gpt-17", ValueError),
    ("/nonexistent/model.gguf", FileNotFoundError),
    ("no-such-model", FileNotFoundError),
])
def test_clear_errors(name, error):
    with pytest.raises(error):
        load_model(name)


def test_non_gguf_file_and_bad_hf_dirs(tmp_path):
    text_file = tmp_path / "weights.bin"
    text_file.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="gguf"):
        load_model(str(text_file))
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(fake_gguf))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="lacks required key"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS["llama"]))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"garbage, not a safetensors header")
    with pytest.raises(ValueError, match="cannot read the weights"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_model(str(tmp_path))


def test_empty_and_corrupt_gguf_headers_are_value_errors(tmp_path):
    import struct
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        GGUFFile(str(empty))
    for counts in ((1 << 60, 0), (0, 1 << 60), (3, 1)):      # absurd counts, truncated entries
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, *counts) + b"\xff" * 40)
        with pytest.raises(ValueError, match="corrupt GGUF header"):
            GGUFFile(str(bad))


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(path)


TINY_CONFIGS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                  "max_position_embeddings": 256, "tie_word_embeddings": False},
    "llama3-rope": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 1, "vocab_size": 128, "rms_norm_eps": 1e-5,
                        "rope_theta": 500000.0, "max_position_embeddings": 256, "tie_word_embeddings": True,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16}},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "max_position_embeddings": 256, "tie_word_embeddings": False},
    # head_dim 32 with 4 heads: q is 128 wide over a hidden size of 64 (as Qwen3-0.6B's)
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 256,
              "tie_word_embeddings": True},
}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_hf_directory_matches_transformers_logits(tmp_path, name):
    reference = random_hf_model(TINY_CONFIGS[name], seed=0)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer is None and loaded.config.arch == TINY_CONFIGS[name]["model_type"]
    prompts = [list(range(3, 40)), list(range(50, 53))]
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    sched = ToyScheduler(32, 4, token_budget=16)
    for i, p in enumerate(prompts):
        sched.add(i, p, 1)
    logits = {}
    while (batch := sched.schedule()) is not None:
        out = runner.execute(batch)
        for row, req in enumerate(batch.sample_req_ids):
            logits[int(req)] = out[row]
        sched.update(out.argmax(-1).numpy())
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = reference(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)
    assert os.path.isfile(tmp_path / "config.json")


@pytest.mark.parametrize("name, tied", [("qwen3", True), ("llama", False)])
def test_a_base_model_checkpoint_gives_transformers_hidden_states(tmp_path, name, tied, caplog):
    """A checkpoint of the base model alone (`Qwen3Model` / `LlamaModel`, as embedding models
    such as Qwen3-Embedding ship it: no `model.` prefix, no LM head) loads; its final-normed
    hidden states (what embeddings pool) equal transformers' `last_hidden_state`."""
    import numpy as np
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = {**TINY_CONFIGS[name], "tie_word_embeddings": tied}
    cfg.pop("architectures")
    reference = transformers.AutoModel.from_config(
        transformers.AutoConfig.for_model(**cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.1)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    with caplog.at_level("WARNING"):
        loaded = load_model(str(tmp_path))
    assert ("no LM head" in caplog.text) == (not tied)
    assert loaded.config.tie_word_embeddings
    prompt = list(range(3, 30))
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    sched = ToyScheduler(32, 4, token_budget=64)
    sched.add(0, prompt, 1)
    batch = sched.schedule()
    _, hidden = runner.execute(batch, hidden_rows=np.arange(len(prompt)))
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).last_hidden_state[0]
    torch.testing.assert_close(hidden, want, rtol=1e-4, atol=1e-4)


def test_rope_freq_factors_equal_llama3_scaling():
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.rope import rope_inverse_frequencies

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    base = ModelConfig(arch="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=64, rope_theta=500000.0)
    plain = rope_inverse_frequencies(base)
    scaled = rope_inverse_frequencies(dataclasses.replace(base, rope_scaling=llama3))
    factors = (plain / scaled).tolist()  # what llama.cpp stores in rope_freqs.weight
    from_factors = rope_inverse_frequencies(
        dataclasses.replace(base, rope_scaling={"rope_type": "freq_factors", "factors": factors}))
    torch.testing.assert_close(from_factors, scaled)
    assert not torch.allclose(scaled, plain)
    with pytest.raises(ValueError, match="rope scaling type"):
        rope_inverse_frequencies(dataclasses.replace(base, rope_scaling={"rope_type": "dynamic"}))


def test_loading_and_a_step_import_no_compiler_stack(smollm2_gguf_path):
    """The model is built on the meta device and materialized by shape: an op on meta tensors
    (an initialiser, `to_empty`, the rotary tables' math) would run torch's Python references,
    whose first call imports torch._dynamo, inductor and sympy (~1,000 modules, 1-1.5 s of
    start-up, measured session 18). Checked in a fresh interpreter, through a model step."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from step_builder import ToyScheduler\n"
        "from ferrobatch.model.loader import load_model\n"
        "from ferrobatch.runtime.model_runner import ModelRunner\n"
        f"loaded = load_model({smollm2_gguf_path!r})\n"
        "runner = ModelRunner(loaded, num_blocks=8, block_size=16)\n"
        "sched = ToyScheduler(8, 16, token_budget=64)\n"
        "sched.add(0, [1, 2, 3, 4], max_new_tokens=2)\n"
        "assert runner.execute(sched.schedule()).shape[0] == 1\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') "
        "if m in sys.modules))\n")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_materialize_keeps_shapes_dtypes_and_shared_parameters():
    from ferrobatch.model.loader import _materialize

    model = torch.nn.Sequential(torch.nn.Linear(4, 3, device="meta", dtype=torch.float16),
                                torch.nn.Linear(3, 4, bias=False, device="meta"))
    tied = torch.nn.Module()
    tied.a = torch.nn.Linear(2, 2, bias=False, device="meta")
    tied.b = torch.nn.Linear(2, 2, bias=False, device="meta")
    tied.b.weight = tied.a.weight
    tied.register_buffer("table", torch.empty(5, device="meta"))
    for m in (model, tied):
        _materialize(m, torch.device("cpu"))
        assert all(t.device.type == "cpu" for t in [*m.parameters(), *m.buffers()])
    assert model[0].weight.shape == (3, 4) and model[0].weight.dtype == torch.float16
    assert model[0].bias.shape == (3,) and isinstance(model[0].bias, torch.nn.Parameter)
    assert tied.b.weight is tied.a.weight and tied.table.shape == (5,)


def test_a_hub_id_loads_from_its_snapshot(tmp_path, monkeypatch):
    """'org/name' that is not a local path: the cached snapshot first, else a download (both
    stubbed here: no network in tests); a failure is a FileNotFoundError saying why."""
    transformers = pytest.importorskip("transformers")
    huggingface_hub = pytest.importorskip("huggingface_hub")
    config = transformers.AutoConfig.for_model(**TINY_CONFIGS["llama"])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(
        tmp_path, safe_serialization=True)
    calls = []

    def snapshot(repo_id, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, local_files_only))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    loaded = load_model("some-org/tiny-llama")
    assert loaded.config.arch == "llama" and calls == [("some-org/tiny-llama", True),
                                                        ("some-org/tiny-llama", False)]

    def offline(repo_id, allow_patterns=None, local_files_only=False):
        raise OSError("no network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="Hub could not provide it: OSError: no network"):
        load_model("some-org/missing")


def test_qwen3_gguf_matches_transformers_logits(tmp_path):
    """A Qwen3 GGUF (per-head q / k norms, head_dim wider than hidden / heads) gives
    transformers' logits for the same weights."""
    cfg = TINY_CONFIGS["qwen3"]
    reference = random_hf_model(cfg, seed=1)
    path = tmp_path / "tiny-qwen3.gguf"
    write_tiny_gguf(path, reference, cfg, "qwen3")
    loaded = load_model(str(path))
    assert loaded.config.arch == "qwen3" and loaded.config.qk_norm
    assert loaded.config.head_dim == 32 and loaded.config.tie_word_embeddings
    prompt = list(range(3, 30))
    runner = ModelRunner(loaded, num_blocks=32, block_size=4)
    sched = ToyScheduler(32, 4, token_budget=16)
    sched.add(0, prompt, 1)
    while (batch := sched.schedule()) is not None:
        out = runner.execute(batch)
        sched.update(out.argmax(-1).numpy())
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-4)


def test_building_a_model_takes_the_checkpoint_tensors_in_place():
    """Loading moves each tensor into the model (the same storage where dtype and device
    already agree) and empties the checkpoint dict, so a load holds about one copy of the
    weights; a tensor missing from the checkpoint is named."""
    from ferrobatch.model.loader import build_model
    from ferrobatch.model.random_init import random_config

    config = random_config("smollm2-135m")
    reference = build_model(config, None, device=torch.device("cpu"), dtype=torch.float32)
    state = {f"model.{n}" if not n.startswith("lm_head") else n: p.detach().clone()
             for n, p in reference.named_parameters()}
    # the model's own names -> transformers' (q / k / v and gate / up split)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        q, k, v = state.pop(f"{p}self_attn.qkv_proj.weight").split(
            [config.num_heads * config.head_dim, *(2 * [config.num_kv_heads * config.head_dim])])
        gate, up = state.pop(f"{p}mlp.gate_up_proj.weight").chunk(2)
        state.update({f"{p}self_attn.q_proj.weight": q, f"{p}self_attn.k_proj.weight": k,
                      f"{p}self_attn.v_proj.weight": v, f"{p}mlp.gate_proj.weight": gate,
                      f"{p}mlp.up_proj.weight": up})
    down = state["model.layers.0.mlp.down_proj.weight"]
    model = build_model(config, state, device=torch.device("cpu"), dtype=torch.float32)
    assert state == {}
    assert model.layers[0].mlp.down_proj.weight.data_ptr() == down.data_ptr()   # no copy
    assert not any(p.is_meta for p in model.parameters())
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(mine, theirs), name
    short = {n: t for n, t in state.items()}
    with pytest.raises(ValueError, match="checkpoint lacks tensor model.embed_tokens.weight"):
        build_model(config, short, device=torch.device("cpu"), dtype=torch.float32)
