"""A single-file checkpoint written a part at a time: ``torch.load`` reads it as if ``torch.save`` wrote it.

``torch.save`` pickles the whole object, then writes each tensor's bytes: every tensor must be in memory
at once. Here the pickle names each tensor by a placeholder (`Pending`: its shape and dtype, and which
part of the checkpoint holds it), and the bytes are written part after part (a stage's parameters, then
its optimizer state, then the next stage's), each fetched just before it is written and dropped after.
The file is torch's own zip format (``data.pkl``, then one record per tensor), written with torch's
writer; its tensors are rebuilt by ``torch._utils._rebuild_tensor_v2`` as ``torch.save``'s are, so
``torch.load`` (``weights_only`` too) and a plain Trainer read it. We write this ourselves because
torch offers no streaming ``save`` (``torch.serialization.skip_data`` reserves the space but leaves filling
it to a second pass through a mapping of the whole file).
"""

from __future__ import annotations

import io
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Fetch = Callable[[], dict[Any, torch.Tensor]]  # one part's tensors, by the ids its placeholders carry


@dataclass(frozen=True)
class Pending:
    """A tensor of the checkpoint that is not in memory yet: written when its part is fetched."""

    part: int
    id: Any
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    def __reduce_ex__(self, protocol: Any) -> Any:
        stride = torch.empty(self.shape, device="meta").stride()
        return (
            torch._utils._rebuild_tensor_v2,
            (_Storage(self), 0, self.shape, stride, self.requires_grad, OrderedDict()),
        )


class _Storage:
    def __init__(self, pending: Pending) -> None:
        self.pending = pending


def pending_like(part: int, id: Any, tensor: torch.Tensor) -> Pending:
    """A placeholder for a tensor shaped like ``tensor`` (meta or real), written with part ``part``."""
    return Pending(part, id, tuple(tensor.shape), tensor.dtype)


def save_in_parts(obj: Any, path: str | Path, parts: Iterable[tuple[int, Fetch]]) -> None:
    """Write ``obj`` (whose tensors are `Pending`) to ``path``; ``parts`` fetches each part's tensors in turn."""
    keys: dict[Any, str] = {}
    placeholders: dict[str, Pending] = {}
    inline: dict[str, torch.UntypedStorage] = {}  # tensors that are in ``obj`` itself (small ones: Adam's step)
    storage_names = torch.storage._dtype_to_storage_type_map()

    class Pickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.storage.TypedStorage):  # a real tensor: as torch.save writes it
                key = keys.setdefault(value._untyped_storage._cdata, str(len(keys)))
                inline[key] = value._untyped_storage.cpu()
                return ("storage", getattr(torch, value._pickle_storage_type()), key, "cpu", value._size())
            if not isinstance(value, _Storage):
                return None
            pending = value.pending
            key = keys.setdefault((pending.part, pending.id), str(len(keys)))
            placeholders[key] = pending
            numel = 1
            for size in pending.shape:
                numel *= size
            return ("storage", getattr(torch, storage_names[pending.dtype]), key, "cpu", numel)

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(obj)
    data = buffer.getvalue()
    writer = torch._C.PyTorchFileWriter(str(path))
    try:
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", b"1", 1)
        alignment = str(torch.serialization._get_storage_alignment()).encode()
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
        for key, storage in inline.items():
            writer.write_record(f"data/{key}", storage, storage.nbytes())  # type: ignore[arg-type]
        by_part: dict[int, list[str]] = {}
        for key, pending in placeholders.items():
            by_part.setdefault(pending.part, []).append(key)
        for part, fetch in parts:
            tensors = fetch()
            for key in by_part.pop(part, []):
                pending = placeholders[key]
                tensor = tensors[pending.id].detach().to("cpu", pending.dtype).contiguous()
                if tuple(tensor.shape) != pending.shape:
                    raise ValueError(
                        f"part {part}: {pending.id!r} has shape {tuple(tensor.shape)}, not {pending.shape}"
                    )
                storage = tensor.untyped_storage()
                writer.write_record(f"data/{key}", storage, storage.nbytes())  # type: ignore[arg-type]
            del tensors
        if by_part:
            missing = sorted(by_part)
            raise ValueError(f"the checkpoint's parts {missing} were never fetched")
    finally:
        writer.write_end_of_file()
