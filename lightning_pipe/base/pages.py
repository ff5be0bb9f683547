"""Giving a range of memory pages back to the system (Linux ``madvise(MADV_DONTNEED)``); elsewhere nothing."""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # <sys/mman.h>; Linux


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def can_give_back() -> bool:
    """Whether `give_back` does anything here (Linux with a C library that has ``madvise``)."""
    return _libc is not None


def give_back(first: int, last: int) -> None:
    """Tell the system it may drop the pages from address ``first`` to ``last`` (both page-aligned)."""
    if _libc is not None and last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
