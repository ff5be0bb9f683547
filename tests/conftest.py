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
from machine_share import machine_share  # noqa: E402

#: the files whose launches take longest (most CPU), run first: under pytest-xdist (``-n 2``, a file per worker at a
#: time, in this order) the workers then end together instead of one running a long launch alone at the end
FIRST = (
    "test_big_models.py", "test_tensor_parallel.py", "test_launched.py", "test_llama_3d.py", "test_example.py",
    "test_docs_examples.py", "test_transparency.py", "test_local_exits.py", "test_state_contract.py",
)  # fmt: skip
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`FIRST`'s files first, the others in their order."""
    rank = {name: index for index, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A ``timed`` test has the machine to itself under pytest-xdist (`machine_share`)."""
    with machine_share(item):
        return (yield)


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
