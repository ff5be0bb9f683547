"""Runners and the new schedules through `Pipeline`: the same gradients and parameters as the unsplit model."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import mlp
from torch import nn

from lightning_pipe import Pipeline
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.engine.runners import worker_lists, worker_of_stages
from lightning_pipe.schedule import Action, get_schedule, simulate

RUNNERS = ["parallel", "dataflow", "linear"]
#: (schedule, virtual_stages); 4 stages, so virtual_stages=2 means 2 ranks
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("gpipe", 2), ("zbv", 2)]


def batches(steps: int, rows: int = 14) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule,virtual", SCHEDULES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_three_sgd_steps_equal_unsplit(runner: str, schedule: str, virtual: int, checkpoint: str) -> None:
    """Step 1's gradients to 1e-5, and the parameters after 3 SGD steps (microbatches 4, 2, 6 of 14 rows)."""
    model = mlp(depth=6)
    reference = copy.deepcopy(model)
    piped_opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    with Pipeline(
        model,
        stages=4,
        schedule=schedule,
        virtual_stages=virtual,
        runner=runner,
        checkpoint=checkpoint,
        partition="uniform",
        timeout=30,
    ) as pipe:
        for step, ((x, y), microbatches) in enumerate(zip(batches(3), (4, 2, 6), strict=True)):
            pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
            F.cross_entropy(reference(x), y).backward()
            if step == 0:
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0)
            piped_opt.step()
            plain_opt.step()
            piped_opt.zero_grad()
            plain_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0)


def test_virtual_stages_share_a_worker() -> None:
    model = mlp(depth=6)
    with Pipeline(model, stages=4, virtual_stages=2, schedule="interleaved-1f1b", partition="uniform") as pipe:
        assert [sorted(shard.index for shard in spec.shards) for spec in pipe.coordinator.specs] == [[0, 2], [1, 3]]
        result = pipe.train_step(*batches(1)[0], F.cross_entropy, microbatches=4)
    assert len(result.records) == 2  # one timeline per worker, each with both of its stages
    assert {name[0] for name, _, _ in result.records[0]} == {"0", "2"}


def test_linear_runs_one_worker_thread_in_a_topological_order() -> None:
    model = mlp(depth=6)
    with Pipeline(model, stages=4, schedule="1f1b", runner="linear", partition="uniform") as pipe:
        threads = [t for t in threading.enumerate() if t.name.startswith("lightning_pipe-stage")]
        result = pipe.train_step(*batches(1)[0], F.cross_entropy, microbatches=4)
    assert len(threads) == 1
    assert len(result.records) == 1
    order = [name for name, _, _ in result.records[0]]
    assert order == [str(a) for a in worker_lists(get_schedule("1f1b")(4, 4, 1).actions(), 4, [0] * 4)[0]]
    start = simulate(get_schedule("1f1b")(4, 4, 1).actions(), 4)
    assert [start[Action.parse(a)] for a in order] == sorted(start.values())


class SlowOnMarker(nn.Module):
    """Sleeps when the first input value is large: a way to make one microbatch arrive late."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0].item() > 100:
            time.sleep(0.3)
        return x


def late_second_microbatch(num_ranks: int, num_microbatches: int) -> list[list[str]]:
    """Rank 1 asks for microbatch 1 first; it arrives 0.3 s after microbatch 0."""
    return [["0F0", "0F1", "0B0", "0B1"], ["1F1", "1F0", "1B0", "1B1"]]


@pytest.mark.parametrize("runner,first", [("parallel", "1F1"), ("dataflow", "1F0")])
def test_dataflow_runs_whatever_is_ready(runner: str, first: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(SlowOnMarker(), nn.Linear(8, 8), nn.Linear(8, 3))
    x = torch.randn(4, 8)
    x[2:, 0] = 1000.0  # microbatch 1
    with Pipeline(model, stages=2, schedule=late_second_microbatch, runner=runner, partition=[2, 1]) as pipe:
        result = pipe.train_step(x, torch.zeros(4, dtype=torch.long), F.cross_entropy, microbatches=2)
    assert result.records[1][0][0] == first


def test_runner_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="unknown runner='fast'; available: parallel, dataflow, linear"):
        worker_of_stages("fast", 4, 1)
    with pytest.raises(ConfigurationError, match="stages=5 is not a multiple of virtual_stages=2"):
        Pipeline(mlp(depth=6), stages=5, virtual_stages=2)
    with pytest.raises(ConfigurationError, match="one per rank"):
        Pipeline(mlp(depth=6), stages=4, virtual_stages=2, devices=["cpu"] * 3)
