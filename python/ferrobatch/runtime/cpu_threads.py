"""Who runs in parallel during a CPU forward: the Rust kernels, not torch.

The Rust kernels (linear layers, decode attention) split their work over a pool of persistent
threads that keep polling for the next call for a moment after each one (``cpu_pool.rs``).
torch's OpenMP workers busy at the same time would make more runnable threads than cores, and
the OS then time-slices a kernel's threads in milliseconds. So the CPU forward runs torch
single-threaded (what is left to it are small elementwise ops) and hands the thread count torch
had to the kernels.

Measured on the 2-core dev VM (SmolLM2, one 256-token prefill step): letting torch keep its two
threads and the workers sleep after every call instead was slower in every part: 705-754 ms
against 656-674 ms, the norms and RoPE themselves 1.4-1.7x slower on two threads; only the
reference prefill attention gained (~91 vs ~110 ms). So that one op gets the kernels' threads
back (``torch_threads``, in the CPU attention backend) while the pool's workers idle: it is one
long call, where the workers' few hundred microseconds of polling do not matter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op thread count is ``num_threads`` inside, restored after (also on error)."""
    before = torch.get_num_threads()
    if before == num_threads:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torch_single_threaded():
    """torch's intra-op thread count is 1 inside, restored after (also on error)."""
    return torch_threads(1)
