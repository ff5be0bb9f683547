"""The frames of the p2p communicator: what a message looks like on a point-to-point link.

A frame is a small int64 header, then (if the header counts any) pickled bytes, then the message's tensors::

    header  [marker, destination, source, step, stage, microbatch, extra bytes, flags]   int64 x 8
    extra   pickled bytes (a new signature, or a control message and its tensors' metadata)
    tensors raw, in the order of the payload's leaves

``marker`` >= 0 names a *signature* (sent pickled once per link, then only headers and raw tensors);
negative markers are control messages, keep-alives and closes. Inline frames, bundles and the tags: docs/internals.md.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from lightning_pipe.base import tree
from lightning_pipe.comm import by_value
from lightning_pipe.comm.base import Message, MessageKind
from lightning_pipe.comm.p2p.dtensor_frames import DTensorLayout, local_part, rebuild

HEADER_FIELDS = 8
HEADER_BYTES = HEADER_FIELDS * 8
_HEADER = struct.Struct(f"={HEADER_FIELDS}q")  # native order, as the receiver's int64 view reads it
ALIGN = 64  # offsets of the parts of an inline frame: any dtype's view of the bytes is aligned
INLINE_BYTES = 1 << 20  # the largest inline frame: a receiver keeps two buffers of this size per peer
CONTROL, CLOSE, KEEPALIVE = -1, -2, -3
POKE = -4  # asks the peer for a keep-alive: it wakes a thread of this process that waits on the link (`p2p.direct`)
# the tags of a framed link (gloo), which matches a receive by (source, tag); an ordered link (NCCL) sends on tag 0
FRAME_TAG = 0  # every frame's header (inline frames: the whole message)
SPILL_TAG = 1  # the pickled bytes and control tensors of a message too large to send inline
FRAME_BUFFERS = 2  # frames a receiver keeps posted per peer
#: the messages whose payloads repeat in structure: described by a signature negotiated once per link
TENSOR_KINDS = frozenset((MessageKind.ACTIVATION, MessageKind.OUTPUT, MessageKind.GRAD, MessageKind.INPUT_GRAD))


@dataclass(frozen=True)
class TensorHeader:
    """What a receiver needs to allocate a tensor before its bytes arrive (a DTensor's local part: its ``layout``
    in the DTensor, `lightning_pipe.comm.p2p.dtensor_frames`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    layout: DTensorLayout | None = None

    @staticmethod
    def of(t: torch.Tensor) -> TensorHeader:
        return TensorHeader(tuple(t.shape), t.dtype, t.requires_grad)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def finish(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout is not None:
            return rebuild(t, self.layout, self.requires_grad)
        return t.requires_grad_() if self.requires_grad and t.is_floating_point() else t


@dataclass(frozen=True)
class FrameSignature:
    """A tensor message without its tensors: kind, tree structure, non-tensor leaves, tensor metadata."""

    kind: str
    spec: Any  # torch.utils._pytree.TreeSpec
    others: tuple[tuple[int, Any], ...]  # (position, leaf) of every leaf that is not a tensor
    metas: tuple[TensorHeader, ...]

    def __hash__(self) -> int:  # looked up on every send: its spec's hash walks the tree, so it is kept
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.kind, self.spec, self.others, self.metas))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def nbytes(self) -> int:
        return sum(_numel(m.shape) * m.dtype.itemsize for m in self.metas)

    @property
    def sizes(self) -> tuple[int, int]:
        """The bytes of its inline frame (without pickled bytes) and of its tensors, worked out once."""
        cached = self.__dict__.get("_sizes")
        if cached is None:
            cached = (inline_size(0, self.metas), self.nbytes)
            object.__setattr__(self, "_sizes", cached)
        return cached

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # a TreeSpec pickles its leaves as the deprecated LeafSpec (a FutureWarning on every load): send its parts
        return _signature, (self.kind, _spec_parts(self.spec), self.others, self.metas)


def _spec_parts(spec: Any) -> Any:
    if spec.is_leaf():
        return None
    return (spec.type, spec.context, [_spec_parts(child) for child in spec.children()])


def _spec_of(parts: Any) -> Any:
    if parts is None:
        return pytree.treespec_leaf()
    kind, context, children = parts
    return pytree.TreeSpec(kind, context, [_spec_of(child) for child in children])


def _signature(
    kind: str, parts: Any, others: tuple[tuple[int, Any], ...], metas: tuple[TensorHeader, ...]
) -> FrameSignature:
    return FrameSignature(kind, _spec_of(parts), others, metas)


#: signatures of plain payloads (`tree.structure`: tuples and lists of tensors and scalars) by their shape and leaves
_PLAIN: dict[Any, FrameSignature] = {}
_MAX_PLAIN = 256


