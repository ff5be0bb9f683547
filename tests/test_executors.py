"""Executor modules keep the specification's signatures and can be replaced through the partitioner."""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, loader, max_param_diff
from torch import nn

from lightning_pipe import BackwardModule, ForwardLossModule, ForwardModule, Partitioner, Pipeline, PipeStrategy


def test_signatures_follow_the_specification() -> None:
    def params(cls: type) -> list[str]:
        return list(inspect.signature(cls.run).parameters)[1:]

    assert params(ForwardModule) == ["model", "batch", "device"]
    assert params(ForwardLossModule) == ["model", "optimizer", "batch", "labels", "criterion", "device", "scaler"]
    assert params(BackwardModule) == ["model", "optimizer", "batch", "device", "grads", "scaler"]
    for cls in (ForwardModule, ForwardLossModule, BackwardModule):
        module = cls(3)
        assert module.index == 3 and isinstance(module.type, str)


def test_forward_loss_module_returns_scaler_grads_loss() -> None:
    batch = torch.randn(4, 3, requires_grad=True)
    target = torch.tensor([0, 1, 2, 0])
    scaler, grads, loss = ForwardLossModule(0).run(nn.Identity(), None, batch, target, F.cross_entropy, "cpu")
    assert scaler is None and not loss.requires_grad
    expected = torch.autograd.grad(F.cross_entropy(batch, target), batch)[0]
    torch.testing.assert_close(grads[0], expected)


class CountingForward(ForwardModule):
    calls: list[int] = []

    def run(self, model: nn.Module, batch: Any, device: torch.device) -> Any:
        CountingForward.calls.append(self.index)
        return super().run(model, batch, device)


class CountingBackward(BackwardModule):
    calls: list[int] = []

    def run(self, model: Any, optimizer: Any, batch: Any, device: Any, grads: Any, scaler: Any = None) -> Any:
        CountingBackward.calls.append(self.index)
        return super().run(model, optimizer, batch, device, grads, scaler)


class CountingLoss(ForwardLossModule):
    calls: list[int] = []

    def run(self, *args: Any, **kwargs: Any) -> Any:
        CountingLoss.calls.append(self.index)
        return super().run(*args, **kwargs)


def test_user_executor_modules_run_every_action() -> None:
    CountingForward.calls, CountingBackward.calls, CountingLoss.calls = [], [], []
    partitioner = Partitioner("uniform", CountingForward, CountingBackward, CountingLoss)
    piped, plain = Classifier(), Classifier()
    strategy = PipeStrategy(stages=3, microbatches=4, partition=partitioner)
    L.Trainer(**QUIET, max_steps=2, strategy=strategy).fit(piped, loader())
    L.Trainer(**QUIET, max_steps=2).fit(plain, loader())
    assert max_param_diff(piped, plain) < 1e-6
    assert sorted(CountingForward.calls) == sorted([0, 1, 2] * 8)
    assert sorted(CountingBackward.calls) == sorted([0, 1, 2] * 8)
    assert CountingLoss.calls == [2] * 8  # the last shard's loss module, once per microbatch


def test_shards_share_the_models_layers() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with Pipeline(model, stages=2, partition=[2, 1]) as pipe:
        assert pipe.balance == [2, 1]
        assert pipe.shards[1].module[0] is model[2]
        assert pipe.shards[0].layers == ["0", "1"]
