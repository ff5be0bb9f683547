"""A train step returns once the last stage is done; the first stages finish their last backwards after it.

Where the stages own their parameters (rpc, p2p), whatever the coordinator sends a stage after a step (the
optimizer step, a call, the next step, an abort of it) waits there until that stage's step has ended. The
step's records and a first stage's late failure reach the coordinator at its next wait. Here the first
stage's backward sleeps, so that all of that arrives while it still runs its step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from rpc_models import SlowBackwardLinear, worker_pool
from torch import nn

from lightning_pipe import Pipeline, StageError
from lightning_pipe.comm.rpc import RpcCommunicator

MARKER = 123.0  # a row whose first feature is this fails the first stage's backward


@pytest.fixture(scope="module")
def pool() -> Iterator[RpcCommunicator]:
    yield from worker_pool(2)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(SlowBackwardLinear(4, 8, seconds=0.05, marker=MARKER), nn.Tanh(), nn.Linear(8, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def pipeline(net: nn.Sequential, pool: RpcCommunicator) -> Pipeline:
    return Pipeline(net, stages=2, partition=[2, 1], schedule="1f1b", checkpoint="never", transport=pool, timeout=60)


def trained_unsplit(net: nn.Sequential, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)


def test_the_optimizer_step_and_the_next_step_wait_for_the_first_stage_to_end_its_step(pool: RpcCommunicator) -> None:
    net, (x, y) = model(), data()
    want = trained_unsplit(copy.deepcopy(net), x, y, steps=3)
    results, returned = [], []
    with pipeline(net, pool) as pipe:
        optimizer = pipe.optimizer(torch.optim.SGD(pipe.module.parameters(), lr=0.5))
        for _ in range(3):
            optimizer.zero_grad()
            results.append(pipe.train_step(x, y, F.cross_entropy, microbatches=4))
            returned.append(time.perf_counter())
            optimizer.step()  # posted while the first stage still runs its last backward
        got = pipe.state_dict()
    for result, back in zip(results, returned, strict=True):
        first_stage_end = result.records[0][-1][2]  # its records arrived after train_step returned
        assert first_stage_end > back, "train_step waited for the first stage"
        assert sorted(r[0] for r in result.records[0]) == ["0B0", "0B1", "0B2", "0B3", "0F0", "0F1", "0F2", "0F3"]
    assert_same(got, want)


def test_a_first_stage_failing_after_the_step_returned_is_raised_at_the_next_wait(pool: RpcCommunicator) -> None:
    net, (x, y) = model(), data()
    marked = x.clone()
    marked[15, 0] = MARKER  # microbatch 3: the first stage's last backward, after the last stage is done
    with pipeline(net, pool) as pipe:
        optimizer = pipe.optimizer(torch.optim.SGD(pipe.module.parameters(), lr=0.5))
        before = pipe.state_dict()
        pipe.train_step(marked, y, F.cross_entropy, microbatches=4)  # returns: the last stage is done
        optimizer.step()  # posted before the coordinator hears of the failure
        with pytest.raises(StageError, match=r"stage 0 .*failed in action 0B3 \(microbatch 3\)") as info:
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        assert "a backward failed on a marked row" in str(info.value)
        assert "after train_step had returned" in "".join(getattr(info.value, "__notes__", []))
        after = pipe.state_dict()
        # the failed stage skipped the optimizer step sent after its step; the last stage, done, applied it
        assert_same({k: after[k] for k in ("0.weight", "0.bias")}, {k: before[k] for k in ("0.weight", "0.bias")})
        assert not torch.equal(after["2.weight"], before["2.weight"])
        optimizer.zero_grad()  # the pipeline goes on
        result = pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        assert len(result.records[0]) == 8
        optimizer.step()
        assert not torch.equal(pipe.state_dict()["0.weight"], before["0.weight"])  # posted calls run again
        pipe.train_step(marked, y, F.cross_entropy, microbatches=4)
        with pytest.raises(StageError, match="0B3"):  # raised by leaving the block, not lost
            pipe.__exit__(None, None, None)


def test_a_step_aborted_while_the_first_stage_ends_the_one_before_is_dropped_there_too(pool: RpcCommunicator) -> None:
    net, (x, y) = model(), data()
    reference = copy.deepcopy(net)
    calls = 0

    def fails_in_the_second_step(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 5:  # the second step's first microbatch
            raise ValueError("the loss failed")
        return F.cross_entropy(output, target)

    with pipeline(net, pool) as pipe:
        optimizer = pipe.optimizer(torch.optim.SGD(pipe.module.parameters(), lr=0.5))
        pipe.train_step(x, y, fails_in_the_second_step, microbatches=4)
        optimizer.step()
        optimizer.zero_grad()
        with pytest.raises(ValueError, match="the loss failed"):
            pipe.train_step(x, y, fails_in_the_second_step, microbatches=4)  # while stage 0 ends the first step
        pipe.train_step(x, y, fails_in_the_second_step, microbatches=4)
        optimizer.step()
        got = pipe.state_dict()
    assert_same(got, trained_unsplit(reference, x, y, steps=2))  # the aborted step changed nothing
