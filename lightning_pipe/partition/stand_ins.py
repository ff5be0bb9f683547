"""Tracing a model built on the meta device: each layer gets zeros for its weights while it runs, then none.

A traced partition runs the model's forward once on an example, with real values, so that Python control
flow on the example (``if mask.all()``, a mask built from the input) follows it. A model built on meta has
no values, and computing on meta tensors cannot answer such questions. So during the trace a leaf layer
with meta tensors gets zeros on the example's device while it runs, and meta again after: the trace holds
one layer's worth of memory at a time, never the model. The values a layer computes are those of zero
weights; only shapes and the example's own values steer the trace (a model whose control flow reads its
activations' values would need real weights, and traces as if they were zero).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


@contextmanager
def stand_in_values(module: nn.Module, inputs: Any) -> Iterator[None]:
    """While the block runs: ``module``'s meta parameters and buffers are zeros on the device of ``inputs``."""
    device = next((t.device for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)), torch.device("cpu"))
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []  # (a module's parameters or buffers, name, meta)
    if device.type != "meta":
        for owner in module.modules():
            stores: tuple[dict[str, Any], ...] = (owner._parameters, owner._buffers)
            for store in stores:
                for name, tensor in store.items():
                    if tensor is not None and tensor.is_meta:
                        zeros = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
                        store[name] = (
                            nn.Parameter(zeros, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else zeros
                        )
                        swapped.append((store, name, tensor))
    try:
        yield
    finally:
        for store, name, tensor in swapped:
            store[name] = tensor


def stand_in(value: Any, like: Any) -> Any:
    """A meta tensor read as an attribute during the trace: zeros on the device of ``like`` (the example)."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        device = next((t.device for t in pytree.tree_leaves(like) if isinstance(t, torch.Tensor)), torch.device("cpu"))
        if device.type != "meta":
            return torch.zeros(value.shape, dtype=value.dtype, device=device)
    return value
