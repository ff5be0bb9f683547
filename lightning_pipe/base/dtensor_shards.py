"""Sharded tensors (FSDP2's DTensors) made real one shard at a time.

A stage sharded on meta (``data_parallel="fsdp"``) has DTensor parameters without values; each is made real
holding only this process's shard: read as a shard where the source reads shards (DCP), else read or
initialised whole, one tensor at a time, and cut locally as FSDP laid it out. `Wholes` counts the most bytes
of whole tensors held at once (docs/internals.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from lightning_pipe.base.pages import PAGE, can_give_back, give_back

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor as ADTensor  # for annotations: the functions import it lazily


def is_sharded(tensor: Any) -> TypeGuard[ADTensor]:
    """Whether ``tensor`` is a DTensor (a shard of a tensor spread over processes). Asked without importing
    ``torch.distributed.tensor`` (a third of a second of CPU in every stage worker process, which most pipelines never
    need): no tensor is a DTensor before that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor``: a DTensor's local tensor, else ``tensor`` itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``module`` was sharded with FSDP2's ``fully_shard`` (its class then FSDP's subclass of its own)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch built without distributed support has no FSDP
        return False
    return isinstance(module, FSDPModule)


def empty_shard_like(like: Any, device: torch.device) -> torch.Tensor:
    """A DTensor laid out as ``like`` (a meta one) whose local shard is allocated, without values, on ``device``."""
    from torch.distributed.tensor import DTensor

    local = torch.empty(like.to_local().shape, dtype=like.dtype, device=device)
    return _as(like, DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                        shape=like.shape, stride=like.stride()))  # fmt: skip


def whole_like(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A plain tensor of the whole shape of ``like`` (a DTensor), without values: where a module initialises it."""
    return _as(like, torch.empty(like.shape, dtype=like.dtype, device=device))


def shard_of(whole: torch.Tensor, like: Any, device: torch.device) -> torch.Tensor:
    """This process's shard of ``whole`` laid out as ``like`` (a DTensor), on ``device``; it holds no part of
    ``whole`` (a copy), which the caller frees right after: its other rows are given back first (`_drop_rest`),
    so while the shard is copied out a process holds the whole tensor's size, not that plus the shard."""
    from torch.distributed.tensor import distribute_tensor

    _drop_rest(whole, like)
    value = whole.detach()
    if value.device != device:
        value = value.to(device)
    cut = distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    local = cut.to_local()
    if local.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():  # a view: keep no part of whole
        local = local.clone()
    expected = tuple(like.to_local().shape)
    if tuple(local.shape) != expected:
        raise RuntimeError(f"this process's shard of a {tuple(like.shape)} tensor is {tuple(local.shape)}, "
                           f"but FSDP laid it out as {expected}")  # fmt: skip
    from torch.distributed.tensor import DTensor

    return _as(like, DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                        shape=like.shape, stride=like.stride()))  # fmt: skip


def copy_shard(target: Any, whole: torch.Tensor) -> None:
    """Copy this process's shard of ``whole`` into ``target`` (a real DTensor)."""
    from torch.distributed.tensor import distribute_tensor

    value = whole.detach().to(target.to_local().device)
    cut = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    with torch.no_grad():
        target.to_local().copy_(cut.to_local())


def _drop_rest(whole: torch.Tensor, like: Any) -> None:
    """Give back to the system the memory pages of ``whole`` (a CPU tensor nothing else reads, about to be freed)
    that lie wholly outside this process's rows (``Shard(0)`` over a 1-D mesh, FSDP's layout; else nothing):
    they read as zeros after, and only this process's rows are read before ``whole`` goes. Linux (madvise)."""
    from torch.distributed.tensor import Shard

    if not can_give_back() or whole.device.type != "cpu" or whole.dim() == 0 or not whole.is_contiguous():
        return
    if len(like.placements) != 1 or like.placements[0] != Shard(0) or like.device_mesh.ndim != 1:
        return
    chunks = torch.arange(whole.shape[0]).chunk(like.device_mesh.size())  # DTensor's Shard(0): torch.chunk's rows
    rank = like.device_mesh.get_local_rank()
    count = len(chunks[rank]) if rank < len(chunks) else 0
    if count != like.to_local().shape[0]:
        return  # not the layout assumed here: keep every page
    row = whole[0].numel() * whole.element_size()
    start = whole.data_ptr()
    keep = start + (int(chunks[rank][0]) * row if count else 0)
    _dont_need(start, keep)
    _dont_need(keep + count * row, start + whole.numel() * whole.element_size())


def _dont_need(start: int, end: int) -> None:
    """madvise(MADV_DONTNEED) on the pages wholly inside [start, end) (none that holds a byte outside it)."""
    first, last = start + (-start) % PAGE, end - end % PAGE
    if last > first:
        give_back(first, last)


@dataclass
class Wholes:
    """The whole (unsharded) tensors of sharded parameters a process held while making its stage: how many bytes
    at most at once (``peak``), and how many tensors it ever made whole (``count``)."""

    peak: int = 0
    count: int = 0
    _now: int = field(default=0, init=False, repr=False)  # bytes held now

    def hold(self, tensor: torch.Tensor) -> None:
        self._now += tensor.numel() * tensor.element_size()
        self.count += 1
        self.peak = max(self.peak, self._now)

    def drop(self, tensor: torch.Tensor) -> None:
        self._now -= tensor.numel() * tensor.element_size()


def _as(like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as a parameter where ``like`` is one (with its ``requires_grad``), else as it is."""
    if isinstance(like, nn.Parameter):
        return nn.Parameter(value, requires_grad=like.requires_grad)
    return value
