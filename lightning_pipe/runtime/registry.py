"""The runtime registry, keyed by device type, and `to()` which tags ``_pipe_runtime``."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.runtime.base import BaseRuntime
from lightning_pipe.runtime.pytorch import PyTorchRuntime

T = TypeVar("T", nn.Module, torch.Tensor)


class RuntimeRegistry:
    """Maps a device type (``"cpu"``, ``"cuda"``, ``"my_device"``) to a runtime class."""

    def __init__(self) -> None:
        self._classes: dict[str, type[BaseRuntime]] = {}

    def register(self, device_type: str, runtime_class: type[BaseRuntime]) -> None:
        if not (isinstance(runtime_class, type) and issubclass(runtime_class, BaseRuntime)):
            raise TypeError(f"runtime for {device_type!r} must be a BaseRuntime subclass, got {runtime_class!r}")
        self._classes[device_type] = runtime_class

    def available(self) -> list[str]:
        return sorted(self._classes)

    def get_runtime_class(self, device_type: str) -> type[BaseRuntime]:
        try:
            return self._classes[device_type]
        except KeyError:
            known = ", ".join(self.available())
            raise ConfigurationError(
                f"no runtime is registered for device type {device_type!r}; registered: {known}. "
                "Register one with lightning_pipe.runtime_registry.register(device_type, RuntimeClass)"
            ) from None

    def create(self, device: str | torch.device, config: dict[str, Any] | None = None) -> BaseRuntime:
        """A runtime for ``device`` (e.g. ``"cuda:1"``), chosen by its type."""
        spec = str(device)
        return self.get_runtime_class(spec.split(":")[0])(spec, config)


runtime_registry = RuntimeRegistry()
runtime_registry.register("cpu", PyTorchRuntime)
runtime_registry.register("cuda", PyTorchRuntime)


def to(module_or_tensor: T, device: str | torch.device, config: dict[str, Any] | None = None) -> T:
    """Move a module or tensor with the runtime registered for ``device``.

    A module is tagged with ``_pipe_runtime`` (the runtime that holds it), which the pipeline uses
    to run it. Returns the moved object.
    """
    runtime = runtime_registry.create(device, config)
    if isinstance(module_or_tensor, nn.Module):
        moved = runtime.move_module(module_or_tensor)
        moved._pipe_runtime = runtime  # type: ignore[assignment]
        return moved
    if isinstance(module_or_tensor, torch.Tensor):
        return runtime.move_tensor(module_or_tensor)
    raise TypeError(f"lightning_pipe.to() takes a module or a tensor, got {type(module_or_tensor).__name__}")
