"""Large zeroed host tensors on transparent huge pages, where the kernel offers them.

Decode attention on the CPU reads the whole KV cache every step, block by block in the order
the block tables give: with 4 KiB pages every block's few pages each cost a TLB miss and a page
walk that the kernel's prefetch cannot run ahead of. On 2 MiB pages the same reads measured
1.09x faster over randomly placed blocks (SmolLM2, 16 sequences x 256 and 1024 keys, 30
layers from DRAM, AMD EPYC Zen 3, session 22: ``benches/cpu_kernels.py --only hugepages``).

Linux lends huge pages to an anonymous mapping when asked with ``madvise(MADV_HUGEPAGE)`` before
the memory is first touched (``/sys/kernel/mm/transparent_hugepage/enabled`` at ``always`` or
``madvise``; at ``never`` the mapping simply stays on 4 KiB pages). The tensor's pages are
written (zeroed) at once, as ``torch.zeros`` does: the memory is committed when the engine
starts, not piecemeal under load, so a cache that does not fit fails then and resident memory
stays flat afterwards. Elsewhere (no ``MADV_HUGEPAGE``: macOS, Windows) this is ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20

# Below one huge page a tensor stays on torch's allocator. (Above it nothing is wasted: the
# mapping's alignment slack is never touched, so it is address space, not memory.)
MIN_HUGE_TENSOR_BYTES = HUGE_PAGE_BYTES


def huge_pages_available() -> bool:
    """Whether this platform can ask for transparent huge pages (``MADV_HUGEPAGE``)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` whose memory starts on a 2 MiB boundary of an anonymous
    mapping advised ``MADV_HUGEPAGE``, every page already touched; ``torch.zeros`` where that is
    unavailable or the tensor is under one huge page. The tensor keeps the mapping alive (its
    views and numpy arrays too)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    count = math.prod(shape)
    nbytes = count * element_size
    if not huge_pages_available() or nbytes < MIN_HUGE_TENSOR_BYTES:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:     # a kernel built without transparent huge pages: plain pages, still zeroed
        pass
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -address % HUGE_PAGE_BYTES
    flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset)
    return flat.zero_().view(shape)     # faults every page in now (huge ones where lent)
