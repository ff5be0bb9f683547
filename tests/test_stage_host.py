"""`StageHost`, the one way every transport builds, serves, reports and stops a stage worker (local threads here;
rpc and launched mode run the same object: test_rpc_home.py, test_rpc_faults.py, test_p2p.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from torch import nn

from lightning_pipe.base.errors import StageError, TransportError
from lightning_pipe.comm.base import COORDINATOR, Message, MessageKind, QueueInbox
from lightning_pipe.comm.host import StageHost
from lightning_pipe.comm.local import LocalCommunicator, LocalEndpoint

CRASH = "crash"  # a message kind that breaks `Worker`'s loop


class Worker:
    """A stage worker's shape: built from (spec, endpoint), ``runtimes``, ``serve`` until STOP."""

    def __init__(self, spec: Any, endpoint: Any) -> None:
        if spec.options.get("fail"):
            raise ValueError("no such layer")
        self.endpoint = endpoint
        self.runtimes: dict[int, Any] = {}

    def serve(self) -> None:
        while True:
            message = self.endpoint.recv(0.05)
            if message is None:
                continue
            if message.kind == MessageKind.STOP:
                return
            if message.kind == CRASH:
                raise RuntimeError("the loop broke")
            if message.kind == "interrupt":
                raise KeyboardInterrupt


def spec(rank: int, stage: int, **options: Any) -> SimpleNamespace:
    shard = SimpleNamespace(index=stage, device="cpu", module=nn.Linear(2, 2))
    return SimpleNamespace(rank=rank, shards=[shard], runtime=None, options=dict(options))


def stage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("lightning_pipe-stage-")]


def test_a_crashed_loop_is_raised_as_its_stage_error_and_every_thread_is_joined() -> None:
    communicator = LocalCommunicator(threads=1)
    endpoint = communicator.launch([spec(0, 0), spec(1, 5)], Worker)
    assert sorted(stage_threads()) == ["lightning_pipe-stage-0", "lightning_pipe-stage-1"]
    communicator.check_alive()  # both serve
    endpoint.send(1, Message(CRASH))
    until = time.monotonic() + 10.0
    with pytest.raises(StageError) as info:
        while time.monotonic() < until:
            communicator.check_alive()
            time.sleep(0.01)
    error = info.value
    assert (error.stage, error.microbatch, error.action) == (5, None, None)  # named by the rank's first stage
    assert "stage 5 failed: its event loop crashed: RuntimeError: the loop broke" in str(error)
    assert "in serve" in error.remote_traceback
    communicator.shutdown(5.0)
    assert stage_threads() == []  # the crashed thread and the one stopped: both joined


def test_a_failed_local_build_raises_its_own_error_and_stops_the_threads_started() -> None:
    communicator = LocalCommunicator(threads=1)
    with pytest.raises(ValueError, match="no such layer"):  # one process: the user's own exception
        communicator.launch([spec(0, 0), spec(1, 1, fail=True)], Worker)
    assert stage_threads() == []


def test_a_failed_build_is_a_stage_error_naming_the_stage_with_its_cause() -> None:
    inboxes = {COORDINATOR: QueueInbox(), 0: QueueInbox()}
    host = StageHost(spec(0, 3, fail=True), Worker, LocalEndpoint(0, inboxes))
    failure = host.build()
    assert failure is not None and (failure.stage, failure.action) == (3, "build")
    assert "building the stage failed: ValueError: no such layer" in str(failure)
    assert isinstance(failure.__cause__, ValueError) and "in __init__" in failure.remote_traceback
    assert host.stop(1.0)  # nothing was started: nothing to wait for


def test_serving_in_the_callers_thread_reports_a_crash_and_raises_it() -> None:
    """A serving process of launched mode serves in its main thread: the crash is told (to the coordinator, there)
    and raised; Ctrl-C carries no traceback. A lost peer (TransportError) is no crash of this stage."""
    inboxes = {COORDINATOR: QueueInbox(), 0: QueueInbox()}
    told: list[StageError] = []
    host = StageHost(spec(0, 0), Worker, LocalEndpoint(0, inboxes), on_crash=told.append)
    assert host.build() is None and host.describe()["rank"] == 0
    inboxes[0].put(Message("interrupt"))
    with pytest.raises(KeyboardInterrupt):
        host.serve()
    assert [e.error for e in told] == ["it was interrupted (KeyboardInterrupt)"] and told[0].remote_traceback == ""

    class Lost(Worker):
        def serve(self) -> None:
            raise TransportError("global rank 1 is lost")

    host = StageHost(spec(0, 0), Lost, LocalEndpoint(0, inboxes), on_crash=told.append)
    assert host.build() is None
    with pytest.raises(TransportError):
        host.serve()
    assert host.crash is None and len(told) == 1
