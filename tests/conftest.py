"""Shared fixtures: every test fails if it leaves pipeline threads or child processes behind."""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def _pipe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lightning_pipe-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaked_workers() -> Iterator[None]:
    before = set(_pipe_threads())
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        leaked = [t for t in _pipe_threads() if t not in before]
        if not leaked:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"test left pipeline threads running: {[t.name for t in leaked]}")
