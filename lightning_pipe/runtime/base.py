"""`BaseRuntime`: how a stage's module and tensors reach a device, and hooks around steps.

The interface is the specification's (``seeds/runtimes.md``). Every callback is a no-op by default;
`lightning_pipe.runtime.PyTorchRuntime` implements them for cpu and cuda.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DeviceMemory:
    """The memory of a stage's device as its worker process sees it (``checkpoint="auto"`` plans with it)."""

    device: str  # names the physical device: stages that report the same name share its memory
    free: int  # bytes this process can still allocate there, its allocator's unused cache included
    total: int


class BaseRuntime:
    """A device abstraction made of callbacks; subclass it for a custom device."""

    def __init__(self, device_spec: str | torch.device, config: dict[str, Any] | None = None) -> None:
        self.device_spec = str(device_spec)
        self.config = dict(config or {})

    @property
    def device_type(self) -> str:
        return self.device_spec.split(":")[0]

    @property
    def torch_device(self) -> torch.device:
        """The torch device tensors of this runtime live on (cpu for a device torch doesn't know)."""
        try:
            return torch.device(self.device_spec)
        except RuntimeError:
            return torch.device("cpu")

    # data and module movement
    def convert_batch(self, args: Any) -> Any:
        """Called when a batch or activation arrives at the stage: move it to the device."""
        return args

    def move_module(self, module: nn.Module) -> nn.Module:
        """Called once when a shard is placed on this runtime's device."""
        return module

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Called to move a single tensor to the device."""
        return tensor

    def initialize_module(self, module: nn.Module, loader_or_batch: Any, optimizer: Any = None) -> None:
        """Called once before the first training or inference step with a sample batch."""

    # Trainer hooks
    def train_epoch_begin(self, module: nn.Module) -> None:
        """Called at the start of every training epoch."""

    def train_pre_step(self, trainer: Any, module: nn.Module, batch_idx: int, batch: Any) -> None:
        """Called before every training step."""

    def train_post_step(self, trainer: Any, module: nn.Module, batch_idx: int, batch: Any, outputs: Any) -> None:
        """Called after every training step."""

    def train_validation_begin(self, module: nn.Module) -> None:
        """Called before validation starts (inside fit or from validate)."""

    # Evaluator hooks
    def eval_pre_step(self, evaluator: Any, module: nn.Module, batch_idx: int, batch: Any) -> None:
        """Called before every validation, test or predict step."""

    def eval_post_step(self, evaluator: Any, module: nn.Module, batch_idx: int, batch: Any, outputs: Any) -> None:
        """Called after every validation, test or predict step."""

    def get_pending_result(self, module: nn.Module, blocking: bool) -> Any:
        """Called when a step's results are needed: finish asynchronous device work."""
        return None

    def device_memory(self) -> DeviceMemory | None:
        """Called on the stage's worker when the stage is built and between training steps (``checkpoint="auto"``).

        None where memory is no limit to plan for: such a stage never recomputes its forward to save memory.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device_spec!r})"
