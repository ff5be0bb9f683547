"""Pipelined gradients equal the unsplit model's: the strongest oracle the project has."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, dataset, loader, max_param_diff, mlp

from lightning_pipe import Pipeline, PipeStrategy

SCHEDULES = ["gpipe", "1f1b"]
CHECKPOINT = ["always", "never"]


def reference_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    return [p.grad.clone() for p in ref.parameters()]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINT)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_engine_gradients_equal_unsplit(schedule: str, checkpoint: str, stages: int) -> None:
    """Every microbatch count 1..8 on one pipeline (the engine reuses its stage threads)."""
    model = mlp(depth=4)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g)
    expected = reference_grads(model, x, y)
    with Pipeline(model, stages=stages, schedule=schedule, checkpoint=checkpoint, partition="uniform") as pipe:
        for microbatches in range(1, 9):
            model.zero_grad(set_to_none=True)
            pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
            for p, want in zip(model.parameters(), expected, strict=True):
                torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=0, msg=f"{microbatches} microbatches")


class GradCapture(L.Callback):
    """Records the gradients Lightning hands to the optimizer, step by step."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])


def fit(module: L.LightningModule, strategy: Any, steps: int = 3, batch_size: int = 12) -> GradCapture:
    capture = GradCapture()
    trainer_args = dict(QUIET, max_steps=steps, callbacks=[capture])
    if strategy is not None:
        trainer_args["strategy"] = strategy
    L.Trainer(**trainer_args).fit(module, loader(dataset(rows=48), batch_size=batch_size))
    return capture


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("microbatches", range(1, 9))
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_trainer_gradients_and_parameters_equal_unsplit(
    schedule: str, checkpoint: str, stages: int, microbatches: int
) -> None:
    """Through a real Trainer: grads of step 1 to 1e-5, parameters after 3 SGD steps."""
    piped, plain = Classifier(mlp(depth=4)), Classifier(mlp(depth=4))
    strategy = PipeStrategy(
        stages=stages, microbatches=microbatches, schedule=schedule, checkpoint=checkpoint, partition="uniform"
    )
    got, want = fit(piped, strategy), fit(plain, None)
    assert len(got.grads) == len(want.grads) == 3
    for g, w in zip(got.grads[0], want.grads[0], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert max_param_diff(piped, plain) < 1e-5


def test_gradients_survive_a_slow_stage_after_its_last_action(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage sets its step's gradients aside before telling the coordinator it is done: Lightning
    zeroes p.grad as soon as the step returns, so the other order loses gradients under load."""
    import time

    from lightning_pipe.engine.grads import GradStash

    original = GradStash.end

    def slow_end(self: GradStash) -> None:
        time.sleep(0.05)
        original(self)

    monkeypatch.setattr(GradStash, "end", slow_end)
    piped, plain = Classifier(mlp(depth=4)), Classifier(mlp(depth=4))
    got, want = fit(piped, PipeStrategy(stages=3, microbatches=2)), fit(plain, None)
    for g, w in zip(got.grads[0], want.grads[0], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert max_param_diff(piped, plain) < 1e-5
