"""Partition methods through the strategy, and the default stage count from the Trainer's devices."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, loader, max_param_diff
from torch import nn

from lightning_pipe import Partitioner, PipeStrategy


def lopsided() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 3))


@pytest.mark.parametrize("method", ["uniform", "params", "memory", "time"])
def test_partition_methods_train_like_the_plain_model(method: str) -> None:
    """memory and time need a sample: the pipeline is built on the first microbatch's input."""
    piped, plain = Classifier(lopsided()), Classifier(lopsided())
    strategy = PipeStrategy(stages=2, microbatches=2, partition=method)
    L.Trainer(**QUIET, max_steps=2, strategy=strategy).fit(piped, loader())
    L.Trainer(**QUIET, max_steps=2).fit(plain, loader())
    assert max_param_diff(piped, plain) < 1e-6


def test_params_balance_puts_the_big_layers_apart() -> None:
    partitioner = Partitioner("params")
    assert partitioner.balance(lopsided(), 2) == [1, 5]  # 8*256 weights alone, 256*4 + the rest
    assert Partitioner("uniform").balance(lopsided(), 2) == [3, 3]
    sample = torch.randn(4, 8)
    assert sum(Partitioner("memory").balance(lopsided(), 3, sample)) == 6
    assert sum(Partitioner("time").balance(lopsided(), 3, sample)) == 6


def test_stages_default_to_the_trainers_devices_with_transport_local() -> None:
    trainer = L.Trainer(**QUIET, devices=3, max_steps=1, strategy=PipeStrategy(partition="uniform", transport="local"))
    trainer.fit(Classifier(), loader())
    assert trainer.strategy.resolve_devices() == ["cpu", "cpu", "cpu"]  # type: ignore[attr-defined]
    assert len(trainer.strategy.last_step.records) == 3  # type: ignore[attr-defined]