def split_payload(kind: str, payload: Any) -> tuple[FrameSignature | None, list[torch.Tensor]]:
    """The signature of a tensor message and its tensors; None where it cannot be cached (unhashable leaves).

    A plain payload's signature is found by a key of its shape, tensor metadata and scalars (one dict lookup,
    the same object each time); any other is made from its pytree."""
    plain = tree.structure(payload)
    key = None
    if plain is not None:
        leaves, shape = plain
        key = (kind, shape, tuple(_leaf_key(leaf) for leaf in leaves))
        known = _PLAIN.get(key)
        if known is not None:
            return known, [leaf for leaf in leaves if type(leaf) is torch.Tensor]
    signature, tensors = _split(kind, payload)
    if key is not None and signature is not None and len(_PLAIN) < _MAX_PLAIN:
        _PLAIN[key] = signature
    return signature, tensors


def _leaf_key(leaf: Any) -> Any:
    if type(leaf) is torch.Tensor:
        return (tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
    return leaf  # a scalar (its type is in the shape key)


def _split(kind: str, payload: Any) -> tuple[FrameSignature | None, list[torch.Tensor]]:
    leaves, spec = tree.flatten(payload)
    tensors, metas = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            local, layout = local_part(leaf)  # a DTensor: its local part, its layout in the header
            tensors.append(local)
            metas.append(TensorHeader(tuple(local.shape), local.dtype, leaf.requires_grad, layout))
    others = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor))
    signature = FrameSignature(kind, spec, others, tuple(metas))
    try:
        hash(signature)
    except TypeError:
        return None, tensors
    return signature, tensors


def join_payload(signature: FrameSignature, tensors: list[torch.Tensor]) -> Any:
    """The payload of `split_payload` again, from its signature and the received tensors."""
    count = len(signature.others) + len(tensors)
    leaves: list[Any] = [None] * count
    for i, leaf in signature.others:
        leaves[i] = leaf
    received = iter(meta.finish(t) for meta, t in zip(signature.metas, tensors, strict=True))
    taken = {i for i, _ in signature.others}
    for i in range(count):
        if i not in taken:
            leaves[i] = next(received)
    return tree.unflatten(leaves, signature.spec)


def header(
    marker: int, destination: int, message: Message, extra: int, inline: bool = False, bundled: int = 1
) -> torch.Tensor:
    return torch.tensor(header_fields(marker, destination, message, extra, inline, bundled), dtype=torch.int64)


def header_fields(
    marker: int, destination: int, message: Message, extra: int, inline: bool = False, bundled: int = 1
) -> list[int]:
    flags = int(inline) + 2 * (bundled - 1)
    return [marker, destination, message.source, message.step, message.stage, message.microbatch, extra, flags]


def bundle(messages: Sequence[Message]) -> Message:
    """One message for several tensor messages of one kind, step and stage, of consecutive microbatches."""
    first = messages[0]
    for offset, message in enumerate(messages):
        same = (message.kind, message.step, message.stage) == (first.kind, first.step, first.stage)
        if not same or message.microbatch != first.microbatch + offset:
            raise ValueError("a bundle holds messages of one kind, step and stage, of consecutive microbatches")
    payload = tuple(message.payload for message in messages)
    return Message(first.kind, first.step, first.stage, first.microbatch, payload, first.source)


def unbundle(message: Message, fields: list[int]) -> list[Message]:
    """The messages a received message stands for (itself unless its header says it is a bundle)."""
    count = 1 + (fields[7] >> 1)
    if count == 1:
        return [message]
    kind, step, stage, first, source = message.kind, message.step, message.stage, message.microbatch, message.source
    return [Message(kind, step, stage, first + i, message.payload[i], source) for i in range(count)]


def inline_size(extra: int, metas: Sequence[TensorHeader]) -> int:
    """The bytes of an inline frame with ``extra`` pickled bytes and tensors of ``metas``."""
    return _aligned(HEADER_BYTES) + _aligned(extra) + sum(_aligned(_numel(m.shape) * m.dtype.itemsize) for m in metas)


def body_tag(marker: int) -> int:
    """The tag of the tensors of signature ``marker`` when they travel outside the frame (framed mode)."""
    return 2 + marker


def ahead_of_time(signature: FrameSignature) -> bool:
    """Whether a framed receiver posts this signature's body ahead: its messages never fit inline."""
    return inline_size(0, signature.metas) > INLINE_BYTES


