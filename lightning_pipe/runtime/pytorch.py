"""`PyTorchRuntime`: cpu and cuda through ``.to()``."""

from __future__ import annotations

import socket
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_pipe.base import tree
from lightning_pipe.runtime.base import BaseRuntime, DeviceMemory


class PyTorchRuntime(BaseRuntime):
    """Moves modules and tensors with ``.to(device)``; waits for the device in ``get_pending_result``.

    ``device_memory``: cuda devices report their free memory; cpu memory is no limit to plan for.
    """

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

    @override
    def device_memory(self) -> DeviceMemory | None:
        device = self.torch_device
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        # blocks the caching allocator holds but nothing uses (last step's activations) are free for this process
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return DeviceMemory(f"{socket.gethostname()}/cuda:{index}", free + cached, total)
