"""Where a module holds a tensor (a `Slot`: the module, the attribute, parameter or buffer), read and replaced."""

from __future__ import annotations

import torch
from torch import nn

Slot = tuple[nn.Module, str, bool]  # (owner module, attribute name, is a parameter)


def own_slots(qualified: str, owner: nn.Module) -> list[tuple[str, Slot]]:
    """The key (``qualified`` + name) and slot of each parameter and buffer ``owner`` holds itself."""
    prefix = f"{qualified}." if qualified else ""
    slots: list[tuple[str, Slot]] = [
        (prefix + n, (owner, n, True)) for n, p in owner._parameters.items() if p is not None
    ]
    slots += [(prefix + n, (owner, n, False)) for n, b in owner._buffers.items() if b is not None]
    return slots


def get(slot: Slot) -> torch.Tensor:
    owner, name, is_param = slot
    value = owner._parameters[name] if is_param else owner._buffers[name]
    assert value is not None
    return value


def put(slot: Slot, value: torch.Tensor) -> None:
    owner, name, is_param = slot
    if is_param:
        owner._parameters[name] = value  # type: ignore[assignment]
    else:
        owner._buffers[name] = value


def empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor like ``tensor`` (a parameter stays a parameter) on ``device``, without values."""
    empty = torch.empty_like(tensor, device=device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(empty, requires_grad=tensor.requires_grad)
    return empty
