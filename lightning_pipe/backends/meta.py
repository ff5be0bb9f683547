"""`TensorMeta`: what a checker sees of a tensor (shape, dtype, device), never its data."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.base import tree


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype, device and ``requires_grad`` of a tensor, with the tensor methods checkers use."""

    shape: tuple[Any, ...]  # ints, or SymInts when a compiler traces with dynamic shapes
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def __repr__(self) -> str:
        dims = ", ".join(str(n) for n in self.shape)
        grad = ", requires_grad" if self.requires_grad else ""
        return f"TensorMeta([{dims}], {self.dtype}, {self.device}{grad})"


def metas_of(value: Any) -> Any:
    """``value`` with every tensor replaced by its `TensorMeta` (what checkers are called with)."""
    return tree.map_tensors(TensorMeta.of, value)


def signature(value: Any) -> Hashable:
    """A hashable key of ``value``'s structure, tensor metadata and other (hashable or repr'd) values."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, signature(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return (type(value).__name__, repr(value))
    hashable: Hashable = value
    return hashable
