"""Shared by the backend tests: a linear and a cross-entropy op backend, a small model, a batch."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.backends import TensorMeta, available_backends, unregister_backend

LINEAR = "torch.nn.functional.linear"
XENT = "torch.nn.functional.cross_entropy"
CALLS: dict[str, int] = {}  # how often each implementation really ran


def linear_checker(x: TensorMeta, weight: TensorMeta, bias: TensorMeta | None = None) -> bool:
    CALLS["linear_checker"] = CALLS.get("linear_checker", 0) + 1
    assert isinstance(weight, TensorMeta), "checkers see metadata, never data"
    return weight.shape[0] == 16  # only layers with 16 outputs


def linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    CALLS["my_linear"] = CALLS.get("my_linear", 0) + 1
    y = torch.matmul(x, weight.t())
    return y + bias if bias is not None else y


def xent_checker(
    logits: TensorMeta,
    target: TensorMeta,
    weight: TensorMeta | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> bool:
    """Like the seed's apex checker: the op's own signature; accepts 2-D, unweighted, mean-reduced inputs."""
    return logits.ndim == 2 and weight is None and reduction == "mean" and label_smoothing == 0.0


def xent_impl(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    CALLS["my_xent"] = CALLS.get("my_xent", 0) + 1
    keep = target != ignore_index
    picked = logits.log_softmax(-1).gather(1, target.clamp(min=0)[:, None])[:, 0]
    return -(picked * keep).sum() / keep.sum()


def raising_checker(*args: Any, **kwargs: Any) -> bool:
    raise ValueError("checker bug")


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    before = set(available_backends())
    CALLS.clear()
    yield
    for name in set(available_backends()) - before:
        unregister_backend(name)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    return [p.grad for p in ref.parameters()]
