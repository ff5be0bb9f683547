"""Compression of the tensors that activation and gradient messages carry between processes.

A `Codec` turns a tensor into what crosses the wire (``encode``, on the sender) and back
(``decode``, in the receiver's I/O thread, before the message reaches the inbox). Built in:

- ``"bf16"`` / ``"fp16"``: floating tensors wider than 16 bits travel as bfloat16 / float16 and
  come back in their own dtype (lossy: bfloat16 keeps 8 significant bits and float32's range,
  float16 11 bits but overflows to inf beyond ±65504). Integer, bool and 16-bit tensors are never cast.
- ``"zstd"``: lossless, every tensor's bytes shuffled by significance and compressed with
  Zstandard (the ``zstandard`` package: ``pip install "lightning_pipe[compress]"``).
- ``"bf16+zstd"`` / ``"fp16+zstd"``: the cast, then Zstandard.
- any object with ``encode(tensor) -> value`` and ``decode(value) -> tensor`` (see `Codec`).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from lightning_pipe.base import tree
from lightning_pipe.base.errors import ConfigurationError

_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}
_THREAD = threading.local()


@runtime_checkable
class Codec(Protocol):
    """How one tensor crosses the wire.

    ``encode(tensor)`` runs on the sender and returns any picklable value (tensors inside it travel
    as RPC tensors, ``bytes`` as bytes); ``decode(value)`` runs in the receiving process and returns
    a tensor of the original dtype and shape. A lossless codec returns the same values. A codec is
    pickled once per pipeline build and sent to every worker (one defined in the training script
    travels by value).
    """

    def encode(self, tensor: torch.Tensor) -> Any: ...

    def decode(self, encoded: Any) -> torch.Tensor: ...


class Encoded:
    """A tensor's place in a message payload, holding what its codec made of it (a leaf for pytree)."""

    __slots__ = ("value",)
    #: unhashable: a message with encoded tensors is never described by a cached signature (`p2p.frames`), its
    #: encoded form changes with every message; it is pickled whole, its tensors sent raw
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[type[Encoded], tuple[Any]]:
        return Encoded, (self.value,)


def encode_payload(codec: Codec, payload: Any) -> Any:
    """``payload`` with every tensor replaced by its `Encoded` form."""
    return tree.map_tensors(lambda t: Encoded(codec.encode(t)), payload)


def decode_payload(codec: Codec, payload: Any) -> Any:
    """The inverse of `encode_payload`: every `Encoded` leaf decoded back into a tensor."""
    return tree.map_leaves(lambda x: codec.decode(x.value) if isinstance(x, Encoded) else x, payload)


