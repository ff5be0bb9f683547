"""transport="rpc": the coordinator's process holds the rank of the last stage itself, as launched mode does.

Its output and the output's gradient never cross processes and the loss is computed on the last stage;
the worker processes serve the other ranks. Where that cannot be (``colocate=False``, one rank holding
every stage) every rank runs in a worker process and the log says why.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import mlp
from rpc_models import FailsOn, assert_grads_equal, classification_data, unsplit_grads, worker_pool
from torch import nn

from lightning_pipe import Pipeline, StageError
from lightning_pipe.comm import COORDINATOR, MessageKind
from lightning_pipe.comm.rpc import RpcCommunicator


@pytest.fixture(scope="module")
def pool() -> Iterator[RpcCommunicator]:
    yield from worker_pool(2)


def data(rows: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    return classification_data(rows)


def stage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("lightning_pipe-stage-")]


def test_the_last_stage_runs_in_the_coordinators_process(
    pool: RpcCommunicator, caplog: pytest.LogCaptureFixture
) -> None:
    model = mlp()
    x, y = data()
    want = unsplit_grads(model, x, y)
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        with Pipeline(model, stages=3, transport=pool, partition="uniform", timeout=60) as pipe:
            assert pool.ranks_served.home == 2 and pool.ranks_served.remote == [0, 1] and pool.shares_objects
            assert stage_threads() == ["lightning_pipe-stage-2"]  # its event loop, a thread of this process
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            got = pipe.grads()
            sent = pool.stats()
    assert stage_threads() == []  # stopped with the pipeline
    assert_grads_equal(got, want)
    assert "rank 2 (stage 2) in the coordinator's process on cpu, with the last stage" in caplog.text
    assert "rank 0 (stage 0) in worker process 0; rank 1 (stage 1) in worker process 1" in caplog.text
    # the losses were computed on the last stage: no output left it, no gradient of the output came to it
    assert sent[2].local[MessageKind.LOSS] == 4 and MessageKind.OUTPUT not in sent[2].messages
    assert MessageKind.GRAD not in sent[COORDINATOR].messages and MessageKind.GRAD not in sent[COORDINATOR].local


def test_a_failure_on_the_last_stage_names_the_coordinators_process(pool: RpcCommunicator) -> None:
    model = nn.Sequential(nn.Identity(), FailsOn(123.0), nn.Linear(8, 3))
    x, y = data(rows=8)
    x[5, 0] = 123.0  # row 5 is in microbatch 2 of 4
    with Pipeline(model, stages=2, partition=[1, 2], transport=pool, timeout=60) as pipe:
        with pytest.raises(StageError) as info:
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        error = info.value
        assert (error.stage, error.microbatch, error.action) == (1, 2, "1F2")
        assert error.host is not None and f"the coordinator's process, pid {os.getpid()}" in error.host
        assert "ValueError: bad row reached the stage" in str(error) and "in forward" in error.remote_traceback
        x[5, 0] = 0.0
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)  # still usable


def test_virtual_stages_bring_the_whole_last_rank(pool: RpcCommunicator) -> None:
    """interleaved-1f1b, 4 stages on 2 ranks: rank 1 (stages 1 and 3) runs here, its stage 1 feeds rank 0's stage 2."""
    model = mlp(depth=4)
    x, y = data()
    want = unsplit_grads(model, x, y)
    with Pipeline(
        model, stages=4, virtual_stages=2, schedule="interleaved-1f1b", transport=pool, partition="uniform", timeout=60
    ) as pipe:  # fmt: skip
        assert pool.ranks_served.home == 1 and pool.ranks_served.remote == [0]
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        pipe.coordinator.settle()
        got = pipe.grads()
        sent = pool.stats()
    assert_grads_equal(got, want)
    assert sent[1].messages[MessageKind.ACTIVATION] == 4 and sent[1].local[MessageKind.LOSS] == 4


def test_one_rank_holding_every_stage_stays_in_a_worker(
    pool: RpcCommunicator, caplog: pytest.LogCaptureFixture
) -> None:
    model = mlp()
    x, y = data()
    want = unsplit_grads(model, x, y)
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        with Pipeline(model, stages=2, runner="linear", transport=pool, partition="uniform", timeout=60) as pipe:
            assert pool.ranks_served.home is None and not pool.shares_objects
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            got = pipe.grads()
    assert_grads_equal(got, want)
    assert "every rank in a worker process (one rank holds every stage" in caplog.text


def test_colocate_false_keeps_every_rank_in_a_worker_process(pool: RpcCommunicator) -> None:
    """Decided at each launch: the same pool runs a pipeline the earlier way."""
    model = mlp()
    x, y = data()
    want = unsplit_grads(model, x, y)
    pool.colocate = False
    try:
        with Pipeline(model, stages=2, transport=pool, partition="uniform", timeout=60) as pipe:
            assert pool.ranks_served.home is None and pool.ranks_served.remote == [0, 1] and not pool.shares_objects
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            got = pipe.grads()
            sent = pool.stats()
    finally:
        pool.colocate = True
    assert_grads_equal(got, want)
    # the coordinator computed the losses: the last stage's outputs and their gradients crossed
    assert sent[1].messages[MessageKind.OUTPUT] == 4 and sent[COORDINATOR].messages[MessageKind.GRAD] == 4


