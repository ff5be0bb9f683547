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

#: the files that launch many processes, the most CPU first: they run first, so that under pytest-xdist (``-n 2``, a
#: file per worker at a time, in this order) the workers end together instead of one running a long launch alone at
#: the end, and never beside a ``timed`` test (`machine_share`)
LAUNCHES = (
    "test_big_models.py", "test_tensor_parallel.py", "test_launched.py", "test_example.py", "test_llama_3d.py",
    "test_docs_examples.py", "test_local_exits.py", "test_launched_validation.py", "test_state_contract.py",
    "test_rpc_first_contact.py",
)  # fmt: skip
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`LAUNCHES`' files first, the others in their order."""
    rank = {name: index for index, name in enumerate(LAUNCHES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LAUNCHES)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A ``timed`` test runs beside no launch under pytest-xdist (`machine_share`)."""
    with machine_share(item, launches=item.path.name in LAUNCHES):
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
