"""The frames of the p2p communicator: what a message looks like on a point-to-point link.

A frame is a small int64 header, then (if the header counts any) one uint8 tensor of pickled
bytes, then the message's tensors, each sent as its own contiguous buffer::

    header  [marker, destination, source, step, stage, microbatch, extra bytes, 0]   int64 x 8
    extra   pickled bytes (a new signature, or a control message and its tensors' metadata)
    tensors raw, in the order of the payload's leaves

``marker`` >= 0 names a *signature*: activations and gradients of one kind, tree structure and
tensor shapes repeat every microbatch, so the first message of a signature carries the pickled
signature and later ones only the header and the raw tensors. Negative markers are a control
message (pickled by value each time: steps, calls, posts, replies, errors, builds), a keep-alive, or the
close of the link.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_pipe import tree
from lightning_pipe.comm import by_value
from lightning_pipe.comm.base import Message, MessageKind

HEADER_FIELDS = 8
CONTROL, CLOSE, KEEPALIVE = -1, -2, -3
#: the messages whose payloads repeat in structure: described by a signature negotiated once per link
TENSOR_KINDS = frozenset((MessageKind.ACTIVATION, MessageKind.OUTPUT, MessageKind.GRAD, MessageKind.INPUT_GRAD))


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate a tensor before its bytes arrive."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def finish(self, t: torch.Tensor) -> torch.Tensor:
        return t.requires_grad_() if self.requires_grad and t.is_floating_point() else t


@dataclass(frozen=True)
class Signature:
    """A tensor message without its tensors: kind, tree structure, non-tensor leaves, tensor metadata."""

    kind: str
    spec: Any  # torch.utils._pytree.TreeSpec
    others: tuple[tuple[int, Any], ...]  # (position, leaf) of every leaf that is not a tensor
    metas: tuple[TensorMeta, ...]

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


def _signature(kind: str, parts: Any, others: tuple[tuple[int, Any], ...], metas: tuple[TensorMeta, ...]) -> Signature:
    return Signature(kind, _spec_of(parts), others, metas)


def split_payload(kind: str, payload: Any) -> tuple[Signature | None, list[torch.Tensor]]:
    """The signature of a tensor message and its tensors; None where it cannot be cached (unhashable leaves)."""
    leaves, spec = tree.flatten(payload)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    others = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor))
    signature = Signature(kind, spec, others, tuple(TensorMeta.of(t) for t in tensors))
    try:
        hash(signature)
    except TypeError:
        return None, tensors
    return signature, tensors


def join_payload(signature: Signature, tensors: list[torch.Tensor]) -> Any:
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


def header(marker: int, destination: int, message: Message, extra: int) -> torch.Tensor:
    fields = [marker, destination, message.source, message.step, message.stage, message.microbatch, extra, 0]
    return torch.tensor(fields, dtype=torch.int64)


def control_header(marker: int) -> torch.Tensor:
    """A frame without a message (keep-alive, close)."""
    return torch.tensor([marker] + [0] * (HEADER_FIELDS - 1), dtype=torch.int64)


def encode_signature(signature: Signature) -> bytes:
    blob, tensors = by_value.dumps(signature)
    assert not tensors  # tensors are never leaves of a signature
    return blob


def decode_signature(extra: bytes) -> Signature:
    signature: Signature = by_value.loads(extra, [])
    return signature


def encode_control(message: Message) -> tuple[bytes, list[torch.Tensor]]:
    """A control message pickled by value; its tensors stay out of the bytes and follow them raw."""
    blob, tensors = by_value.dumps(message)
    return pickle.dumps((blob, [TensorMeta.of(t) for t in tensors]), protocol=pickle.HIGHEST_PROTOCOL), tensors


def control_metas(extra: bytes) -> tuple[bytes, list[TensorMeta]]:
    """The pickled message and the metadata of the tensors to receive after it."""
    blob, metas = pickle.loads(extra)
    return blob, metas


def decode_control(blob: bytes, metas: list[TensorMeta], tensors: list[torch.Tensor]) -> Message:
    message: Message = by_value.loads(blob, [m.finish(t) for m, t in zip(metas, tensors, strict=True)])
    return message


def message_of(signature: Signature, fields: list[int], tensors: list[torch.Tensor]) -> Message:
    _, _, source, step, stage, microbatch, _, _ = fields
    return Message(signature.kind, step, stage, microbatch, join_payload(signature, tensors), source)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
