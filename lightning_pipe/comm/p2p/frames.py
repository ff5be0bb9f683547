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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_pipe.base import tree
from lightning_pipe.comm import by_value
from lightning_pipe.comm.base import Message, MessageKind
from lightning_pipe.comm.p2p.dtensor_frames import DTensorLayout, local_part, rebuild

HEADER_FIELDS = 8
HEADER_BYTES = HEADER_FIELDS * 8
ALIGN = 64  # offsets of the parts of an inline frame: any dtype's view of the bytes is aligned
INLINE_BYTES = 1 << 20  # the largest inline frame: a receiver keeps two buffers of this size per peer
CONTROL, CLOSE, KEEPALIVE = -1, -2, -3
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

    @property
    def nbytes(self) -> int:
        return sum(_numel(m.shape) * m.dtype.itemsize for m in self.metas)

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


def split_payload(kind: str, payload: Any) -> tuple[FrameSignature | None, list[torch.Tensor]]:
    """The signature of a tensor message and its tensors; None where it cannot be cached (unhashable leaves)."""
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
    flags = int(inline) + 2 * (bundled - 1)
    fields = [marker, destination, message.source, message.step, message.stage, message.microbatch, extra, flags]
    return torch.tensor(fields, dtype=torch.int64)


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


def pack(head: torch.Tensor, extra: bytes, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding a frame's header, pickled bytes and tensors (a copy of each)."""
    parts = [head.view(torch.uint8)]
    if extra:
        parts.append(torch.frombuffer(bytearray(extra), dtype=torch.uint8))
    parts += [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    frame = torch.empty(sum(_aligned(p.numel()) for p in parts), dtype=torch.uint8)
    offset = 0
    for part in parts:
        frame[offset : offset + part.numel()].copy_(part)
        offset += _aligned(part.numel())
    return frame


def frame_bytes(frame: torch.Tensor, extra: int) -> bytes:
    """The ``extra`` pickled bytes of an inline frame."""
    offset = _aligned(HEADER_BYTES)
    return bytes(frame[offset : offset + extra].numpy()) if extra else b""


def frame_tensors(frame: torch.Tensor, extra: int, metas: Sequence[TensorHeader]) -> list[torch.Tensor]:
    """Copies of an inline frame's tensors: the receiver posts the frame's buffer again at once."""
    offset = _aligned(HEADER_BYTES) + _aligned(extra)
    tensors = []
    for meta in metas:
        size = _numel(meta.shape) * meta.dtype.itemsize
        tensors.append(frame[offset : offset + size].view(meta.dtype).view(meta.shape).clone())
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
