"""CPU-side checks of the CUDA path: CUDA-graph padding/buckets, split-KV planning, the backend's
behaviour without a GPU, and that the package carries the kernel sources. No GPU needed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ferrobatch.runtime import cuda_ops
from ferrobatch.runtime.cuda_graphs import (
    DEFAULT_BUCKETS,
    PAD_SLOT,
    bucket_for,
    is_decode_only,
    pad_decode_batch,
)


def _decode_batch(n: int, width: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(1, width * 16 + 1, size=n).astype(np.int32)
    tables = np.zeros((n, width), np.int32)
    for i, L in enumerate(seq_lens):
        nb = (L + 15) // 16
        tables[i, :nb] = rng.integers(1, 1000, size=nb)
    pos = seq_lens - 1
    return SimpleNamespace(
        input_ids=rng.integers(0, 100, size=n).astype(np.int32),
        positions=pos.astype(np.int32),
        slot_mapping=(tables[np.arange(n), pos // 16] * 16 + pos % 16).astype(np.int32),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        seq_lens=seq_lens,
        block_tables=tables,
    )


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 4), (5, 8), (16, 16), (17, 32),
                                        (200, 256), (256, 256), (257, None), (0, None)])
def test_bucket_for(n, expected):
    assert bucket_for(n, DEFAULT_BUCKETS) == expected


def test_buckets_are_the_issue_list():
    assert DEFAULT_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)


@pytest.mark.parametrize("n", [1, 3, 7, 8, 100])
def test_pad_decode_batch(n):
    b = _decode_batch(n)
    bucket = bucket_for(n)
    p = pad_decode_batch(b, bucket, max_blocks=6)
    assert p.bucket == bucket and p.num_seqs == n
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        arr = getattr(p, name)
        assert arr.shape == (bucket,)
        np.testing.assert_array_equal(arr[:n], getattr(b, name))
    # padding rows: no cache write, no context, null blocks
    assert np.all(p.slot_mapping[n:] == PAD_SLOT)
    assert np.all(p.seq_lens[n:] == 0)
    assert np.all(p.block_tables[n:] == 0)
    assert np.all(p.input_ids[n:] == 0) and np.all(p.positions[n:] == 0)
    np.testing.assert_array_equal(p.block_tables[:n, :4], b.block_tables)
    assert np.all(p.block_tables[:n, 4:] == 0)
    assert p.slot_mapping.dtype == np.int64 and p.seq_lens.dtype == np.int32
    assert p.block_tables.dtype == np.int32


def test_pad_rejects_non_decode_and_oversize():
    b = _decode_batch(4)
    with pytest.raises(ValueError):
        pad_decode_batch(b, 2, max_blocks=6)  # does not fit the bucket
    with pytest.raises(ValueError):
        pad_decode_batch(b, 4, max_blocks=2)  # real blocks past the static width
    b.query_start_loc = np.array([0, 1, 3, 4, 5], np.int32)  # one sequence has 2 query tokens
    assert not is_decode_only(b)
    with pytest.raises(ValueError):
        pad_decode_batch(b, 8, max_blocks=6)


def test_pad_drops_null_columns():
    b = _decode_batch(3, width=4)
    b.block_tables = np.concatenate([b.block_tables, np.zeros((3, 5), np.int32)], axis=1)
    p = pad_decode_batch(b, 4, max_blocks=4)
    np.testing.assert_array_equal(p.block_tables[:3], b.block_tables[:, :4])


# ------------------------------------------------------------------ split-KV planning (host side)
def _kernel_partition(seq_len: int, num_splits: int) -> list[tuple[int, int]]:
    """The splits the decode kernel gives a sequence (cuda_ops.decode_chunk mirrors decode_chunk())."""
    c = cuda_ops.decode_chunk(seq_len, num_splits)
    return [(s * c, min(seq_len, (s + 1) * c)) for s in range(num_splits) if s * c < seq_len]


@pytest.mark.parametrize("seq_len", [1, 63, 128, 129, 1000, 4097, 8191, 131072])
@pytest.mark.parametrize("splits", [1, 2, 5, 16, 32])
def test_kernel_partition_covers_context(seq_len, splits):
    parts = _kernel_partition(seq_len, splits)
    assert 1 <= len(parts) <= splits
    assert parts[0][0] == 0 and parts[-1][1] == seq_len
    assert all(a < b for a, b in parts)
    assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))
    assert all(b - a <= cuda_ops.decode_chunk(seq_len, splits) for a, b in parts)


def test_partition_mirror_matches_kernel_source():
    src = (cuda_ops.cuda_source_dir() / "decode_attention.cuh").read_text()
    assert f"constexpr int kMinChunk = {cuda_ops.DECODE_MIN_CHUNK};" in src
    assert f"constexpr int kChunkAlign = {cuda_ops.DECODE_CHUNK_ALIGN};" in src


@pytest.mark.parametrize("batch", [1, 2, 16, 64, 128, 256])
@pytest.mark.parametrize("hkv", [1, 3, 8])
@pytest.mark.parametrize("ctx", [1, 100, 512, 1024, 4096, 8192, 32768])
def test_choose_num_splits(batch, hkv, ctx):
    sms = 132
    s = cuda_ops.choose_num_splits(batch, hkv, ctx, sms, max_splits=32)
    assert 1 <= s <= 32
    assert s <= max(1, math.ceil(ctx / cuda_ops.DECODE_MIN_CHUNK))  # no empty splits
    if ctx <= cuda_ops.DECODE_MIN_CHUNK:
        assert s == 1
    if batch * hkv < sms and ctx >= 4096:  # small batch, long context: spread over the GPU
        assert batch * hkv * s >= min(sms, batch * hkv * 32)


def test_choose_num_splits_is_memoized_and_the_same_as_computed():
    """Eager steps ask once per layer: the answer comes from a cache, and equals the function
    computed afresh."""
    fresh = cuda_ops.choose_num_splits.__wrapped__
    for args in [(200, 3, 1100, 132), (31, 3, 900, 132), (7, 8, 30000, 78), (256, 8, 1, 132)]:
        want = fresh(*args, max_splits=32)
        before = cuda_ops.choose_num_splits.cache_info().hits
        assert cuda_ops.choose_num_splits(*args, max_splits=32) == want
        assert cuda_ops.choose_num_splits(*args, max_splits=32) == want
        assert cuda_ops.choose_num_splits.cache_info().hits >= before + 1


# ------------------------------------------------------------------ backend without CUDA
def test_cuda_backend_module_imports_and_reports():
    from ferrobatch.runtime.attention import cuda as cuda_backend

    ok, reason = cuda_backend.cuda_available()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    assert cuda_backend.CudaAttentionBackend is cuda_backend.CudaPagedBackend
    if not torch.cuda.is_available():
        assert not ok
        with pytest.raises(RuntimeError, match="unavailable"):
            cuda_backend.CudaPagedBackend(block_size=16)


def test_supports_matrix():
    from ferrobatch.runtime.attention.cuda import CudaPagedBackend

    assert CudaPagedBackend.supports(9, 3, 64, torch.bfloat16) is None      # SmolLM2
    assert CudaPagedBackend.supports(32, 8, 128, torch.float16) is None     # Llama-3-8B
    assert CudaPagedBackend.supports(64, 8, 128, torch.float32) is None     # GQA 8
    assert CudaPagedBackend.supports(32, 2, 128, torch.bfloat16) is not None  # GQA 16
    assert CudaPagedBackend.supports(8, 8, 96, torch.bfloat16) is not None    # head_dim 96


def test_auto_backend_on_cpu_is_the_cpu_kernel_never_cuda():
    from ferrobatch.runtime.attention import get_attention_backend

    assert get_attention_backend("auto", "cpu").name == "cpu"   # the Rust decode kernel
    assert get_attention_backend("auto", "cpu", model_shape=(9, 3, 64, torch.bfloat16)).name == "torch"
    with pytest.raises(ValueError):
        get_attention_backend("cuda", "cpu")


def test_sources_ship_inside_the_package():
    """The wheel takes the kernels from ferrobatch/_cuda_src (pyproject [tool.maturin] include)."""
    import ferrobatch

    pkg_src = __import__("pathlib").Path(ferrobatch.__file__).parent / "_cuda_src"
    for name in cuda_ops.SOURCE_FILES + cuda_ops.HEADER_FILES:
        assert (pkg_src / name).is_file(), f"{pkg_src / name} missing"
    assert cuda_ops.cuda_source_dir().resolve() == pkg_src.resolve()


def test_build_dir_is_cached_per_arch_and_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("FERROBATCH_CACHE_DIR", str(tmp_path))
    a = cuda_ops.build_dir_for("90", cuda_ops.cuda_source_dir())
    b = cuda_ops.build_dir_for("80", cuda_ops.cuda_source_dir())
    assert a != b and a.parent == tmp_path / "torch_extensions" and "sm90" in a.name


def test_nvcc_command_targets_sm90_only(tmp_path):
    tk = cuda_ops.CudaToolkit(home=tmp_path, nvcc=tmp_path / "nvcc", version=(13, 2),
                              include_dirs=(tmp_path,))
    cmd = cuda_ops.nvcc_compile_command(tk, tmp_path / "x.cu", tmp_path / "x.o", arch="90")
    assert "-gencode=arch=compute_90,code=sm_90" in cmd and "-c" in cmd
    assert "--use_fast_math" in cmd and "-O3" in cmd
    assert not any(f.startswith("-arch") for f in cmd)


def test_workspace_captured_by_graphs_is_never_freed():
    """A decode step bigger than the graphs' workspace (an eager step past the last bucket) must
    not free the workspace whose addresses the captured graphs replay into."""
    from ferrobatch.runtime.attention.cuda import CudaPagedBackend

    backend = object.__new__(CudaPagedBackend)      # the constructor needs a GPU; the
    backend.device = torch.device("cpu")             # workspace bookkeeping does not
    backend.max_splits = 4
    backend._workspaces = {}
    backend._graph_workspaces_fixed = False
    backend._retired_workspaces = []
    first = backend.reserve_workspace(8, 4, 64)
    assert backend.reserve_workspace(16, 4, 64) is not first
    assert backend._retired_workspaces == []          # no graphs: the old one may go
    backend.prepare_decode_graphs(32, 4, 64)
    captured = backend._workspaces[(4, 64)]
    assert captured.partial_out.shape[:3] == (32, 4, 4)
    assert backend.reserve_workspace(20, 4, 64) is captured     # fits: no new allocation
    bigger = backend.reserve_workspace(600, 4, 64)
    assert bigger is not captured and bigger.partial_out.shape[0] == 600
    assert backend._retired_workspaces == [captured]


def test_build_progress_reports_finished_objects(tmp_path, caplog):
    import time

    from ferrobatch.runtime.cuda_ops import BuildProgress

    with caplog.at_level("INFO", logger="ferrobatch.runtime.cuda_ops"):
        progress = BuildProgress(tmp_path, 7, interval_s=0.05)
        (tmp_path / "ops.o").write_bytes(b"")
        (tmp_path / "decode_attention_bf16.cuda.o").write_bytes(b"")
        (tmp_path / "build.ninja").write_text("")
        deadline = time.monotonic() + 5
        while "2/7 files done" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        progress.stop()
    assert "compiling CUDA kernels: 2/7 files done" in caplog.text
    assert "(finished)" in caplog.text
    assert not progress._thread.is_alive()


def test_choose_num_splits_against_the_h200_sweep():
    """On the split-count sweep measured on the H200 (40 batch x context x model shapes, each
    at 10 split counts), the heuristic's choice is close to the fastest measured one. Its choice
    is taken among the measured counts, as the kernel would be timed at no other."""
    import json
    from pathlib import Path

    sweep = json.loads((Path(__file__).resolve().parents[2] / "benches" / "results"
                        / "gpu-2026-12-04" / "decode_splits_sweep.json").read_text())
    kv_heads = {"llama3-8b": 8, "smollm2-135m": 3}
    sms = sweep["meta"].get("sm_count", 132)
    regrets = []
    for row in sweep["rows"]:
        times = {int(s): us for s, us in row["us_per_call"].items()}
        measured = sorted(times)
        chosen = max(s for s in measured if s <= cuda_ops.choose_num_splits(
            row["batch"], kv_heads[row["shape"]], row["context"], sms, max_splits=max(measured)))
        regrets.append(times[chosen] / min(times.values()) - 1.0)
    assert len(regrets) == 40
    assert sum(regrets) / len(regrets) < 0.02, regrets
    assert max(regrets) < 0.06, regrets


@pytest.fixture
def stand_in_ops(monkeypatch):
    """The fused elementwise ops replaced by the torch modules' arithmetic on the CPU (the
    kernels themselves run on the GPU only); returns the list of calls they record."""
    from ferrobatch.model.llama import RMSNorm, SiluAndMul
    from ferrobatch.model.rope import ApplyRotary

    calls = []

    def norm_of(x, weight, eps):
        norm = RMSNorm(x.shape[-1], eps)
        norm.weight.data = weight
        return norm(x)

    def rms_norm(x, weight, eps):
        calls.append("norm")
        return norm_of(x, weight, eps)

    def add_rms_norm(x, delta, weight, eps):
        calls.append("add+norm")
        total = x + delta
        return total, norm_of(total, weight, eps)

    def rotary_inplace(q, k, cos, sin):
        rq, rk = ApplyRotary()(q, k, (cos[:, None], sin[:, None]))
        q.copy_(rq)
        k.copy_(rk)

    def rotary_and_cache(q, k, v, cos, sin, kv_cache, slot_mapping):
        calls.append("rotary+write")
        rotary_inplace(q, k, cos, sin)
        real = slot_mapping >= 0
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        flat[0, slot_mapping[real].long()] = k[real]
        flat[1, slot_mapping[real].long()] = v[real]

    monkeypatch.setattr(cuda_ops, "rms_norm", rms_norm)
    monkeypatch.setattr(cuda_ops, "add_rms_norm", add_rms_norm)
    monkeypatch.setattr(cuda_ops, "silu_and_mul", lambda x: SiluAndMul()(x))
    monkeypatch.setattr(cuda_ops, "rotary_inplace", rotary_inplace)
    monkeypatch.setattr(cuda_ops, "rotary_and_cache", rotary_and_cache)
    return calls


def _tiny_model(dtype=torch.float32):
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.loader import LoadedModel, build_model

    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=512)
    torch.manual_seed(3)
    model = build_model(config, None, device=torch.device("cpu"), dtype=dtype)
    return LoadedModel("tiny", config, model, None, None, "random")


@pytest.mark.parametrize("rotary_with_kv_write", [False, True])
def test_fused_elementwise_model_computes_what_the_torch_modules_do(stand_in_ops,
                                                                    rotary_with_kv_write):
    """The swapped model's plumbing on the CPU, with torch stand-ins for the kernels: a mixed
    step gives the unswapped model's logits and KV cache bit for bit, every residual add went
    through a norm's ``add_and_norm``, and, where the backend allows it, each layer's rotary and
    K/V write through one ``rotary_and_cache``."""
    import copy
    import os
    import sys

    from ferrobatch.runtime import cuda_elementwise as ce
    from ferrobatch.runtime.model_runner import ModelRunner

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "model"))
    from step_builder import context_prefill, mixed_step

    loaded = _tiny_model()
    twin = copy.deepcopy(loaded)
    ce.swap_cuda_elementwise_ops(twin.model)
    plain = ModelRunner(loaded, num_blocks=64, block_size=16, attn_backend="torch",
                        pack_weights=False)
    fused = ModelRunner(twin, num_blocks=64, block_size=16, attn_backend="torch",
                        pack_weights=False)
    fused.attn_backend.rotary_with_kv_write = rotary_with_kv_write
    rng = np.random.default_rng(0)
    batch = mixed_step(rng, 64, 16, [(20, 1), (0, 30), (40, 5)], 64)
    fill = context_prefill(batch, 16, 64)
    for runner in (plain, fused):
        runner.execute(fill)
    stand_in_ops.clear()
    assert torch.equal(fused.execute(batch), plain.execute(batch))
    for layer_p, layer_f in zip(plain.kv_cache.layers, fused.kv_cache.layers, strict=True):
        assert torch.equal(layer_f, layer_p)
    # every residual add is in the norm after it: layer 0's input norm has none, its
    # post-attention norm and layer 1's two norms take one, the final norm the last MLP's
    norms = [c for c in stand_in_ops if "norm" in c]
    assert norms == ["norm"] + ["add+norm"] * 4
    assert stand_in_ops.count("rotary+write") == (2 if rotary_with_kv_write else 0)


def test_rotary_cache_start_up_check_passes_for_the_right_kernel_only(stand_in_ops,
                                                                       monkeypatch):
    from ferrobatch.runtime import cuda_elementwise as ce

    model = _tiny_model().model
    ok, detail = ce.check_rotary_cache(model, torch.float32)
    assert ok, detail
    right = cuda_ops.rotary_and_cache

    def unrotated_k(q, k, v, cos, sin, kv_cache, slots):      # stores k before the rotation
        saved = k.clone()
        right(q, k, v, cos, sin, kv_cache, slots)
        real = slots >= 0
        kv_cache.view(2, -1, *kv_cache.shape[-2:])[0, slots[real].long()] = saved[real]

    def writes_padding(q, k, v, cos, sin, kv_cache, slots):   # slot -1 is the cache's last slot
        right(q, k, v, cos, sin, kv_cache, slots)
        kv_cache.view(2, -1, *kv_cache.shape[-2:])[1, slots.long()] = v

    for wrong, finding in ((unrotated_k, "worst cache"),
                           (writes_padding, "outside the step's slots")):
        monkeypatch.setattr(cuda_ops, "rotary_and_cache", wrong)
        ok, detail = ce.check_rotary_cache(model, torch.float32)
        assert not ok and finding in detail, detail

    def no_kernel(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(cuda_ops, "rotary_and_cache", no_kernel)
    ok, detail = ce.check_rotary_cache(model, torch.float32)
    assert not ok and "no kernel image" in detail


def test_the_runner_fuses_rotary_and_the_write_only_after_its_check(stand_in_ops, monkeypatch,
                                                                    caplog):
    from types import SimpleNamespace

    from ferrobatch.runtime import cuda_elementwise as ce
    from ferrobatch.runtime.model_runner import _use_rotary_kv_write

    caplog.set_level("INFO", logger="ferrobatch")
    model = _tiny_model().model
    backend = SimpleNamespace(rotary_with_kv_write=True)
    assert _use_rotary_kv_write(model, torch.float32, backend) == ""    # torch's rotary module
    assert backend.rotary_with_kv_write is False
    ce.swap_cuda_elementwise_ops(model)
    monkeypatch.setenv(ce.ROTARY_CACHE_FLAG, "0")
    said = _use_rotary_kv_write(model, torch.float32, backend)
    assert "FERROBATCH_ROTARY_CACHE=0" in said and backend.rotary_with_kv_write is False
    monkeypatch.delenv(ce.ROTARY_CACHE_FLAG)
    right = cuda_ops.rotary_and_cache
    monkeypatch.setattr(cuda_ops, "rotary_and_cache",
                        lambda q, k, v, *rest: right(q, k, v * 2, *rest))
    said = _use_rotary_kv_write(model, torch.float32, backend)
    assert "failed its check: worst cache" in said and backend.rotary_with_kv_write is False
    assert "stay two kernels" in caplog.text
    monkeypatch.setattr(cuda_ops, "rotary_and_cache", right)
    assert _use_rotary_kv_write(model, torch.float32, backend) == \
        "; rotary fused with the K/V write"
    assert backend.rotary_with_kv_write is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_start_up_check_passes_for_right_kernels_only(stand_in_ops, monkeypatch,
                                                                dtype):
    from ferrobatch.runtime import cuda_elementwise as ce

    model = _tiny_model(dtype).model
    ok, detail = ce.check_fused_ops(model, dtype)
    assert ok, detail
    right = cuda_ops.silu_and_mul
    monkeypatch.setattr(cuda_ops, "silu_and_mul", lambda x: right(x) * 1.05)
    ok, detail = ce.check_fused_ops(model, dtype)
    assert not ok and "silu_and_mul" in detail
    monkeypatch.setattr(cuda_ops, "silu_and_mul", right)

    def no_kernel(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(cuda_ops, "rotary_inplace", no_kernel)
    ok, detail = ce.check_fused_ops(model, dtype)
    assert not ok and "no kernel image" in detail


def test_the_runner_swaps_only_after_the_check_and_unless_switched_off(stand_in_ops, monkeypatch,
                                                                       caplog):
    from ferrobatch.runtime import cuda_elementwise as ce
    from ferrobatch.runtime.model_runner import _use_fused_elementwise_ops

    def fused_count(model):
        return sum(isinstance(m, ce.CudaRMSNorm) for m in model.modules())

    caplog.set_level("INFO", logger="ferrobatch")

    monkeypatch.setenv(ce.ENV_FLAG, "0")
    model = _tiny_model().model
    said = _use_fused_elementwise_ops(model, torch.float32)
    assert fused_count(model) == 0 and "torch's modules (FERROBATCH_CUDA_FUSED_OPS=0)" in caplog.text
    assert said == "torch's modules (FERROBATCH_CUDA_FUSED_OPS=0)"      # the banner's words
    monkeypatch.delenv(ce.ENV_FLAG)
    right = cuda_ops.rms_norm
    monkeypatch.setattr(cuda_ops, "rms_norm", lambda x, w, eps: right(x, w, eps) + 1.0)
    said = _use_fused_elementwise_ops(model, torch.float32)
    assert fused_count(model) == 0 and "disagree" in caplog.text
    assert said.startswith("torch's modules (the fused kernels failed their start-up check: "
                           "worst rms_norm")
    monkeypatch.setattr(cuda_ops, "rms_norm", right)
    assert _use_fused_elementwise_ops(model, torch.float32).startswith("fused CUDA kernels")
    assert fused_count(model) == 2 * 2 + 1
    monkeypatch.setenv(ce.ENV_FLAG, "0")      # a later runner on the same (swapped) model
    caplog.clear()
    assert _use_fused_elementwise_ops(model, torch.float32).startswith("fused CUDA kernels")
    assert fused_count(model) == 5 and "they stay" in caplog.text


def test_fused_elementwise_swap_replaces_every_module_and_keeps_the_weights(monkeypatch):
    """The module swap (the kernels themselves run on the GPU only: tests/gpu/test_elementwise.py)
    and its switch, on unless FERROBATCH_CUDA_FUSED_OPS=0."""
    from ferrobatch.model.config import ModelConfig
    from ferrobatch.model.llama import LlamaForCausalLM, RMSNorm, SiluAndMul
    from ferrobatch.model.rope import ApplyRotary
    from ferrobatch.runtime import cuda_elementwise as ce

    config = ModelConfig(arch="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                         num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8)
    model = LlamaForCausalLM(config)
    weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    assert ce.swap_cuda_elementwise_ops(model) == 3 * 2 + 1 + 3 + 3
    kinds = [type(m) for m in model.modules()]
    assert RMSNorm not in kinds and SiluAndMul not in kinds and ApplyRotary not in kinds
    assert {id(m.weight) for m in model.modules() if isinstance(m, ce.CudaRMSNorm)} == weights
    assert ce.swap_cuda_elementwise_ops(model) == 0          # nothing left to swap
    for value, want in (("1", True), ("0", False), ("yes", True)):
        monkeypatch.setenv(ce.ENV_FLAG, value)
        assert ce.fused_ops_requested() is want
    monkeypatch.delenv(ce.ENV_FLAG)
    assert ce.fused_ops_requested() is True
