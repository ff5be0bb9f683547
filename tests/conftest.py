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
    """`LAUNCHES`' files first, then the others in their order, the files with a ``timed`` test spread over their last
    half: under xdist a timed test waits for the other worker's running launch (at the start that may take minutes)
    or timed test, but not for an ordinary test, which so runs beside it."""
    launches = [name for name in LAUNCHES if any(item.path.name == name for item in items)]
    timed = {item.path.name for item in items if item.get_closest_marker("timed") is not None} - set(launches)
    others = list(dict.fromkeys(item.path.name for item in items if item.path.name not in {*launches, *timed}))
    half = len(others) // 2
    order = [*launches, *others[:half], *_spread(sorted(timed), others[half:])]
    rank = {name: index for index, name in enumerate(order)}
    items.sort(key=lambda item: rank[item.path.name])


def _spread(few: list[str], many: list[str]) -> list[str]:
    """``many`` cut into ``len(few) + 1`` runs, one of ``few`` between each two."""
    out: list[str] = []
    runs = len(few) + 1
    for index in range(runs):
        out += many[index * len(many) // runs : (index + 1) * len(many) // runs]
        out += few[index : index + 1]
    return out


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
