"""EngineConfig: validation, unknown options, per-device defaults, and the CLI's mapping."""

from __future__ import annotations

import pytest

from ferrobatch.cli import _config, build_parser
from ferrobatch.config import EngineConfig, Speculation


@pytest.mark.parametrize("options,match", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ({"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
    ({"max_num_batched_tokens": True}, "max_num_batched_tokens"),
    ({"block_size": 12}, "power of two"),
    ({"num_blocks": 1}, "num_blocks"),
    ({"device": "tpu"}, "device"),
    ({"cuda_graphs": "no"}, "cuda_graphs"),
    ({"flash_prefill": 0}, "flash_prefill"),
    ({"gguf_blocks": 1}, "gguf_blocks"),
    ({"fused_decode": "yes"}, "fused_decode"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"speculative_max_running": 1.5}, "speculative_max_running"),
    ({"speculative_max_step_tokens": -1}, "speculative_max_step_tokens"),
    ({"speculative_adaptive": 1}, "speculative_adaptive"),
    ({"piecewise_max_tokens": -1}, "piecewise_max_tokens"),
    ({"piecewise_max_tokens": True}, "piecewise_max_tokens"),
    ({"speculative_ngram_min": 0}, "n-gram"),
    ({"speculative_ngram_min": 5, "speculative_ngram_max": 4}, "n-gram"),
    # checked before the model loads (they used to fail after it, or allocate first)
    ({"max_num_seqs": 2**70}, "max_num_seqs"),
    ({"max_num_batched_tokens": 2**40}, "max_num_batched_tokens"),
    ({"num_blocks": 2**23}, "num_blocks"),
    ({"block_size": 2**20}, "block_size"),
    ({"max_model_len": 2**40}, "max_model_len"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
    ({"gpu_memory_utilization": "x"}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": None}, "gpu_memory_utilization"),
    ({"kv_cache_gb": True}, "kv_cache_gb"),
    ({"dtype": "float8"}, "dtype"),
    ({"attn_backend": "flash"}, "attn_backend"),
    ({"admission_batch": 0}, "admission_batch"),
    ({"admission_batch": 2**20}, "admission_batch"),
    ({"admission_max_wait_steps": -1}, "admission_max_wait_steps"),
    ({"admission_max_wait_steps": 2**30}, "admission_max_wait_steps"),
])
def test_bad_values_are_refused_with_the_field_named(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_unknown_options_list_the_known_ones():
    with pytest.raises(TypeError, match="max_num_seq.*known:.*max_num_seqs"):
        EngineConfig.from_options(max_num_seq=4)


def test_step_limits_default_per_device_unless_given():
    cfg = EngineConfig()
    assert cfg.max_num_batched_tokens is None and cfg.max_num_seqs is None
    assert cfg.step_token_budget("cpu") == 512 and cfg.step_token_budget("cuda") == 8192
    assert cfg.step_seq_limit("cpu") == 128 and cfg.step_seq_limit("cuda") == 256
    given = EngineConfig(max_num_batched_tokens=300, max_num_seqs=7)
    assert given.step_token_budget("cuda") == 300 and given.step_seq_limit("cuda") == 7


def test_speculation_defaults_per_device_unless_given():
    assert EngineConfig().speculation("cpu") == (3, 0, 8, True)
    assert EngineConfig().speculation("cuda") == (0, 8, 0, True)
    assert EngineConfig(speculative_adaptive=False).speculation("cpu").adaptive is False
    given = EngineConfig(num_speculative_tokens=5, speculative_max_running=0,
                         speculative_max_step_tokens=6)
    assert given.speculation("cpu") == (5, 0, 6, True) and given.speculation("cuda") == (5, 0, 6, True)
    assert EngineConfig(num_speculative_tokens=0).speculation("cpu").num_tokens == 0


def test_speculation_is_described_in_words():
    assert Speculation(0, 1, 4).describe() == "off"
    assert Speculation(3, 1, 0).describe() == \
        "prompt lookup, up to 3 drafts per step while at most 1 sequence runs"
    assert Speculation(3, 0, 4).describe() == \
        "prompt lookup, up to 3 drafts per step at any load, filling steps up to 4 tokens"
    assert Speculation(8, 8, 0).describe().endswith("while at most 8 sequences run")
    assert Speculation(3, 0, 16, True).describe() == \
        "prompt lookup, up to 3 drafts per step at any load, filling steps up to 16 tokens, " \
        "fewer after drafts the model cut short"


def test_cli_maps_engine_flags():
    parser = build_parser()
    default = _config(parser.parse_args(["serve"]))
    assert default.cuda_graphs is True and default.max_num_batched_tokens is None
    assert default.gguf_blocks is True and default.fused_decode is True
    cfg = _config(parser.parse_args(["serve", "--enforce-eager", "--max-num-batched-tokens", "64",
                                     "--no-gguf-blocks", "--no-fused-decode"]))
    assert cfg.cuda_graphs is False and cfg.max_num_batched_tokens == 64
    assert cfg.piecewise_token_limit("cuda") == 0 and default.piecewise_max_tokens is None
    assert default.piecewise_token_limit("cuda") == 8192
    assert default.piecewise_token_limit("cpu") == 0
    small = _config(parser.parse_args(["serve", "--max-num-batched-tokens", "1000"]))
    assert small.piecewise_token_limit("cuda") == 1000          # the step budget
    capped = _config(parser.parse_args(["serve", "--max-num-batched-tokens", "1000",
                                        "--piecewise-max-tokens", "2048"]))
    assert capped.piecewise_token_limit("cuda") == 1000         # within it
    assert _config(parser.parse_args(["serve", "--piecewise-max-tokens", "512"])) \
        .piecewise_token_limit("cuda") == 512
    big = _config(parser.parse_args(["serve", "--max-num-batched-tokens", "65536"]))
    assert big.piecewise_token_limit("cuda") == 8192             # the default's own cap
    assert _config(parser.parse_args(["serve", "--max-num-batched-tokens", "65536",
                                      "--piecewise-max-tokens", "16384"])) \
        .piecewise_token_limit("cuda") == 16384
    off = _config(parser.parse_args(["serve", "--piecewise-max-tokens", "0"]))
    assert off.piecewise_max_tokens == 0 and off.piecewise_token_limit("cuda") == 0
    assert off.cuda_graphs is True
    assert default.flash_prefill is True
    assert _config(parser.parse_args(["serve", "--no-flash-prefill"])).flash_prefill is False
    assert cfg.gguf_blocks is False and cfg.fused_decode is False
    assert default.num_speculative_tokens is None and default.speculative_max_running is None
    cfg = _config(parser.parse_args(["serve", "--num-speculative-tokens", "0",
                                     "--speculative-max-running", "4",
                                     "--speculative-max-step-tokens", "6",
                                     "--speculative-ngram", "1", "3"]))
    assert (cfg.num_speculative_tokens, cfg.speculative_max_running) == (0, 4)
    assert cfg.speculative_max_step_tokens == 6 and default.speculative_max_step_tokens is None
    assert (cfg.speculative_ngram_min, cfg.speculative_ngram_max) == (1, 3)
    assert default.speculative_adaptive is True
    assert _config(parser.parse_args(["serve", "--speculative-fixed-length"])).speculative_adaptive \
        is False
    assert (default.admission_batch, default.admission_max_wait_steps) == (1, 8)
    cfg = _config(parser.parse_args(["serve", "--admission-batch", "4",
                                     "--admission-max-wait-steps", "3"]))
    assert (cfg.admission_batch, cfg.admission_max_wait_steps) == (4, 3)


def test_gpu_kv_budget_leaves_the_warm_up_peak_and_the_reserve(monkeypatch):
    import torch

    from ferrobatch.engine.core import _gpu_reserve_bytes
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.runtime.kv_cache import kv_block_bytes, num_blocks_for_gpu
    from ferrobatch.runtime.piecewise_graphs import pool_bytes_estimate

    config = ModelConfig(arch="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    graphs, eager = EngineConfig(max_num_seqs=4), EngineConfig(max_num_seqs=4, cuda_graphs=False)
    decode_only = EngineConfig(max_num_seqs=4, piecewise_max_tokens=0)
    assert _gpu_reserve_bytes(eager, config) == 4 * 1000 * 32
    assert _gpu_reserve_bytes(decode_only, config) == 4 * 1000 * 32 + (1 + 2 + 4) * 1000 * 4
    assert _gpu_reserve_bytes(graphs, config, torch.bfloat16) == \
        _gpu_reserve_bytes(decode_only, config) + pool_bytes_estimate(config, 8192, torch.bfloat16)
    # LoRA: the adapters, stacked, and the LoRA graphs' static weights (their outputs are the
    # plain graphs')
    from ferrobatch.runtime.lora import reserve_bytes
    lora = EngineConfig(max_num_seqs=4, piecewise_max_tokens=0, enable_lora=True, max_loras=3,
                        max_lora_rank=8)
    assert _gpu_reserve_bytes(lora, config) == _gpu_reserve_bytes(decode_only, config) + \
        reserve_bytes(config, 3, 8, torch.bfloat16, graphs=True)
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 16 * gib))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)
    block = kv_block_bytes(config, 16, torch.bfloat16)
    got = num_blocks_for_gpu(config, 16, torch.bfloat16, 0.5, "cuda", reserve_bytes=gib // 2)
    assert got == (5 * gib - gib - gib // 2) // block          # half of free, less peak, reserve
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        num_blocks_for_gpu(config, 16, torch.bfloat16, 0.5, "cuda", reserve_bytes=4 * gib)


def test_a_cpu_kv_cache_larger_than_memory_is_refused_before_it_is_filled(loaded_smollm2):
    """Zero-filling a cache past the machine's memory swaps or gets the process killed with no
    message; the engine refuses it with the sizes instead."""
    from ferrobatch.engine.core import EngineCore
    from ferrobatch.runtime.kv_cache import CPU_KV_MEMORY_FRACTION, check_cpu_kv_fits

    gib = 1 << 30
    check_cpu_kv_fits(4 * gib, available=8 * gib)
    with pytest.raises(ValueError, match="only 8.00 GiB of memory is available"):
        check_cpu_kv_fits(int(CPU_KV_MEMORY_FRACTION * 8 * gib) + 1, available=8 * gib)
    # on this machine: 100,000 GiB is more than any CI runner or dev VM has
    with pytest.raises(ValueError, match="--kv-cache-gb"):
        EngineCore.build(EngineConfig(model="smollm2", device="cpu", kv_cache_gb=100_000),
                         loaded_smollm2)
    with pytest.raises(ValueError, match="memory is available"):
        EngineCore.build(EngineConfig(model="smollm2", device="cpu", num_blocks=2**22),
                         loaded_smollm2)


def test_max_model_len_is_lowered_to_what_the_kv_cache_holds(loaded_smollm2, caplog):
    """A 0.05 GiB cache holds ~1,100 tokens: a request asking for the whole context
    (max_tokens=None, the chat default) used to fail with "needs 512 KV blocks"."""
    from ferrobatch import LLM, SamplingParams

    with caplog.at_level("WARNING", logger="ferrobatch.engine.core"):
        llm = LLM("smollm2", loaded_model=loaded_smollm2, kv_cache_gb=0.05, device="cpu")
    try:
        blocks = llm.engine.kv_cache_config()["num_blocks"]
        assert llm.engine.max_model_len == (blocks - 1) * 16 + 1 < 8192
        assert "max_model_len lowered" in caplog.text
        out = llm.chat([{"role": "user", "content": "Say hi."}],
                       SamplingParams(max_tokens=None, temperature=0.0, stop=["\n"]))[0]
        assert out.outputs[0].finish_reason == "stop"
        with pytest.raises(ValueError, match="context window"):
            llm.generate("Hi", SamplingParams(max_tokens=llm.engine.max_model_len))
    finally:
        llm.close()
