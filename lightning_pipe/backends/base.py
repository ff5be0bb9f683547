"""What a backend is: a name, an op map of substitutions, and optionally a stage compiler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pipe.base.errors import PipeError

Checker = Callable[..., bool]  # called like the op, with TensorMeta in place of tensors
OpEntry = tuple[str, Checker, Callable[..., Any]]  # (implementation name, checker, implementation)
OpMap = dict[str, OpEntry]  # PyTorch op name ("torch.nn.functional.gelu") -> entry


class BackendError(PipeError):
    """A backend could not serve a stage where it had to (``strict=True``), or its checker failed."""


class BackendUnavailableError(Exception):
    """Raised by a stage compiler when it cannot compile after all: the stage falls back to the next backend."""


@dataclass
class Backend:
    """A registered backend.

    ``op_map`` substitutes single PyTorch operations wherever the checker accepts them;
    ``compiler`` (a `StageCompiler` class) runs a whole stage's forward (eager, inductor, tensorrt).
    Both are configuration: a `Backend` travels to RPC workers by pickling, so its checkers,
    implementations and compiler class must be importable module-level objects there.
    """

    name: str
    op_map: OpMap = field(default_factory=dict)
    compiler: type | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def runs_stages(self) -> bool:
        return self.compiler is not None

    def __repr__(self) -> str:
        kind = "stage" if self.runs_stages else "operator"
        ops = f", ops={sorted(self.op_map)}" if self.op_map else ""
        return f"Backend({self.name!r}, {kind}{ops})"


@dataclass(frozen=True)
class StageContext:
    """What a stage compiler's checker knows besides the input metadata."""

    stage: int
    mode: str  # "train" or "eval"
    device: torch.device
    grad_enabled: bool
    training: bool  # the module's train()/eval() flag
    trainable: int  # parameters that require grad
    random: bool = False  # it draws random numbers from its stage's own generators (lightning_pipe.rng)
