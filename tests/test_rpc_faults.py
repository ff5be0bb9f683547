"""transport="rpc" when things go wrong: each fault ends within its bound, names what failed, leaves no process."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from ctrl_c import CtrlCAt, sigint_raises
from processes import leftover_processes
from rpc_models import FailsOn, Sleeps
from torch import nn

from lightning_pipe import Pipeline, PipeTimeoutError, StageError, TransportError
from lightning_pipe.comm.rpc import RpcCommunicator

pytestmark = pytest.mark.timed  # bounds waits by the clock: alone under xdist (tests/machine_share.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_stage_exception_reaches_the_coordinator_with_host_and_traceback() -> None:
    # stage 0 runs in a worker process (the last stage in the coordinator's: test_rpc_home)
    model = nn.Sequential(FailsOn(123.0), nn.Identity(), nn.Linear(4, 2))
    x, y = torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)
    x[5, 0] = 123.0  # row 5 is in microbatch 2 of 4
    with Pipeline(model, stages=2, partition=[1, 2], transport="rpc", timeout=60) as pipe:
        pids = pipe.communicator.pids  # type: ignore[attr-defined]
        with pytest.raises(StageError) as info:
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        error = info.value
        assert (error.stage, error.microbatch, error.action) == (0, 2, "0F2")
        assert error.host is not None and f"pid {pids[0]}" in error.host and "127.0.0.1" in error.host
        assert f"stage 0 on {error.host} failed in action 0F2 (microbatch 2)" in str(error)
        assert "ValueError: bad row reached the stage" in str(error)
        assert "rpc_models.py" in error.remote_traceback and "in forward" in error.remote_traceback
        pipe.train_step(torch.zeros(8, 4), y, F.cross_entropy, microbatches=4)  # still usable
    assert leftover_processes() == []


def test_sigkill_mid_step_is_detected_within_seconds() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Sleeps(0.5), nn.Linear(8, 3))  # stage 0 is busy 0.5 s a microbatch
    x, y = torch.randn(8, 8), torch.zeros(8, dtype=torch.long)
    communicator = RpcCommunicator()
    with Pipeline(model, stages=2, partition=[2, 1], transport=communicator, timeout=120) as pipe:
        victim = communicator.pids[0]  # the worker process of stage 0 (stage 1 runs in this process)
        plane = communicator.data_plane
        assert plane is not None and plane.direct is not None, "two processes: stage 1 reads its link itself"
        assert plane.sockets, "two processes of one machine: their link is one TCP connection (p2p.socket_group)"
        killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
        start = time.monotonic()
        killer.start()
        try:
            where = rf"stage 0 \(rank 0\) on \S+ \(127\.0\.0\.1, pid {victim}\): was killed by SIGKILL"
            with pytest.raises(TransportError, match=where):
                pipe.train_step(x, y, F.cross_entropy, microbatches=8)
        finally:
            killer.join()
        elapsed = time.monotonic() - start
    assert elapsed < 30, f"the lost worker was noticed after {elapsed:.1f} s"
    assert leftover_processes() == [], "worker processes left behind"


def test_a_silent_worker_is_lost_after_the_heartbeat_timeout() -> None:
    """A worker that stops answering (SIGSTOP: a hung machine, a cut network) is noticed without a timeout."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    communicator = RpcCommunicator(heartbeat_timeout=3.0)
    with Pipeline(model, stages=2, transport=communicator, timeout=120) as pipe:
        victim = communicator.pids[0]  # the worker process of stage 0 (stage 1 runs in this process)
        plane = communicator.data_plane
        assert plane is not None and plane.direct is not None, "two processes: stage 1 reads its link itself"
        os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TransportError, match=rf"stage 0 \(rank 0\) on .*pid {victim}\): no heartbeat for \d+ s"):
            pipe.train_step(torch.randn(8, 8), torch.zeros(8, dtype=torch.long), F.cross_entropy)
        assert time.monotonic() - start < 15
        closing = time.monotonic()
    # the stage of this process was reading the stopped worker's link: the link ends, the stage stops at once
    assert time.monotonic() - closing < 5
    assert leftover_processes() == []  # the stopped process was killed


def test_ctrl_c_mid_step_stops_every_worker() -> None:
    """Workers ignore SIGINT (a terminal sends it to the whole process group); the coordinator ends them, and the
    next pipeline of this process works."""
    trigger = CtrlCAt("forward", os.getpid(), call=3)  # stage 1 presses Ctrl-C in its third forward
    model = nn.Sequential(nn.Linear(8, 8), Sleeps(0.2), trigger, nn.Linear(8, 3))
    x, y = torch.randn(8, 8), torch.zeros(8, dtype=torch.long)
    with sigint_raises() as interrupts:  # SIGINT raises, however the tests were started
        trigger.armed = True
        with pytest.raises(KeyboardInterrupt):
            with Pipeline(model, stages=2, partition=[1, 3], transport="rpc", timeout=120) as pipe:
                pipe.train_step(x, y, F.cross_entropy, microbatches=8)
        assert interrupts.since_last() < 10
        assert leftover_processes() == []
        trigger.armed = False
        with Pipeline(model, stages=2, partition=[1, 3], transport="rpc", timeout=120) as pipe:
            assert len(pipe.train_step(x, y, F.cross_entropy, microbatches=8).losses) == 8
    assert leftover_processes() == []


def test_worker_that_never_joins_ends_in_a_clear_timeout() -> None:
    port = free_port()
    start = time.monotonic()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = Pipeline(model, stages=2, transport="rpc", timeout=2.0, coordinator=f"127.0.0.1:{port}", token="secret")
    # the last of the 2 stages runs in the coordinator's process: 1 worker is awaited
    where = rf"only 0 of 1 stage slots joined the coordinator at 127\.0\.0\.1:{port} within the timeout"
    with pytest.raises(PipeTimeoutError, match=where):
        pipe.start()
    assert time.monotonic() - start < 10
    with socket.socket() as s:  # the control port is closed again
        assert s.connect_ex(("127.0.0.1", port)) != 0
