"""`LazyTensor`: a checkpoint tensor read on first touch, so ``on_load_checkpoint`` sees a folder's state cheaply.

A single-file checkpoint is mapped into memory (``torch.load(mmap=True)``), so its ``state_dict`` costs nothing
until a tensor is read. A sharded folder (torch.distributed.checkpoint) has no such mapping; its ``state_dict`` is
handed to the user's hook as a dict of `LazyTensor`: each knows its shape and dtype from the folder's metadata
and reads itself (its whole tensor, once) when an operation needs its values. A hook that renames or drops keys
reads nothing; one that converts or scales a tensor reads that tensor. Written as a tensor subclass, the way
torch's own fake and functional tensors are, since a hook's code expects ``torch.Tensor`` values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from lightning_pipe.weights.sources import DcpSource


class LazyTensor(torch.Tensor):
    """A tensor of ``key`` in a checkpoint, read by ``read(key)`` when an operation first needs its values."""

    stored_key: str  # its key in the checkpoint
    reader: Callable[[str], torch.Tensor]
    loaded: torch.Tensor | None  # its values, once read

    @staticmethod
    def __new__(cls, key: str, shape: torch.Size, dtype: torch.dtype, read: Callable[[str], torch.Tensor]) -> Any:
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("cpu"))
        tensor.stored_key, tensor.reader, tensor.loaded = key, read, None
        return tensor

    def value(self) -> torch.Tensor:
        """The tensor's values (read now, the first time)."""
        if self.loaded is None:
            self.loaded = self.reader(self.stored_key)
        return self.loaded

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LazyTensor({self.stored_key!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        def unwrap(value: Any) -> Any:
            return value.value() if isinstance(value, LazyTensor) else value

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def lazy_state_dict(folder: DcpSource, section: str) -> dict[str, torch.Tensor]:
    """The tensors under ``section`` (``"state_dict"``) of a sharded folder, by their keys without it, unread."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    start = f"{section}."
    found: dict[str, torch.Tensor] = {}
    for flat, meta in folder.metadata.items():
        if flat.startswith(start) and isinstance(meta, TensorStorageMetadata):
            found[flat[len(start) :]] = LazyTensor(flat, meta.size, meta.properties.dtype, folder.get)
    return found