def pack(
    fields: list[int], extra: bytes, tensors: Sequence[torch.Tensor], into: np.ndarray | None = None
) -> np.ndarray:
    """A frame's header (`header_fields`), pickled bytes and tensors (a copy of each) in one uint8 array: ``into``
    (a buffer of the sender's, `p2p.frame_ring`, at least `inline_size` long) or a new one.

    The copies go through numpy where it has the dtype: one torch op per tensor instead of four (a small
    message's send is mostly such ops, each several microseconds in a thread that was just woken)."""
    if into is None:
        into = np.empty(inline_size(len(extra), [TensorHeader.of(t) for t in tensors]), dtype=np.uint8)
    frame = into
    _HEADER.pack_into(frame.data, 0, *fields)
    offset = _aligned(HEADER_BYTES)
    frame[offset : offset + len(extra)] = np.frombuffer(extra, dtype=np.uint8)
    offset += _aligned(len(extra))
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        part, dtype = frame[offset : offset + nbytes], numpy_dtype(t.dtype)
        offset += _aligned(nbytes)
        if dtype is not None:
            try:
                np.copyto(part.view(dtype).reshape(t.shape), (t.detach() if t.requires_grad else t).numpy())
                continue
            except RuntimeError:  # numpy cannot see it (on a GPU, a conjugate or negative view): torch copies
                pass
        torch.from_numpy(part).copy_(t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8))
    return frame


def numpy_dtype(dtype: torch.dtype) -> Any:
    """The numpy dtype of a torch dtype, or None where numpy has none (bfloat16, float8, ...)."""
    known = _NUMPY.get(dtype, _MISSING)
    if known is _MISSING:
        try:
            known = _NUMPY[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            known = _NUMPY[dtype] = None
    return known


_NUMPY: dict[torch.dtype, Any] = {}
_MISSING = object()


def header_of(frame: Any) -> list[int]:
    """The header fields of a received frame (its buffer as a numpy array, or any object with the buffer protocol)."""
    return list(_HEADER.unpack_from(frame))


def frame_bytes(frame: np.ndarray, extra: int) -> bytes:
    """The ``extra`` pickled bytes of an inline frame (its buffer as a numpy array)."""
    offset = _aligned(HEADER_BYTES)
    return frame[offset : offset + extra].tobytes() if extra else b""


def frame_tensors(frame: np.ndarray, extra: int, metas: Sequence[TensorHeader]) -> list[torch.Tensor]:
    """Copies of an inline frame's tensors (its buffer as a numpy array): the receiver posts the buffer again at
    once. Copied by numpy where it has the dtype (one torch op per tensor, as `pack`)."""
    offset = _aligned(HEADER_BYTES) + _aligned(extra)
    tensors = []
    for meta in metas:
        size = _numel(meta.shape) * meta.dtype.itemsize
        part, dtype = frame[offset : offset + size], numpy_dtype(meta.dtype)
        if dtype is not None:
            tensors.append(torch.from_numpy(part.view(dtype).reshape(meta.shape).copy()))
        else:
            tensors.append(torch.from_numpy(part.copy()).view(meta.dtype).view(meta.shape))
        offset += _aligned(size)
    return tensors


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def control_header(marker: int) -> torch.Tensor:
    """A frame without a message (keep-alive, close)."""
    return torch.tensor([marker] + [0] * (HEADER_FIELDS - 1), dtype=torch.int64)


def encode_signature(signature: FrameSignature) -> bytes:
    blob, tensors = by_value.dumps(signature)
    assert not tensors  # tensors are never leaves of a signature
    return blob


def decode_signature(extra: bytes) -> FrameSignature:
    signature: FrameSignature = by_value.loads(extra, [])
    return signature


def encode_control(message: Message) -> tuple[bytes, list[torch.Tensor], list[TensorHeader]]:
    """A control message pickled by value; its tensors stay out of the bytes and follow them raw."""
    blob, tensors = by_value.dumps(message)
    metas = [TensorHeader.of(t) for t in tensors]
    return pickle.dumps((blob, metas), protocol=pickle.HIGHEST_PROTOCOL), tensors, metas


def control_metas(extra: bytes) -> tuple[bytes, list[TensorHeader]]:
    """The pickled message and the metadata of the tensors to receive after it."""
    blob, metas = pickle.loads(extra)
    return blob, metas


def decode_control(blob: bytes, metas: list[TensorHeader], tensors: list[torch.Tensor]) -> Message:
    message: Message = by_value.loads(blob, [m.finish(t) for m, t in zip(metas, tensors, strict=True)])
    return message


def message_of(signature: FrameSignature, fields: list[int], tensors: list[torch.Tensor]) -> Message:
    _, _, source, step, stage, microbatch, _, _ = fields
    return Message(signature.kind, step, stage, microbatch, join_payload(signature, tensors), source)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
