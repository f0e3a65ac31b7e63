"""The load's freed memory goes back to the OS (``runtime/heap.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ferrobatch.runtime.heap import resident_bytes, return_freed_memory

glibc_linux = pytest.mark.skipif(resident_bytes() is None or return_freed_memory() is None,
                                 reason="needs Linux /proc and glibc's malloc_trim")


@glibc_linux
def test_memory_freed_to_the_heap_is_returned():
    """200 MB malloc'ed in 1 MB pieces (kept on the heap: no mmap, no automatic trim), touched,
    freed: glibc keeps it resident until ``return_freed_memory`` hands it back."""
    probe = """
import ctypes
from ferrobatch.runtime.heap import resident_bytes, return_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
chunks = [libc.malloc(1 << 20) for _ in range(200)]
for c in chunks:
    ctypes.memset(c, 1, 1 << 20)
held = resident_bytes()
for c in chunks:
    libc.free(c)
kept = resident_bytes()
print(held - kept, return_freed_memory())
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    released_by_free, released_by_trim = int(out[0]), int(out[1])
    assert released_by_free < 50 << 20          # free() alone gave little back
    assert released_by_trim > 150 << 20         # the trim returned most of the 200 MB
