"""`PyTorchRuntime`: cpu and cuda through ``.to()``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_pipe import tree
from lightning_pipe.runtime.base import BaseRuntime


class PyTorchRuntime(BaseRuntime):
    """Moves modules and tensors with ``.to(device)``; waits for the device in ``get_pending_result``."""

    def convert_batch(self, args: Any) -> Any:
        return tree.map_tensors(self.move_tensor, args)

    def move_module(self, module: nn.Module) -> nn.Module:
        return module.to(self.torch_device)

    def move_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        device = self.torch_device
        if tensor.device == device:
            return tensor
        return tensor.to(device, non_blocking=device.type == "cuda")

    def get_pending_result(self, module: nn.Module, blocking: bool) -> Any:
        if blocking and self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
        return None
