"""The split backward (``I`` then ``W``) gives exactly the gradients of one ordinary backward."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe import Pipeline
from lightning_pipe.engine.split_backward import backward_input, backward_weight


class Tied(nn.Module):
    """A layer used twice, a residual, and an output that depends on parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(torch.relu(self.a(x)))
        return self.b(h) * self.scale + x, self.scale * 2


class TwoInputs(nn.Module):
    """Two inputs, one of them unused; a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.free = nn.Linear(8, 8), nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return self.free(torch.tanh(self.frozen(x)))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8)),
    "batchnorm": lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8)),
    "tied": Tied,
    "two_inputs": TwoInputs,
}


@pytest.mark.parametrize("inputs_need_grad", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_input_then_weight_equals_one_backward(name: str, inputs_need_grad: bool) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    xs = [torch.randn(6, 8, requires_grad=inputs_need_grad) for _ in range(2 if name == "two_inputs" else 1)]

    outputs = reference(*xs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, grads)
    want_inputs = [x.grad for x in xs]
    for x in xs:
        x.grad = None

    outputs = model(*xs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    got_inputs, pending = backward_input(outputs, grads, xs, model.parameters())
    assert all(p.grad is None for p in model.parameters()), "I must not touch the parameter gradients"
    for got, want in zip(got_inputs, want_inputs, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    if inputs_need_grad:
        assert pending.groups and pending.nbytes() > 0  # the weight part starts at the captured boundaries
    backward_weight(pending)
    for (param_name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), param_name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0, msg=param_name)


def test_weight_gradients_accumulate() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(2):
        _, pending = backward_input([model(x)], [torch.ones(3, 4)], [x], model.parameters())
        backward_weight(pending)
    torch.testing.assert_close(model.bias.grad, torch.full((4,), 6.0))


def test_nothing_to_do_without_output_gradients() -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    got, pending = backward_input([model(x)], [None], [x], model.parameters())
    assert got == [None]
    backward_weight(pending)
    assert model.weight.grad is None


class _SleepsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SlowWeightGradient(nn.Module):
    """``x * scale``, whose gradient for ``scale`` (a weight gradient, not on the input's path) takes ``seconds``."""

    def __init__(self, features: int, seconds: float) -> None:
        super().__init__()
        self.scale, self.seconds = nn.Parameter(torch.linspace(0.5, 1.5, features)), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _SleepsInBackward.apply(self.scale, self.seconds)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_stage_sends_its_last_input_gradient_before_its_last_weight_gradient(schedule: str) -> None:
    """The drain of a step: the first stage starts its last backward while the second computes its last weight
    gradients (its last ``B`` runs as ``I``, send, ``W``); the gradients are the unsplit model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), SlowWeightGradient(16, 0.2), nn.Linear(16, 4))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    reference = copy.deepcopy(model)
    F.mse_loss(reference(x), y).backward()
    with Pipeline(model, stages=2, partition=[2, 3], schedule=schedule, checkpoint="never") as pipe:
        result = pipe.train_step(x, y, F.mse_loss, microbatches=4)
        grads = pipe.grads()
    (_, first_start, _), (_, _, second_end) = result.records[0][-1], result.records[1][-1]  # each rank's last B
    assert first_start < second_end - 0.1, "stage 0's last backward waited for stage 1's weight gradients"
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=0, msg=name)
