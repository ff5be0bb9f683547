"""A failing stage stops the pipeline; the error names the stage, the microbatch and its traceback.

A control call the coordinator posted (`Coordinator.post`) and does not wait for is raised at its next wait.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, loader
from torch import nn

from lightning_pipe import Pipeline, PipeStrategy, PipeTimeoutError, StageError
from lightning_pipe.engine import StageProtocol
from lightning_pipe.engine.stream import BatchStream


class FailsOn(nn.Module):
    """Raises on rows whose first feature is exactly ``marker``."""

    def __init__(self, marker: float) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x[:, 0] == self.marker).any():
            raise ValueError("bad row reached the stage")
        return x


def test_stage_exception_names_stage_microbatch_and_traceback() -> None:
    model = nn.Sequential(nn.Linear(4, 4), FailsOn(123.0), nn.Linear(4, 2))
    x = torch.zeros(8, 4)
    x[5, 0] = 123.0  # row 5 is in microbatch 2 of 4
    with Pipeline(model, stages=2, partition=[1, 2], schedule="1f1b") as pipe:
        model[0].weight.data.zero_()
        model[0].bias.data.fill_(123.0)
        with pytest.raises(StageError) as info:
            pipe.train_step(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long), F.cross_entropy)
        assert info.value.stage == 1 and info.value.microbatch == 0
        assert "stage 1 failed in action 1F0 (microbatch 0)" in str(info.value)
        assert "ValueError: bad row reached the stage" in str(info.value)
        assert "in forward" in info.value.remote_traceback  # the stage's own frames
        # the pipeline is still usable afterwards
        model[0].bias.data.zero_()
        pipe.train_step(x * 0, torch.zeros(8, dtype=torch.long), F.cross_entropy)


def test_stage_error_reaches_the_trainer_and_stops_workers() -> None:
    class Failing(Classifier):
        def __init__(self) -> None:
            super().__init__(nn.Sequential(nn.Linear(8, 8), FailsOn(7.0), nn.Linear(8, 3)))

    module = Failing()
    data = loader()
    data.dataset.tensors[0][4, 0] = 7.0  # batch 0, row 4: microbatch 1
    module.model[0].weight.data = torch.eye(8)
    module.model[0].bias.data.zero_()
    with pytest.raises(StageError, match=r"stage 1 failed in action 1F1 \(microbatch 1\)"):
        L.Trainer(**QUIET, max_epochs=1, strategy=PipeStrategy(stages=2, partition=[1, 2])).fit(module, data)
    # the autouse fixture checks that no stage thread is left behind


class Sleepy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(3.0)
        return x


@pytest.mark.timed
def test_every_wait_is_bounded_by_timeout() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Sleepy())
    with Pipeline(model, stages=2, partition=[1, 1], timeout=0.5) as pipe:
        start = time.monotonic()
        with pytest.raises(PipeTimeoutError, match=r"waited 0.5 s for the output of microbatch 0.*timeout="):
            pipe.forward(torch.zeros(2, 4))
        assert time.monotonic() - start < 2.5


def test_user_step_error_propagates_with_its_own_type() -> None:
    class BadStep(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.model(batch[0])
            raise KeyError("user code failed after the pipelined call")

    with pytest.raises(KeyError, match="user code failed"):
        L.Trainer(**QUIET, max_steps=1, strategy=PipeStrategy(stages=2)).fit(BadStep(), loader())


def test_missing_or_double_call_of_the_pipelined_module() -> None:
    class NoCall(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return batch[0].sum() * 0

    class TwoCalls(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(batch[0]).sum() + self.model(batch[0]).sum()

    with pytest.raises(Exception, match="returned without calling the pipelined module"):
        L.Trainer(**QUIET, max_steps=1, strategy=PipeStrategy(stages=2)).fit(NoCall(), loader())
    with pytest.raises(Exception, match="called the pipelined module a second time"):
        L.Trainer(**QUIET, max_steps=1, strategy=PipeStrategy(stages=2)).fit(TwoCalls(), loader())


def test_a_failed_post_is_raised_once_at_the_next_call_or_step() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    with Pipeline(model, stages=2, partition=[1, 1]) as pipe:
        coordinator = pipe.coordinator
        coordinator.stages.post(StageProtocol.optimizer_step, None)  # no stage optimizer was built: both ranks fail
        with pytest.raises(StageError, match=r"stage [01] failed in action optimizer_step: PipeError") as info:
            coordinator.stages.ping()
        assert "has no optimizer" in str(info.value) and "call_optimizer_step" in info.value.remote_traceback
        assert coordinator.stages.ping() == [0, 1]  # the other rank's failure of that post is not raised again
        coordinator.stages.post(StageProtocol.set_hparams, [])
        with pytest.raises(StageError, match="failed in action set_hparams"):
            pipe.train_step(x, y, F.cross_entropy)
        pipe.train_step(x, y, F.cross_entropy)  # the pipeline is still usable afterwards
        coordinator.stages.post(StageProtocol.zero_grad, True)  # a post that succeeds sends nothing back
        assert all(g is None for g in pipe.grads().values())
    with pytest.raises(StageError, match="optimizer_step"), Pipeline(model, stages=2, partition=[1, 1]) as pipe:
        # leaving the block waits for what was posted
        pipe.coordinator.stages.post(StageProtocol.optimizer_step, None)


def test_a_post_reaches_a_stage_in_the_middle_of_a_step() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    with Pipeline(model, stages=2, partition=[1, 1], schedule="async") as pipe:
        stream = BatchStream(pipe.coordinator, 2, 2, lambda params: torch.optim.SGD(params, lr=0.1))
        # the stages wait for the stream's inputs: served there
        pipe.coordinator.stages.post(StageProtocol.zero_grad, True)
        stream.feed(list(x.chunk(2)), list(y.chunk(2)), F.cross_entropy)
        pipe.coordinator.stages.post(StageProtocol.optimizer_step, None)
        with pytest.raises(StageError, match="failed in action optimizer_step"):
            stream.feed(list(x.chunk(2)), list(y.chunk(2)), F.cross_entropy)
        assert stream.closed  # the failure aborted the stream
