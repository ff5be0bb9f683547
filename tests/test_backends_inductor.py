"""The inductor backend (torch.compile) trains under PipeStrategy like eager; op substitutions reach its graph."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, dataset, loader, max_param_diff
from torch import nn

from lightning_pipe import PipeStrategy
from lightning_pipe.backends import TensorMeta, available_backends, register_backend, unregister_backend

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


class GradCapture(L.Callback):
    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))


def fit(module: L.LightningModule, strategy: Any) -> tuple[GradCapture, L.Trainer]:
    capture = GradCapture()
    args: dict[str, Any] = dict(QUIET, max_steps=3, callbacks=[capture])
    if strategy is not None:
        args["strategy"] = strategy
    trainer = L.Trainer(**args)
    trainer.fit(module, loader(dataset(rows=48), batch_size=16))
    return capture, trainer


@pytest.mark.slow
def test_inductor_trains_with_eager_gradients() -> None:
    """One small model compiled on CPU: ~40 s cold on 2 busy cores, a few seconds with inductor's cache."""
    register_backend("wide", {LINEAR: ("matmul_linear", wide_only, matmul_linear)}, add_to_default=False)
    piped, plain = Classifier(model()), Classifier(model())
    # stage 0: inductor with the "wide" op backend rewritten into its graph; stage 1: plain inductor
    strategy = PipeStrategy(
        microbatches=4, partition=[3, 2], devices=["cpu", "cpu"], checkpoint="never",
        backend=[("wide", "inductor"), "inductor"], strict=True, timeout=240,
    )  # fmt: skip
    got, trainer = fit(piped, strategy)
    want, _ = fit(plain, None)
    assert len(got.grads) == len(want.grads) == 3
    for step_got, step_want in zip(got.grads, want.grads, strict=True):
        for g, w in zip(step_got, step_want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert max_param_diff(piped, plain) < 1e-5
    trace = trainer.strategy.execution_trace()  # type: ignore[attr-defined]
    print(trace)
    assert trace[0].backend("train") == trace[1].backend("train") == "inductor"
    assert trace[0].runs["train"]["inductor"] == 3 * 4  # 3 steps x 4 microbatches
    # stage 0's Linear(8, 32) ran as matmul_linear inside the compiled graph, Linear(32, 16) natively
    assert trace.count(stage=0, op=LINEAR, impl="matmul_linear", backend="wide") == 12
    assert trace.count(stage=0, op=LINEAR, impl="inductor") == 12
    assert trace.count(stage=1) == 0 and trace[0].declined == trace[1].declined == {}
