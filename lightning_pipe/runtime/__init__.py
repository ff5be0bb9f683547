"""Runtimes: device abstraction by callbacks, registered by device type."""

from lightning_pipe.runtime.base import BaseRuntime
from lightning_pipe.runtime.pytorch import PyTorchRuntime
from lightning_pipe.runtime.registry import RuntimeRegistry, runtime_registry, to

__all__ = ["BaseRuntime", "PyTorchRuntime", "RuntimeRegistry", "runtime_registry", "to"]
