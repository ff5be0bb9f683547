"""Runtimes: a custom device registered by type trains a model, and its callbacks fire at the right hooks."""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, loader, max_param_diff
from torch import nn

import lightning_pipe
from lightning_pipe import BaseRuntime, ConfigurationError, PipeStrategy, PyTorchRuntime, runtime_registry


class FakeDeviceRuntime(PyTorchRuntime):
    """A pretend accelerator ``"fakecpu"``: tensors live on the CPU, every callback is counted."""

    calls: Counter[str] = Counter()
    moved: list[torch.Tensor] = []

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def convert_batch(self, args: Any) -> Any:
        self.calls["convert_batch"] += 1
        return super().convert_batch(args)

    def move_module(self, module: nn.Module) -> nn.Module:
        self.calls["move_module"] += 1
        return super().move_module(module)

    def initialize_module(self, module: nn.Module, loader_or_batch: Any, optimizer: Any = None) -> None:
        self.calls["initialize_module"] += 1

    def train_epoch_begin(self, module: nn.Module) -> None:
        self.calls["train_epoch_begin"] += 1

    def train_pre_step(self, trainer: Any, module: nn.Module, batch_idx: int, batch: Any) -> None:
        self.calls["train_pre_step"] += 1

    def train_post_step(self, trainer: Any, module: nn.Module, batch_idx: int, batch: Any, outputs: Any) -> None:
        assert outputs["loss"].ndim == 0
        self.calls["train_post_step"] += 1

    def train_validation_begin(self, module: nn.Module) -> None:
        self.calls["train_validation_begin"] += 1

    def eval_pre_step(self, evaluator: Any, module: nn.Module, batch_idx: int, batch: Any) -> None:
        self.calls["eval_pre_step"] += 1

    def eval_post_step(self, evaluator: Any, module: nn.Module, batch_idx: int, batch: Any, outputs: Any) -> None:
        self.calls["eval_post_step"] += 1

    def get_pending_result(self, module: nn.Module, blocking: bool) -> Any:
        self.calls["get_pending_result"] += 1
        return None


@pytest.fixture
def fake_device() -> Any:
    FakeDeviceRuntime.calls = Counter()
    runtime_registry.register("fakecpu", FakeDeviceRuntime)
    yield FakeDeviceRuntime
    runtime_registry._classes.pop("fakecpu", None)


def test_model_trains_through_a_custom_runtime(fake_device: Any) -> None:
    piped, plain = Classifier(), Classifier()
    strategy = PipeStrategy(stages=2, microbatches=4, devices=["fakecpu", "fakecpu"], partition="uniform")
    trainer = L.Trainer(**QUIET, max_epochs=2, strategy=strategy, limit_val_batches=2)
    trainer.fit(piped, loader(), loader())
    L.Trainer(**QUIET, max_epochs=2, limit_val_batches=2).fit(plain, loader(), loader())
    assert max_param_diff(piped, plain) < 1e-6
    calls = fake_device.calls
    stages, steps, val_steps = 2, 8, 2 * 2 + 2  # 2 epochs x 4 batches; sanity check + 2 epochs x 2 val batches
    assert calls["move_module"] == stages
    assert calls["initialize_module"] == stages
    assert calls["train_epoch_begin"] == 2 * stages
    assert calls["train_pre_step"] == calls["train_post_step"] == steps * stages
    assert calls["train_validation_begin"] == 3 * stages  # sanity check + after each epoch
    assert calls["eval_pre_step"] == calls["eval_post_step"] == val_steps * stages
    assert calls["get_pending_result"] == (steps + val_steps) * stages
    assert calls["convert_batch"] == (steps + val_steps) * 4 * stages  # once per microbatch per stage


def test_runtime_by_name_and_instance(fake_device: Any) -> None:
    strategy = PipeStrategy(stages=2, runtime="fakecpu", partition="uniform")
    L.Trainer(**QUIET, max_steps=1, strategy=strategy).fit(Classifier(), loader())
    assert fake_device.calls["move_module"] == 2
    runtime = FakeDeviceRuntime("fakecpu:0")
    strategy = PipeStrategy(stages=2, runtime=runtime, partition="uniform")
    L.Trainer(**QUIET, max_steps=1, strategy=strategy).fit(Classifier(), loader())
    assert fake_device.calls["move_module"] == 4


def test_to_tags_modules_with_their_runtime(fake_device: Any) -> None:
    layer = lightning_pipe.to(nn.Linear(2, 2), device="fakecpu")
    assert isinstance(layer._pipe_runtime, FakeDeviceRuntime)
    assert layer._pipe_runtime.device_spec == "fakecpu"
    tensor = lightning_pipe.to(torch.ones(2), device="cpu")
    assert tensor.device.type == "cpu"
    with pytest.raises(ConfigurationError, match="no runtime is registered for device type 'tpu9'.*registered: cpu"):
        lightning_pipe.to(torch.ones(2), device="tpu9")


def test_base_runtime_callbacks_are_no_ops() -> None:
    rt = BaseRuntime("cpu")
    module = nn.Linear(1, 1)
    assert rt.move_module(module) is module
    assert rt.convert_batch((1, 2)) == (1, 2)
    for name in ("train_epoch_begin", "train_validation_begin"):
        assert getattr(rt, name)(module) is None
    assert rt.train_pre_step(None, module, 0, None) is None
    assert rt.get_pending_result(module, True) is None
    with pytest.raises(TypeError, match="BaseRuntime subclass"):
        runtime_registry.register("x", object)  # type: ignore[arg-type]