def wire_bytes(value: Any) -> int:
    """Bytes of the tensors and byte strings in ``value``, inside tuples, lists and dicts (what an encoded
    payload puts on the wire, pickling's few bytes of framing aside)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if isinstance(value, Encoded):
        return wire_bytes(value.value)
    if isinstance(value, tuple | list):
        return sum(wire_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(wire_bytes(v) for v in value.values())
    return 0


class _Cast(NamedTuple):
    value: Any  # the cast tensor (or its encoding by the next codec); the tensor itself when not cast
    dtype: torch.dtype | None  # the original dtype, None when not cast


@dataclass(frozen=True)
class Cast:
    """Floating tensors wider than ``dtype`` travel as ``dtype`` (lossy), then optionally through ``then``."""

    dtype: torch.dtype
    then: Codec | None = None

    def encode(self, tensor: torch.Tensor) -> _Cast:
        cast = tensor.is_floating_point() and tensor.element_size() > _bytes(self.dtype)
        value = tensor.to(self.dtype) if cast else tensor
        return _Cast(self.then.encode(value) if self.then is not None else value, tensor.dtype if cast else None)

    def decode(self, encoded: _Cast) -> torch.Tensor:
        value = self.then.decode(encoded.value) if self.then is not None else encoded.value
        return value.to(encoded.dtype) if encoded.dtype is not None else value


class _Zstd(NamedTuple):
    data: bytes | torch.Tensor  # the shuffled, compressed bytes, or the tensor itself when they would not be smaller
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Zstd:
    """Lossless: a tensor's bytes grouped by significance (byte shuffle), compressed with Zstandard.

    Floating-point data compresses poorly as it lies in memory; with the bytes of equal
    significance side by side (sign and exponent bytes together, as HDF5's and Blosc's shuffle
    filters do), the slowly varying exponents compress well. A tensor whose bytes would shrink by
    less than ``min_saving`` travels as it is, so incompressible data costs only the attempt.

    Args:
        level: Zstandard's compression level (1: fastest of the regular levels, which a link
            between machines needs; higher levels save a few percent more at several times the cost).
        min_saving: fraction of the bytes compression must save to be used.
    """

    level: int = 1
    min_saving: float = 0.05

    def __post_init__(self) -> None:
        _zstd()  # a missing package fails when the codec is chosen, not later in a worker's I/O thread

    def encode(self, tensor: torch.Tensor) -> _Zstd:
        shape, size = tuple(tensor.shape), tensor.element_size()
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        # numpy, not torch: torch copies a byte-wise transpose about 8x slower (6 ms against 0.8 ms per MB)
        shuffled = np.ascontiguousarray(raw.reshape(-1, size).T) if size > 1 else raw
        data = _coder("compressor", self.level).compress(shuffled)
        if len(data) > (1 - self.min_saving) * raw.size:
            return _Zstd(tensor.contiguous(), tensor.dtype, shape)
        return _Zstd(data, tensor.dtype, shape)

    def decode(self, encoded: _Zstd) -> torch.Tensor:
        if isinstance(encoded.data, torch.Tensor):
            return encoded.data
        raw = np.frombuffer(_coder("decompressor").decompress(encoded.data), dtype=np.uint8)
        size = _bytes(encoded.dtype)
        unshuffled = np.ascontiguousarray(raw.reshape(size, -1).T) if size > 1 else raw.copy()
        return torch.from_numpy(unshuffled).view(encoded.dtype).view(encoded.shape)


def resolve_codec(compress: Any) -> Codec | None:
    """``compress=`` as a codec: None, ``"bf16"``, ``"fp16"``, ``"zstd"``, ``"bf16+zstd"``, ``"fp16+zstd"``, a codec."""
    if compress is None:
        return None
    if isinstance(compress, str):
        name = compress.strip().lower()
        if name == "zstd":
            return Zstd()
        cast, _, then = name.partition("+")
        if cast in _CASTS and then in ("", "zstd"):
            return Cast(_CASTS[cast], Zstd() if then else None)
        raise ConfigurationError(
            f"compress={compress!r} is not a known codec; available: None, 'bf16', 'fp16', 'zstd', 'bf16+zstd', "
            "'fp16+zstd', or an object with encode(tensor) and decode(value) methods"
        )
    if isinstance(compress, Codec):
        return compress
    raise ConfigurationError(
        f"compress={compress!r} has no encode(tensor) and decode(value) methods; pass a codec name or a Codec"
    )


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _zstd() -> Any:
    """The ``zstandard`` module, imported when a codec first needs it."""
    try:
        return importlib.import_module("zstandard")
    except ImportError:
        raise ConfigurationError(
            "compress='zstd' needs the zstandard package: pip install 'lightning_pipe[compress]' "
            "(or pip install zstandard)"
        ) from None


def _coder(kind: str, level: int = 0) -> Any:
    """This thread's Zstandard (de)compressor: one instance must not be used by two threads at once."""
    key = (kind, level)
    coders: dict[tuple[str, int], Any] = _THREAD.__dict__.setdefault("coders", {})
    if key not in coders:
        module = _zstd()
        coders[key] = module.ZstdCompressor(level=level) if kind == "compressor" else module.ZstdDecompressor()
    return coders[key]
