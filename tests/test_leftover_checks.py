"""A leftover check names the processes the test started and nothing else (`processes`).

torch, CUDA libraries and pytest-xdist keep helper processes as children of the test process: a
check that listed every child failed wherever one was running. These tests start such a helper
(inductor's compile workers) before a pipeline's leftover check, and show that the check still finds
what a test or lightning_pipe started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from processes import OWNER_ENV, leftover_processes, marked_by, owned_env, started_by
from torch import nn

from lightning_pipe import Pipeline
from lightning_pipe.comm.local_workers import SPAWNED_ENV


def children() -> list[int]:
    """Live children of this process, whoever started them (what the old leftover check listed)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(int(entry))
    return found


@pytest.fixture
def compile_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """inductor's pool of compile worker processes, as a compile with several compile threads starts it."""
    from torch._inductor import async_compile, config

    monkeypatch.setattr(config, "compile_threads", 2)
    monkeypatch.setattr(config, "worker_start_method", "subprocess")
    before = set(children())
    async_compile.AsyncCompile.warm_pool()
    async_compile.AsyncCompile.wait_pool_ready(timeout=120)
    try:
        yield sorted(set(children()) - before)
    finally:
        async_compile.shutdown_compile_workers()


@pytest.mark.slow
def test_a_helper_process_of_torch_does_not_count_as_left_behind(compile_workers: list[int]) -> None:
    assert compile_workers, "inductor started no compile worker process"
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    with Pipeline(model, stages=2, partition=[2, 1], transport="rpc", timeout=60) as pipe:
        workers = set(pipe.communicator.pids.values())  # type: ignore[attr-defined]
        assert workers <= set(started_by())  # the stage workers carry lightning_pipe's marker
        pipe.train_step(torch.randn(8, 8), torch.zeros(8, dtype=torch.long), F.cross_entropy)
    assert leftover_processes() == []
    helpers = [pid for pid in compile_workers if pid in children()]
    assert helpers, "the compile workers ended: nothing left to tell apart"  # the old check named these


def test_a_process_the_test_started_is_found_until_it_ends() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=owned_env(dict(os.environ)))
    try:
        assert leftover_processes(timeout=0) == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait(30)
    assert leftover_processes(timeout=0) == []


def test_the_owner_mark_names_one_pid_exactly() -> None:
    """``...OWNER=123`` is not owned by 1234 (nor by 12), and the spawn mark ``local-123-`` not by 1234."""
    assert marked_by([b"PATH=/bin", f"{OWNER_ENV}=123".encode()], 123)
    assert not marked_by([f"{OWNER_ENV}=123".encode()], 12)
    assert not marked_by([f"{OWNER_ENV}=1234".encode()], 123)
    assert marked_by([f"{SPAWNED_ENV}=local-123-rpc0".encode()], 123)
    assert not marked_by([f"{SPAWNED_ENV}=local-1234-rpc0".encode()], 123)
    assert not marked_by([f"{SPAWNED_ENV}=local-123-rpc0".encode()], 12)


def test_a_process_of_a_longer_pid_is_not_counted() -> None:
    """A process marked with this pid followed by more digits is someone else's: `started_by` skips it."""
    other = dict(os.environ) | {OWNER_ENV: f"{os.getpid()}1"}
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=other)
    try:
        assert sleeper.pid not in started_by()
        assert sleeper.pid in started_by(int(f"{os.getpid()}1"))
    finally:
        sleeper.kill()
        sleeper.wait(30)
