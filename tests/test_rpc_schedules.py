"""The new schedules, runners and async training over ``transport="rpc"`` (stages in worker processes)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from rpc_models import worker_pool
from test_async import data as async_data
from test_async import reference_2bw
from test_rpc import data, mlp

from lightning_pipe import Pipeline
from lightning_pipe.comm.rpc import RpcCommunicator
from lightning_pipe.engine import StageProtocol


@pytest.fixture(scope="module")
def pool() -> Iterator[RpcCommunicator]:
    yield from worker_pool(2)


@pytest.mark.parametrize(
    "schedule,virtual,runner,checkpoint",
    [
        ("interleaved-1f1b", 2, "parallel", "never"),
        ("interleaved-1f1b", 2, "dataflow", "always"),
        ("zero-bubble", 1, "parallel", "always"),
        ("zero-bubble", 1, "dataflow", "never"),
        ("zbv", 2, "parallel", "always"),  # a V: stages 0 and 3 in worker 0, 1 and 2 in worker 1
        ("dualpipev", 2, "dataflow", "never"),
        ("interleaved-zero-bubble", 2, "parallel", "never"),
        ("looped-bfs", 2, "parallel", "always"),
    ],
)
def test_gradients_equal_unsplit(
    pool: RpcCommunicator, schedule: str, virtual: int, runner: str, checkpoint: str
) -> None:
    model = mlp()
    x, y = data()
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    with Pipeline(
        model, stages=2 * virtual, schedule=schedule, virtual_stages=virtual, runner=runner,
        checkpoint=checkpoint, transport=pool, partition="uniform", timeout=60,
    ) as pipe:  # fmt: skip
        v_shaped = schedule in ("zbv", "dualpipev")
        assert pipe.coordinator.rank_of_stage == ([0, 1, 1, 0] if v_shaped else [0, 1] * virtual)
        for microbatches in (2, 4) if schedule != "dualpipev" else (4, 8):  # dualpipev: a microbatch per stage
            pipe.coordinator.stages.call(StageProtocol.zero_grad, True)
            pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
            got = pipe.grads()
            for name, want in expected.items():
                torch.testing.assert_close(got[name], want, atol=1e-5, rtol=0, msg=f"{name}, {microbatches} mb")


def test_async_weight_stashing_over_rpc(pool: RpcCommunicator) -> None:
    """The optimizer factory travels to the workers (a partial, not a lambda); the result equals the replay."""
    model, split, batches = mlp(depth=4), [3, 4], async_data(5)
    expected = reference_2bw(model, split, batches, 2, lr=0.3)
    with Pipeline(model, stages=2, schedule="async", partition=split, transport=pool, timeout=60) as pipe:
        run = pipe.train_async(batches, F.cross_entropy, functools.partial(torch.optim.SGD, lr=0.3), 2)
        pipe.sync_module()
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0)
    assert [s.max for s in run.staleness] == [1, 0]
