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
    "test_big_models.py", "test_tensor_parallel.py", "test_compiled_split.py", "test_launched.py", "test_example.py",
    "test_llama_3d.py", "test_docs_examples.py", "test_local_exits.py", "test_launched_validation.py",
    "test_state_contract.py", "test_restarts.py", "test_checkpoint_hooks.py", "test_rpc_first_contact.py",
    "test_init_accounting.py", "test_checkpoint_publish.py", "test_fault_tolerance.py",
)  # fmt: skip
#: the files that take longest of the others (``--durations``), next: the last units of work are then short ones, so
#: the workers end together
LONG = (
    "test_transparency.py", "test_async.py", "test_traced_hf.py", "test_state_contract_rpc.py", "test_rpc_lightning.py",
    "test_traced_rpc.py", "test_compress.py", "test_stage_rng.py", "test_rpc.py",
)  # fmt: skip
TIMED = "timed"  # the unit of work of every ``timed`` test
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker computes with one intra-op thread: two workers of two threads each on the
    2-core machine spin OpenMP threads against each other (a plain reference beside a launch took 3-6 s instead of
    0.1 s, `helpers.one_thread`). The processes tests start set their own (`launching.base_env`: OMP_NUM_THREADS=1)."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`LAUNCHES`' files first, then `LONG`'s, then the others. Under pytest-xdist (``--dist loadgroup``) a file is
    one unit of work, except the ``timed`` tests: they are one unit together, `TIMED`, so one worker runs them one
    after another. Apart, each waited for the other worker's (`machine_share`), which left a core idle; together they
    still never run beside a launch. `TIMED` comes after the first `LONG` files, when no launch is left to wait for."""
    launches = [name for name in LAUNCHES if any(item.path.name == name for item in items)]
    long = [name for name in LONG if any(item.path.name == name for item in items)]
    others = [name for name in dict.fromkeys(item.path.name for item in items) if name not in {*launches, *long}]
    order = [*launches, *long[:2], TIMED, *long[2:], *others]
    rank = {name: index for index, name in enumerate(order)}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))
    items.sort(key=lambda item: rank[_unit(item)])


def _unit(item: pytest.Item) -> str:
    """The unit of work ``item`` belongs to under pytest-xdist: `TIMED`, or its file."""
    return TIMED if item.get_closest_marker("timed") is not None else item.path.name


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
