"""A stage's share of the global gradient norm, with gradients spread over processes (DTensors).

A stage's gradient is a plain tensor (whole in this process), or a DTensor: sharded over the stage's replicas
(FSDP), over its tensor ranks (tensor parallel), or over both (FSDP on top of tensor parallel: a 2-D mesh
``data_parallel`` x ``tensor_parallel``, as torchtitan composes them). Each counts whole and once: this process
adds ``|local|^p`` divided by the number of processes that hold the same local part (the sizes of the mesh
dimensions the DTensor is replicated over), and the sum is all-reduced over every dimension of each mesh in turn
(a sum over a 2-D grid is a sum over its rows, then over its columns). The max of an infinity norm is reduced
the same way, without the division.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_pipe.base.dtensor_shards import is_sharded

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def norm_share(grads: Sequence[torch.Tensor], norm_type: float, infinite: bool) -> torch.Tensor:
    """This process's share of the norm of ``grads`` (the sum of ``|g|^p``; the max of ``|g|`` for inf), each
    gradient counted whole and once over the processes that hold its parts; on the CPU."""
    plain = _share([(g, 1) for g in grads if not is_sharded(g)], norm_type, infinite)
    by_mesh: dict[Any, list[tuple[torch.Tensor, int]]] = {}
    for grad in grads:
        if is_sharded(grad):
            by_mesh.setdefault(grad.device_mesh, []).append((grad.to_local(), _copies(grad)))
    shares = [plain]
    for mesh, parts in by_mesh.items():  # the same meshes in the same order in every process of the stage
        share = _share(parts, norm_type, infinite)
        shares.append(over_mesh(share, mesh, "max" if infinite else "sum", parts[0][0].device))
    stacked = torch.stack(shares)
    return stacked.max() if infinite else stacked.sum()


def any_over_meshes(flag: bool, grads: Sequence[torch.Tensor]) -> bool:
    """Whether ``flag`` holds in any process that holds a part of ``grads`` (a GradScaler's inf/nan check)."""
    value = torch.tensor(float(flag))
    meshes = {g.device_mesh: g.to_local().device for g in grads if is_sharded(g)}
    for mesh, device in meshes.items():
        value = over_mesh(value, mesh, "max", device)
    return bool(value)


def over_mesh(value: torch.Tensor, mesh: Any, op: str, device: torch.device) -> torch.Tensor:
    """``value`` (a scalar) summed (``op="sum"``) or maxed over every process of ``mesh``, one dimension at a time."""
    reduced = value.detach().to(device).clone()
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(reduced, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=mesh.get_group(dim))
    return reduced.cpu()


def _copies(grad: DTensor) -> int:
    """How many processes of ``grad``'s mesh hold the same local part (its replicated dimensions' sizes)."""
    from torch.distributed.tensor import Replicate

    copies = 1
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Replicate):
            copies *= grad.device_mesh.size(dim)
    return copies


def _share(parts: Sequence[tuple[torch.Tensor, int]], norm_type: float, infinite: bool) -> torch.Tensor:
    """The sum of ``|g|^p / copies`` over ``parts`` (the max of ``|g|`` for inf), on the CPU; 0 for none."""
    if not parts:
        return torch.zeros(())
    shares = [
        g.detach().abs().max().float()
        if infinite
        else torch.linalg.vector_norm(g.detach(), norm_type).float() ** norm_type / copies
        for g, copies in parts
    ]
    stacked = torch.stack(shares)  # on the gradients' device: one copy to the CPU, not one per gradient
    return (stacked.max() if infinite else stacked.sum()).cpu()
