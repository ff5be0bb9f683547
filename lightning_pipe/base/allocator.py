"""Freed tensors go back to the system: glibc's ``malloc`` told to map big blocks and unmap them when freed.

glibc serves a block of 128 KiB or more with its own ``mmap`` and gives it back when freed, but after the
first such free it raises that threshold to the freed size (up to 32 MiB) and serves later blocks from its
heap, whose freed space it keeps. A stage's weight gradients are made and freed every microbatch, so a process
training a big stage would hold freed space beside its stage (`benchmarks/memory.py` shows the difference).
Launched mode's processes, rpc mode's workers and the process that starts an rpc world (it holds the last
stage) therefore fix the threshold (`give_back_large_blocks`): blocks from 8 MiB up are always mapped and
always given back. Small tensors (activations of small models) keep glibc's default. Not glibc (another libc,
macOS, Windows): nothing changes. ``LIGHTNING_PIPE_MMAP_THRESHOLD`` (bytes, 0: glibc's default) overrides it.
There is no torch setting for this: torch allocates CPU tensors with the C library's allocator.
"""

from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 8 << 20
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
_ENV = "LIGHTNING_PIPE_MMAP_THRESHOLD"


def give_back_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make this process's ``malloc`` map blocks of ``threshold`` bytes and more (glibc); whether it did."""
    threshold = int(os.environ.get(_ENV, threshold))
    if threshold <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        # fixing one threshold stops glibc from moving the other: the heap's top is then trimmed whenever 128 KiB
        # are free there, a system call and fresh pages for every small tensor made and freed in a step (measured:
        # 3x the system time of a pipeline step); glibc's own rule keeps twice the mmap threshold
        libc.mallopt(ctypes.c_int(_M_TRIM_THRESHOLD), ctypes.c_int(2 * threshold))
        return bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold)))
    except (OSError, AttributeError):  # not glibc
        return False
