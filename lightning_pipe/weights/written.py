"""`Writes`: which elements of some tensors the operations run under it write, whatever their dtype or value.

A module's initialisation is judged by what it wrote, not by the values it left: a ``uint8`` buffer set to zeros
is initialised, an integer buffer half set is not, a ``bool`` mask nothing touched is not. While `Writes` is
active (a `TorchDispatchMode`), every operation that writes a tensor (an argument its schema marks ``(a!)``: an
in-place operation's ``self``, an ``out=``) marks the elements it wrote in a ``bool`` mask per watched storage;
a write through a view marks the view's elements (its shape, strides and offset in the storage).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Entry = tuple[torch.UntypedStorage, torch.Tensor]  # a watched storage (kept alive) and its mask, per element


class Writes(TorchDispatchMode):
    """Within ``with Writes(tensors) as writes:``, what is written of ``tensors``; `written` counts it after.

    A mask costs one byte per element of its tensor and lives as long as this object.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._masks: dict[int, Entry] = {}
        for tensor in tensors:
            storage = _storage(tensor)
            if storage is not None and storage.data_ptr() not in self._masks:
                elements = storage.nbytes() // tensor.element_size()
                self._masks[storage.data_ptr()] = (storage, torch.zeros(elements, dtype=torch.bool))

    def written(self, tensor: torch.Tensor) -> int | None:
        """How many elements of ``tensor`` were written; None where it is not a watched storage's (it was assigned
        anew, its ``.data`` replaced: what was assigned is its value)."""
        storage = _storage(tensor)
        entry = None if storage is None else self._masks.get(storage.data_ptr())
        if entry is None:
            return None
        covered = _elements(entry[1], tensor, entry[0])
        return None if covered is None else int(covered.sum())

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for index, name in _writable(func):
            value = kwargs[name] if name in kwargs else args[index] if index < len(args) else None
            for tensor in value if isinstance(value, list | tuple) else (value,):
                if isinstance(tensor, torch.Tensor):
                    self._mark(tensor)
        return out

    def _mark(self, view: torch.Tensor) -> None:
        storage = _storage(view)
        entry = None if storage is None else self._masks.get(storage.data_ptr())
        if entry is None or not view.numel():
            return
        covered = _elements(entry[1], view, entry[0])
        if covered is None:
            _mark_bytes(entry[1], view, entry[0])
        else:
            covered.fill_(True)


@functools.cache
def _writable(func: Any) -> list[tuple[int, str]]:
    """The (position, name) of each argument ``func`` writes to; none for ``set_`` and ``resize_``, which give a
    tensor other memory (what the tensor then holds is judged as assigned, `Writes.written`)."""
    if func.overloadpacket in (torch.ops.aten.set_, torch.ops.aten.resize_):
        return []
    return [
        (index, argument.name)
        for index, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """``tensor``'s storage, or None where it has none to watch (meta, empty, a wrapper subclass: a DTensor)."""
    if tensor.is_meta:
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage if storage.nbytes() else None


def _elements(mask: torch.Tensor, view: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor | None:
    """The part of ``mask`` (one flag per element of the watched tensor's dtype) that ``view`` covers; None where
    ``view``'s elements are of another size (``.view(torch.uint8)``, ``view_as_real``)."""
    size = storage.nbytes() // mask.numel()
    if view.element_size() != size:
        return None
    return mask.as_strided(view.shape, view.stride(), view.storage_offset())


def _mark_bytes(mask: torch.Tensor, view: torch.Tensor, storage: torch.UntypedStorage) -> None:
    """Mark what ``view``, whose elements are of another size than the mask's, wrote: an element of the mask is
    written when every one of its bytes is."""
    size, item = storage.nbytes() // mask.numel(), view.element_size()
    flags = torch.zeros(storage.nbytes(), dtype=torch.bool)
    flags.as_strided((*view.shape, item), (*(s * item for s in view.stride()), 1), view.storage_offset() * item).fill_(
        True
    )
    mask |= flags.view(-1, size).all(dim=1)
