"""The KV cache's host memory (`runtime/host_memory.py`): zeroed, aligned, alive as long as any
view of it, on huge pages where the kernel lends them, and read alike by the kernels."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from ferrobatch.model.config import ModelConfig
from ferrobatch.runtime import host_memory
from ferrobatch.runtime.host_memory import (
    HUGE_PAGE_BYTES,
    huge_pages_available,
    zeros_on_huge_pages,
)
from ferrobatch.runtime.kv_cache import KVCache

needs_madvise = pytest.mark.skipif(not huge_pages_available(), reason="no MADV_HUGEPAGE here")


def _anon_huge_pages_kib() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _thp_mode() -> str | None:
    """The bracketed mode of /sys/kernel/mm/transparent_hugepage/enabled, if readable."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


@needs_madvise
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_tensors_are_zeroed_aligned_and_outlive_their_mapping_name(dtype):
    shape = (2, 700, 16, 3, 64)     # 2 x 700 blocks of SmolLM2's: > one huge page
    t = zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(torch.count_nonzero(t)) == 0
    view = t[1, 5:9].numpy()        # what the kernels get
    del t
    gc.collect()
    view[...] = 3                   # the mapping is still there (the tensor held it)
    assert float(view.sum()) == 3 * view.size


@needs_madvise
def test_small_tensors_stay_on_torchs_allocator(monkeypatch):
    mapped = []
    real_mmap = host_memory.mmap.mmap
    monkeypatch.setattr(host_memory.mmap, "mmap",
                        lambda *a, **k: mapped.append(a) or real_mmap(*a, **k))
    small = zeros_on_huge_pages((4, 16, 3, 64), torch.float32)
    assert mapped == [] and int(torch.count_nonzero(small)) == 0
    zeros_on_huge_pages((HUGE_PAGE_BYTES // 4,), torch.float32)
    assert len(mapped) == 1


def test_without_madvise_it_is_torch_zeros(monkeypatch):
    monkeypatch.setattr(host_memory, "huge_pages_available", lambda: False)
    t = zeros_on_huge_pages((2, 700, 16, 3, 64), torch.float32)
    assert int(torch.count_nonzero(t)) == 0 and t.shape == (2, 700, 16, 3, 64)


@needs_madvise
def test_the_kernel_lends_huge_pages_when_its_mode_allows():
    if _thp_mode() not in ("always", "madvise") or _anon_huge_pages_kib() is None:
        pytest.skip("transparent huge pages are off (or unreadable) on this machine")
    before = _anon_huge_pages_kib()
    t = zeros_on_huge_pages((16 * HUGE_PAGE_BYTES // 4,), torch.float32)   # 32 MiB, touched
    after = _anon_huge_pages_kib()
    # other processes' huge pages move this count too: ask for most of ours, not all
    assert after - before >= 8 * 1024, (before, after)
    del t


@needs_madvise
def test_cpu_kv_cache_sits_on_huge_page_memory_and_attends_alike():
    """The CPU KVCache's layers come from `zeros_on_huge_pages`; the decode kernel reads them
    exactly as a torch-allocated copy of the same values."""
    from ferrobatch import _scheduler

    config = ModelConfig(arch="llama", vocab_size=10, hidden_size=576, intermediate_size=8,
                         num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64)
    cache = KVCache(config, 400, 16, "cpu", torch.float32)
    assert all(layer.data_ptr() % HUGE_PAGE_BYTES == 0 for layer in cache.layers)
    layer = cache.layers[1]
    layer.normal_()
    copy = layer.clone()
    rng = np.random.default_rng(0)
    tables = rng.permutation(400)[:4 * 20].astype(np.int32).reshape(4, 20)
    ctx = np.array([320, 1, 77, 200], np.int32)
    q = rng.standard_normal((4, 9, 64), dtype=np.float32)
    outs = []
    for kv in (layer, copy):
        out = np.empty_like(q)
        _scheduler.paged_decode_attention_f32(q, kv[0].numpy(), kv[1].numpy(), tables, ctx, out,
                                              0.125, 2)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
