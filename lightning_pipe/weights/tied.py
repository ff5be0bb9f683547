"""Tied tensors: a tensor several modules hold is made once, as the first of them (in the model's order) makes it.

In one pass over a stage (`materialize`) the first module holding a tied tensor reads or initialises it and the
later ones find it made (their own initialisation does not write it again). A stage that holds the tensor without
its first holder (an embedding's weight tied to a last stage's head) initialises it as that holder would: in a
meta copy of the first holder, under the first holder's seed (`initialize_as_first`), so that every copy of the
tensor, in any stage or process, starts with one value.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pipe.base.dtensor_shards import is_fsdp_module, is_sharded
from lightning_pipe.weights.module_init import initialize
from lightning_pipe.weights.slots import Slot, get, own_slots, put


@dataclass
class FirstHolder:
    """The module that holds a tied tensor first: its key, its name in the model, a copy of it on meta, and the
    attribute it holds the tensor under."""

    key: str
    qualified: str
    module: nn.Module
    name: str
    is_param: bool


def first_holders(module: nn.Module) -> dict[str, FirstHolder]:
    """For each key of a tied tensor of ``module`` that a later module holds, the tensor's first holder.

    A holder sharded with FSDP is left out (it is not copied): its stage initialises the tensor itself.
    """
    first: dict[int, tuple[str, str, nn.Module, Slot]] = {}
    later: dict[int, list[str]] = {}
    for qualified, owner in module.named_modules(remove_duplicate=False):
        for key, slot in own_slots(qualified, owner):
            tid = id(get(slot))
            if tid not in first:
                first[tid] = (key, qualified, owner, slot)
            elif first[tid][1] != qualified:
                later.setdefault(tid, []).append(key)
    holders: dict[str, FirstHolder] = {}
    for tid, keys in later.items():
        key, qualified, owner, (_, name, is_param) = first[tid]
        copied = _on_meta(owner)
        if copied is not None:
            holders.update({k: FirstHolder(key, qualified, copied, name, is_param) for k in keys})
    return holders


def initialize_as_first(
    first: FirstHolder, tensor: torch.Tensor, seed: int, init_owner: nn.Module | None
) -> torch.Tensor:
    """``tensor`` (without values, held by a later module) initialised by its first holder's initialisation, in the
    copy of that holder; returns its value (the tensor, or the one the initialisation assigned)."""
    slot = (first.module, first.name, first.is_param)
    stand_in = get(slot)
    put(slot, tensor)
    try:
        initialize(first.module, first.qualified, seed, init_owner, {first.key: slot})
        return get(slot)
    finally:
        put(slot, stand_in)


def _on_meta(module: nn.Module) -> nn.Module | None:
    """A copy of ``module`` whose tensors are on meta (None for one sharded with FSDP, which refuses a copy)."""
    tensors = [*module.parameters(), *module.buffers()]
    if any(is_fsdp_module(m) for m in module.modules()) or any(is_sharded(t) for t in tensors):
        return None
    memo: dict[int, object] = {}
    for tensor in tensors:
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(module, memo)