def test_a_v_placed_schedule_brings_rank_0_with_the_first_and_last_stages(
    pool: RpcCommunicator, caplog: pytest.LogCaptureFixture
) -> None:
    """zbv puts the last stage on rank 0, with stage 0: rank 0 runs here and the pool's slot 0 serves rank 1, so a
    microbatch's input, its output and the loss never cross processes (as launched mode places a V); the gradients
    are the unsplit model's. Then a 1F1B pipeline on the same pool maps slot 0 to rank 0 again."""
    model = mlp(depth=4)
    x, y = data()
    want = unsplit_grads(model, x, y)
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        with Pipeline(
            model, stages=4, virtual_stages=2, schedule="zbv", transport=pool, partition="uniform", timeout=60
        ) as pipe:  # fmt: skip
            assert pool.ranks_served.home == 0 and pool.ranks_served.remote == [1] and pool.shares_objects
            assert set(pool.pids) == {1}  # rank 1's worker process: the pool's first slot
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            pipe.coordinator.settle()
            got = pipe.grads()
            sent = pool.stats()
    assert_grads_equal(got, want)
    assert "rank 0 (stages 0, 3) in the coordinator's process on cpu, with the last stage" in caplog.text
    assert "rank 1 (stages 1, 2) in worker process 0" in caplog.text
    # the losses were computed here, on stage 3: no output left rank 0, and the coordinator sent no gradient
    assert sent[0].local[MessageKind.LOSS] == 4 and MessageKind.OUTPUT not in sent[0].messages
    assert MessageKind.GRAD not in sent[COORDINATOR].messages
    # and the microbatches' inputs went to stage 0 by reference, in this process
    assert (
        sent[COORDINATOR].local[MessageKind.ACTIVATION] == 4
        and MessageKind.ACTIVATION not in sent[COORDINATOR].messages
    )
    model = mlp()
    want = unsplit_grads(model, x, y)
    with Pipeline(model, stages=2, transport=pool, partition="uniform", timeout=60) as pipe:
        assert pool.ranks_served.home == 1 and pool.ranks_served.remote == [0] and set(pool.pids) == {0}
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        got = pipe.grads()
    assert_grads_equal(got, want)


def openmp_threads() -> int:
    """The OpenMP pool size of the calling thread as OpenMP holds it (0: no libgomp in this process).

    ``torch.get_num_threads()`` would first set the thread's pool to the process's count, which hides the case: a
    matrix multiply through MKL runs on the thread's own pool without that."""
    import ctypes

    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libgomp" in line:
                return int(ctypes.CDLL(line.split()[-1]).omp_get_max_threads())
    return 0


class OpenMPThreads(nn.Module):
    """Outputs the OpenMP pool size of the thread that runs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, float(openmp_threads()))


def test_a_worker_processs_stage_computes_with_the_processs_threads(pool: RpcCommunicator) -> None:
    """A worker process's stage thread takes the intra-op threads the worker was started with, not OpenMP's default
    of every core a new thread starts with (its matrix multiplies spun on every core against the other processes:
    an action 4-14x slower, benchmarks/overhead.py rpc against rpc@base)."""
    if not openmp_threads():
        pytest.skip("this torch does not use libgomp (the check reads OpenMP's own count)")
    model = nn.Sequential(OpenMPThreads(), nn.Identity())
    with Pipeline(model, stages=2, transport=pool, partition="uniform", timeout=60) as pipe:
        assert pool.ranks_served.remote == [0]
        threads = pipe.forward(torch.zeros(4, 2))
    assert threads.unique().tolist() == [float(pool._threads or 0)]


def test_a_pool_mapped_anew_names_the_ranks_whose_devices_moved() -> None:
    """A pool's worker processes keep the devices they were started for: a V pipeline after a 1F1B one maps slot k
    to rank k + 1, whose stage may be on another GPU; `launch` warns with these lines (no GPU needed to check them)."""
    from types import SimpleNamespace

    from lightning_pipe.comm.rpc.home import RankProcesses, moved_devices

    def specs(*devices: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(shards=[SimpleNamespace(device=d)]) for d in devices]

    started = ["cuda:0", "cuda:1"]  # a 3-rank 1F1B pool: ranks 0 and 1 in slots 0 and 1, rank 2 at home
    assert moved_devices(specs("cuda:0", "cuda:1", "cuda:2"), RankProcesses(3, 2), started) == []
    v = RankProcesses(3, 0)  # a V: rank 0 at home, slots 0 and 1 serve ranks 1 and 2
    assert moved_devices(specs("cuda:0", "cuda:1", "cuda:2"), v, started) == [
        "rank 1 (on cuda:1) in the worker started for cuda:0",
        "rank 2 (on cuda:2) in the worker started for cuda:1",
    ]
    assert moved_devices(specs("cpu", "cpu", "cpu"), v, ["cpu", "cpu"]) == []  # CPU stages move freely
