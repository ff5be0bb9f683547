"""Layers and helpers for the RPC tests; stage worker processes import this module (it must not import Lightning)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from processes import leftover_processes, owned_env
from torch import nn

from lightning_pipe.runtime import DeviceMemory, PyTorchRuntime

ROOT = Path(__file__).resolve().parent.parent


class FailsOn(nn.Module):
    """Raises on rows whose first feature is exactly ``marker``."""

    def __init__(self, marker: float) -> None:
        super().__init__()
        self.marker = marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x[:, 0] == self.marker).any():
            raise ValueError("bad row reached the stage")
        return x


class Sleeps(nn.Module):
    """Sleeps ``seconds`` in every forward (a stage that is busy when it gets killed)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, seconds: float, fail: bool) -> torch.Tensor:
        ctx.seconds, ctx.fail = seconds, fail  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.seconds)  # type: ignore[attr-defined]
        if ctx.fail:  # type: ignore[attr-defined]
            raise RuntimeError("a backward failed on a marked row")
        return grad, None, None


class SlowBackwardLinear(nn.Linear):
    """A linear layer whose backward sleeps ``seconds``, and fails for a microbatch that has a row whose first
    feature is exactly ``marker``."""

    def __init__(self, features: int, out_features: int, seconds: float, marker: float) -> None:
        super().__init__(features, out_features)
        self.seconds, self.marker = seconds, marker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fail = bool((x[:, 0] == self.marker).any())
        return _SlowBackward.apply(super().forward(x), self.seconds, fail)


def worker_env() -> dict[str, str]:
    """Environment of a `lightning-pipe worker` subprocess: this checkout and the tests importable, marked as this
    test process's (`processes.owned_env`)."""
    env = owned_env(dict(os.environ))
    paths = [str(ROOT), str(ROOT / "tests")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class _Overflow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class OverflowsBackward(nn.Module):
    """The identity forward; its backward overflows, so only the layers before it get inf gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Overflow.apply(x)


class _OverflowIf(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, overflow: bool) -> torch.Tensor:
        ctx.overflow = overflow  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad * float("inf") if ctx.overflow else grad), None  # type: ignore[attr-defined]


class OverflowsAtStep(nn.Module):
    """The identity; the backwards of optimizer step ``step`` (counting ``calls_per_step`` forwards a step) overflow."""

    def __init__(self, step: int, calls_per_step: int) -> None:
        super().__init__()
        self.step, self.calls_per_step, self.calls = step, calls_per_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation, or a checkpointed stage's first forward
            return x
        overflow = self.calls // self.calls_per_step == self.step
        self.calls += 1
        return _OverflowIf.apply(x, overflow)


class FakeGpuRuntime(PyTorchRuntime):
    """Device ``fakegpu:<i>``: runs on the cpu but reports ``$FAKE_GPU_FREE`` (``"0=4096,1=1000000"``) bytes free.

    ``checkpoint="auto"`` sees a device with a memory limit, the way a cuda device looks to it. The device name
    carries the process id of whoever reads it: the tests see which process measured.
    """

    def device_memory(self) -> DeviceMemory | None:
        index = self.device_spec.split(":")[1]
        free = dict(item.split("=") for item in os.environ.get("FAKE_GPU_FREE", "").split(",") if item)
        if index not in free:
            return None
        return DeviceMemory(f"pid{os.getpid()}/{self.device_spec}", int(free[index]), 2 * int(free[index]))


def worker_pool(workers: int) -> Iterator[Any]:
    """A started `RpcCommunicator` of ``workers`` kept-alive worker processes, for a module-scoped fixture;
    closed after, and no worker left behind."""
    from lightning_pipe.comm.rpc import RpcCommunicator

    communicator = RpcCommunicator(workers=workers, keep_alive=True).start(timeout=120)
    try:
        yield communicator
    finally:
        communicator.close()
        assert leftover_processes() == [], "worker processes left behind"


def classification_data(rows: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` inputs of width 8 and their labels among 3 classes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def unsplit_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of a copy of ``model`` after one cross-entropy backward over the whole batch."""
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    return {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}


def assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-5, msg=name)
