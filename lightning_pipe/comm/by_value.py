"""Control payloads pickled by value, so that worker processes never import the training script.

A stage worker process does not run the user's ``__main__``: whatever the script defines itself (the model's
classes, a loss function, a lambda) crosses to the workers by value (cloudpickle), everything importable by
reference, and a payload's tensors travel beside the pickle. The worker makes the names it received
importable as ``__main__.<name>``, so what it sends back is the coordinator's own class again. Only builds and
control messages go this way; activations and gradients are plain tensors (docs/internals.md).
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from typing import Any

import cloudpickle
import torch

_ADOPTED: set[str] = set()  # names this process's __main__ received from a coordinator


class ByValue:
    """Wraps ``payload``: pickling the wrapper (by torch's RPC pickler) ships the script's objects by value."""

    __slots__ = ("payload",)

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[Any, tuple[bytes, list[torch.Tensor]]]:
        return loads, dumps(self.payload)


def dumps(payload: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``payload`` as cloudpickle bytes and the tensors it holds (kept out of the bytes)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump(payload)
    # a second record on the same memo: the script's top-level objects of the first, as the same objects
    pickler.dump(pickler.main_names)
    return buffer.getvalue(), pickler.tensors


def loads(blob: bytes, tensors: list[torch.Tensor]) -> Any:
    """The payload of `dumps`; the script's top-level names in it become this process's ``__main__.<name>``."""
    unpickler = _Unpickler(io.BytesIO(blob), tensors)
    payload = unpickler.load()
    _adopt(unpickler.load())
    return payload


def copy(payload: Any) -> Any:
    """A copy of ``payload`` as another process would receive it: by value, owning new tensors."""
    blob, tensors = dumps(payload)
    return loads(blob, [t.detach().clone() for t in tensors])


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        super().__init__(file, protocol=protocol)
        self.tensors: list[torch.Tensor] = []
        self.main_names: dict[str, Any] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is torch.Tensor and not obj.is_meta:  # parameters reduce to their data, a plain tensor
            self.tensors.append(obj)  # (a meta tensor, shapes only, pickles as itself)
            return len(self.tensors) - 1
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and getattr(obj, "__module__", None) == "__main__":
            name = obj.__qualname__
            if "." not in name and getattr(sys.modules["__main__"], name, None) is obj:
                self.main_names[name] = obj
        return super().reducer_override(obj)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.tensors[int(pid)]


def _adopt(names: dict[str, Any]) -> None:
    """Bind the coordinator's top-level objects in this process's ``__main__`` (never over a name of its own)."""
    main = sys.modules["__main__"]
    for name, obj in names.items():
        if name in _ADOPTED or not hasattr(main, name):
            setattr(main, name, obj)
            _ADOPTED.add(name)
