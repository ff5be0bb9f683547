"""DTensors on a point-to-point link: each tensor rank sends its local part, the receiver rebuilds the DTensor.

With tensor parallel in a stage (launched mode, ``PipeStrategy(tensor_parallel=T)``) tensor rank t of stage p
sends what crosses to stage p + 1 (and the gradient back) to tensor rank t of that stage, over the pipeline of
tensor rank t. A plain tensor (a tensor parallel plan's replicated output) goes as it is, once per tensor rank
(measured against once-and-broadcast and scatter-gather: `benchmarks/tp_activations.py`, docs/launched.md). A
DTensor goes as its local part, and its layout (`DTensorLayout`: placements, whole shape and stride) rides in
the frame's `TensorHeader`; the receiver makes it a DTensor again over its own stage's tensor mesh
(`use_tensor_mesh`, set once by launched mode when it makes its groups), with the same placements: the tensor
ranks of the two stages are the same ranks of meshes of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.base.dtensor_shards import is_sharded
from lightning_pipe.base.errors import TransportError

_MESH: list[Any] = [None]  # this process's tensor mesh (one per launched world), set by `use_tensor_mesh`


def use_tensor_mesh(mesh: Any) -> None:
    """The device mesh that DTensors received by this process are rebuilt over (its stage's tensor ranks)."""
    _MESH[0] = mesh


@dataclass(frozen=True)
class DTensorLayout:
    """How a local part is laid out in its DTensor: the placements on the tensor mesh, the whole shape and stride."""

    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, DTensorLayout | None]:
    """What a link sends of ``tensor``: itself (no layout), or a DTensor's local part and its layout."""
    if not is_sharded(tensor):  # asked without importing DTensor: most pipelines never make one
        return tensor, None
    layout = DTensorLayout(tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.stride()))
    return tensor.to_local(), layout


def rebuild(local: torch.Tensor, layout: DTensorLayout, requires_grad: bool) -> torch.Tensor:
    """The DTensor of a received local part, over this process's tensor mesh (a new autograd leaf)."""
    from torch.distributed.tensor import DTensor

    mesh = _MESH[0]
    if mesh is None:
        raise TransportError(
            "a DTensor arrived on a point-to-point link, but this process has no tensor mesh; DTensors cross between "
            "stages with PipeStrategy(tensor_parallel=T) in launched mode"
        )
    value = DTensor.from_local(
        local, mesh, layout.placements, run_check=False, shape=torch.Size(layout.shape), stride=layout.stride
    )
    return value.requires_grad_() if requires_grad and value.is_floating_point() else value
