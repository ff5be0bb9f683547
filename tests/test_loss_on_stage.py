"""Where stages share the coordinator's objects (local transport) the last stage computes the losses."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe import Loss
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


LOSSES_1F1B = ["1B0 loss", "1B1 loss", "1B2 loss", "1F3 loss"]
LOSSES_GPIPE = ["1F3 loss"]


@pytest.mark.parametrize(
    ("schedule", "order", "parts"), [("1f1b", "FLFLFLFL", LOSSES_1F1B), ("gpipe", "FFFFLLLL", LOSSES_GPIPE)]
)
def test_the_last_stage_runs_the_criterion_in_the_schedules_order(schedule: str, order: str, parts: list[str]) -> None:
    """1F1B: a loss in its microbatch's backward, one backward through the loss and the stage, but the last, whose
    backward runs as I then W (its input's gradient goes first), after its forward; gpipe: every loss after the
    last forward, as the coordinator would, each gradient then a message to its backward."""
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
    assert loss_parts == parts


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


class _HalvedGradient(Loss):
    """A criterion that takes its own gradient: half the loss's (its backward runs after the stage's forward, and
    the stage's backward gets the output's gradient as a message)."""

    def compute_gradient(self, loss: torch.Tensor) -> None:
        (loss * 0.5).backward()


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_backward_takes_its_loss_only_where_that_is_plain_and_the_gradients_are_the_same(checkpoint: str) -> None:
    """Where the last stage's backward takes its microbatch's loss (a plain ``loss.backward()`` on a stage kept whole),
    and where it cannot (a criterion's own gradient, a recomputed stage), the gradients equal the unsplit model's."""
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for criterion, scale in ((Loss(F.mse_loss), 1.0), (_HalvedGradient(F.mse_loss), 0.5)):
        model = _model([])
        with Pipeline(model, stages=2, partition=[2, 2], schedule="1f1b", checkpoint=checkpoint, timeout=30) as pipe:
            result = pipe.train_step(x, y, criterion, microbatches=4)
        reference = _model([])
        (F.mse_loss(reference(x), y) * scale).backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
        in_backward = [name for name, _, _ in result.parts[1] if name.endswith(" loss") and name.startswith("1B")]
        plain = scale == 1.0 and checkpoint == "never"
        assert in_backward == (["1B0 loss", "1B1 loss", "1B2 loss"] if plain else [])
