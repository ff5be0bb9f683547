"""Where stages share the coordinator's objects (local transport) the last stage computes the losses."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.pipeline.pipeline import Pipeline


class Probe(nn.Module):
    """Identity that logs each forward it runs (outside recomputation)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append("F")
        return x


def _model(log: list[str]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), Probe(log))


@pytest.mark.parametrize(("schedule", "order"), [("1f1b", "FLFLFLFL"), ("gpipe", "FFFFLLLL")])
def test_the_last_stage_runs_the_criterion_in_the_schedules_order(schedule: str, order: str) -> None:
    log: list[str] = []
    threads: list[str] = []

    def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log.append("L")
        threads.append(threading.current_thread().name)
        return F.mse_loss(output, target)

    with Pipeline(_model(log), stages=2, partition=[2, 2], schedule=schedule, checkpoint="never", timeout=30) as pipe:
        result = pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), criterion, microbatches=4)
    assert "".join(log) == order  # gpipe: every loss after every forward, as the coordinator would
    assert set(threads) == {"lightning_pipe-stage-1"}
    assert len(result.losses) == 4 and all(isinstance(loss, torch.Tensor) for loss in result.losses)
    loss_parts = [name for rank in result.parts for name, _, _ in rank if name.endswith(" loss")]
    assert loss_parts and all(name.startswith("1F") for name in loss_parts)  # right after its forward(s)


def test_the_gradients_match_the_coordinators_loss() -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    grads = []
    for shares in (True, False):
        model = _model([])
        pipe = Pipeline(model, stages=2, partition=[2, 2], timeout=30)
        pipe.communicator.shares_objects = shares  # False: the coordinator computes the losses
        with pipe:
            losses = pipe.train_step(x, y, F.mse_loss, microbatches=4).losses
        grads.append(([p.grad.clone() for p in model.parameters()], torch.stack(losses)))
    for a, b in zip(grads[0][0], grads[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)


def test_an_error_in_the_criterion_is_raised_as_itself() -> None:
    def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise KeyError("no such label")

    with Pipeline(_model([]), stages=2, partition=[2, 2], timeout=30) as pipe:
        with pytest.raises(KeyError, match="no such label"):
            pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), criterion, microbatches=4)
        # the pipeline still works afterwards
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss, microbatches=4)
