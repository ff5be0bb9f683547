"""Runtimes: device abstraction by callbacks, registered by device type."""

from lightning_pipe.runtime.base import BaseRuntime, DeviceMemory
from lightning_pipe.runtime.pytorch import PyTorchRuntime
from lightning_pipe.runtime.registry import RuntimeRegistry, runtime_registry, to

__all__ = ["BaseRuntime", "DeviceMemory", "PyTorchRuntime", "RuntimeRegistry", "runtime_registry", "to"]
