"""The inductor backend (torch.compile) trains like eager; op substitutions reach the compiled graph."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.backends import TensorMeta, available_backends, register_backend, unregister_backend
from lightning_pipe.pipeline import Pipeline

LINEAR = "torch.nn.functional.linear"


def wide_only(x: TensorMeta, weight: TensorMeta, bias: TensorMeta | None = None) -> bool:
    return weight.shape[0] == 32


def matmul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.matmul(x, weight.t())
    return y + bias if bias is not None else y


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    before = set(available_backends())
    yield
    for name in set(available_backends()) - before:
        unregister_backend(name)


def run(model: nn.Module, backend: object, steps: int = 2) -> tuple[list[torch.Tensor], list[float], object]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    with Pipeline(model, stages=2, partition=[3, 2], backend=backend, checkpoint="never", timeout=240) as pipe:
        for _ in range(steps):
            x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            for p in model.parameters():
                p.grad = None
            result = pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            losses.append(float(sum(result.losses)))
        trace = pipe.execution_trace()
    return [p.grad.clone() for p in model.parameters()], losses, trace


@pytest.mark.slow
def test_inductor_trains_with_eager_gradients() -> None:
    """One small model compiled on CPU (~15-40 s cold, a few seconds with inductor's cache)."""
    register_backend("wide", {LINEAR: ("matmul_linear", wide_only, matmul_linear)}, add_to_default=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    eager_grads, eager_losses, _ = run(copy.deepcopy(model), "eager")
    # stage 0: inductor with the "wide" op backend rewritten into its graph; stage 1: plain inductor
    grads, losses, trace = run(model, [("wide", "inductor"), "inductor"])
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5)
    assert losses == pytest.approx(eager_losses, abs=1e-5)
    assert trace[0].backend("train") == trace[1].backend("train") == "inductor"  # type: ignore[index]
    # stage 0's Linear(8, 32) ran as matmul_linear inside the compiled graph, Linear(32, 16) natively
    assert trace.count(stage=0, op=LINEAR, impl="matmul_linear", backend="wide") == 8  # type: ignore[attr-defined]
    assert trace.count(stage=0, op=LINEAR, impl="inductor") == 8  # type: ignore[attr-defined]
    assert trace.count(stage=1) == 0  # type: ignore[attr-defined]
