"""The sending half of a wire (`p2p.wire`): one link per peer and the frames that go over it.

A send posts its frame's ``isend``s from the sending thread itself, under the link's lock, and returns:
the transfer runs in the process group's own I/O threads, so each link keeps its order and no thread has
to be woken to send. A frame's tensors stay referenced until their sends completed. A tensor message
sends its signature (its tensors' shapes and dtypes) once per link and a marker after that. Over gloo a
message of up to `p2p.frames.INLINE_BYTES` is one inline frame, one ``isend`` of a packed copy into a
buffer the receiver posted ahead; a larger one is a header-only frame followed by its parts. Under NCCL,
whose receives must match their sends' sizes, every part of a frame is its own send, in order.
"""

from __future__ import annotations

import collections
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from lightning_pipe.comm.base import Message
from lightning_pipe.comm.p2p import frames
from lightning_pipe.comm.p2p.frames import FRAME_BUFFERS, FRAME_TAG, SPILL_TAG, ahead_of_time, body_tag

IN_FLIGHT = 8  # sends a gloo link holds before it waits for the oldest (each a frame or one part of a spilled one)
RING = IN_FLIGHT + 2  # buffers a link packs its inline frames into, each reused once its send completed


@dataclass
class WireStats:
    """What one endpoint sent, by message kind: messages, raw tensor bytes, pickled bytes and header bytes."""

    messages: Counter[str] = field(default_factory=Counter)
    tensor_bytes: Counter[str] = field(default_factory=Counter)
    pickled_bytes: Counter[str] = field(default_factory=Counter)
    header_bytes: Counter[str] = field(default_factory=Counter)
    local: Counter[str] = field(default_factory=Counter)  # passed by reference within the process
    signatures: int = 0  # signatures negotiated (their bytes are in pickled_bytes)

    def total_bytes(self) -> int:
        return sum(self.tensor_bytes.values())


class FrameBuffer:
    """One buffer of a link's ring (`Link.buffer`): an inline frame is packed into it and sent from it."""

    def __init__(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        self.busy = False  # its send has not completed yet
        self._frames: dict[int, torch.Tensor] = {}  # by size: the tensor a send of that many bytes posts

    def frame(self, size: int) -> torch.Tensor:
        """The first ``size`` bytes as a tensor, to send (made once per size: a frame's size repeats)."""
        frame = self._frames.get(size)
        if frame is None:
            frame = self._frames[size] = torch.from_numpy(self.array[:size])
        return frame

    def fit(self, size: int) -> np.ndarray:
        if self.array.size < size:
            self.array = np.empty(max(size, 2 * self.array.size, 256), dtype=np.uint8)
            self._frames = {}
        return self.array


class Link:
    """This process's side of one link: its lock, the signatures it negotiated, the sends in flight, the ring of
    buffers its inline frames are packed into (no allocation per message: a small message's send is mostly the
    Python and torch ops around gloo's own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.signatures: dict[frames.FrameSignature, int] = {}
        #: each send's work and what it sends from, kept alive until the send completed
        self.pending: collections.deque[tuple[Any, torch.Tensor | FrameBuffer]] = collections.deque()
        self.last_send = time.monotonic()
        self.closed = False
        self.ring = [FrameBuffer() for _ in range(RING)]
        self.turn = 0

    def buffer(self, size: int, timeout: float) -> FrameBuffer:
        """The ring's next buffer, at least ``size`` bytes, once the send from it completed (waiting if not)."""
        buffer = self.ring[self.turn]
        self.turn = (self.turn + 1) % len(self.ring)
        while buffer.busy:
            self._wait_oldest(timeout)
        buffer.fit(size)
        return buffer

    def reap(self, timeout: float, bound: int | None) -> None:
        """Forget the sends that completed (raising a failed one's error), the oldest first, and wait for those
        beyond ``bound``: gloo's send work says it completed only once waited on, so without the wait a link
        would hold every frame it ever sent (and a spilled message's tensors) until it closes. (NCCL's work
        knows when it completed, and its wait only orders streams: no bound there.)"""
        while self.pending and ((bound is not None and len(self.pending) > bound) or self.pending[0][0].is_completed()):
            self._wait_oldest(timeout)  # sent long ago into a buffer posted ahead: returns at once

    def in_flight(self) -> int:
        """The sends this link still holds (over gloo at most `IN_FLIGHT` plus one frame's parts)."""
        return len(self.pending)

    def drain(self, timeout: float) -> None:
        """Wait until every send of this link completed."""
        while self.pending:
            self._wait_oldest(max(0.1, timeout))

    def _wait_oldest(self, timeout: float) -> None:
        work, sent = self.pending.popleft()
        work.wait(timedelta(seconds=timeout))  # a gloo send's work is waited once: its second wait never returns
        if type(sent) is FrameBuffer:
            sent.busy = False


class Sender:
    """Turns messages into frames and posts their sends on a link (the caller holds the link's lock).

    ``routes`` names each peer's group and its rank there; ``count`` gives the statistics of a sending endpoint,
    updated under ``lock`` (the wire's, which its statistics' readers take)."""

    def __init__(
        self,
        routes: dict[int, tuple[Any, int]],
        device: torch.device,
        framed: bool,
        timeout: float,
        count: Callable[[int], WireStats],
        lock: threading.Lock,
    ) -> None:
        self.routes, self.device, self.framed = routes, device, framed
        self.timeout, self.count, self.lock = timeout, count, lock
        self.bound = IN_FLIGHT if device.type == "cpu" else None  # gloo's sends need waiting for (`Link.reap`)

    def message(self, peer: int, link: Link, destination: int, message: Message, bundled: int = 1) -> None:
        """Send ``message`` to endpoint ``destination`` of ``peer``: as one inline frame where it fits."""
        stats, kind = self.count(message.source), message.kind
        signature: frames.FrameSignature | None = None
        tensors: list[torch.Tensor] = []
        if kind in frames.TENSOR_KINDS:
            signature, tensors = frames.split_payload(kind, message.payload)
        if signature is not None:
            extra = b""
            marker = link.signatures.get(signature)
            if marker is None:
                marker = link.signatures[signature] = len(link.signatures)
                extra = frames.encode_signature(signature)
                stats.signatures += 1
            metas: Sequence[frames.TensorHeader] = signature.metas
            size, nbytes = signature.sizes  # worked out once per signature: this runs for every message
            if extra:
                size = frames.inline_size(len(extra), metas)
        else:
            marker = frames.CONTROL
            extra, tensors, metas = frames.encode_control(message)
            size, nbytes = frames.inline_size(len(extra), metas), sum(t.numel() * t.element_size() for t in tensors)
        inline = self.framed and size <= frames.INLINE_BYTES
        fields = frames.header_fields(marker, destination, message, len(extra), inline, bundled)
        with self.lock:
            stats.messages[kind] += 1
            stats.header_bytes[kind] += frames.HEADER_BYTES
            stats.pickled_bytes[kind] += len(extra)
            stats.tensor_bytes[kind] += nbytes
        if inline:  # packed into the link's next buffer on the CPU: posted as it is (gloo only)
            buffer = link.buffer(size, self.timeout)
            frames.pack(fields, extra, tensors, buffer.array)
            self.transmit(peer, link, [(buffer.frame(size), FRAME_TAG)], packed=True, buffer=buffer)
            return
        head = torch.tensor(fields, dtype=torch.int64)
        spill = SPILL_TAG if self.framed else 0  # what follows a header-only frame, in order
        tensor_tag = body_tag(marker) if self.framed and signature is not None else spill
        parts = [(head, FRAME_TAG)]
        if extra:
            parts.append((torch.frombuffer(bytearray(extra), dtype=torch.uint8), spill))
        parts += [(t, tensor_tag) for t in tensors if t.numel() > 0]
        self.transmit(peer, link, parts)

    def close(self, peer: int, link: Link) -> None:
        """Send the close frame(s) and fill the bodies the peer posted ahead."""
        close = frames.control_header(frames.CLOSE)
        if not self.framed:
            self.transmit(peer, link, [(close, 0)])
            return
        self.transmit(peer, link, [(close, FRAME_TAG)] * FRAME_BUFFERS)  # one per posted frame
        for signature, marker in link.signatures.items():
            if ahead_of_time(signature):
                dummies = [meta.empty(self.device).zero_() for meta in signature.metas]
                self.transmit(peer, link, [(t, body_tag(marker)) for t in dummies if t.numel() > 0])

    def control(self, peer: int, link: Link, marker: int) -> None:
        """A frame without a message: a keep-alive, or a poke the peer answers with one (`p2p.direct`)."""
        self.transmit(peer, link, [(frames.control_header(marker), FRAME_TAG)])

    def transmit(
        self,
        peer: int,
        link: Link,
        parts: list[tuple[torch.Tensor, int]],
        packed: bool = False,
        buffer: FrameBuffer | None = None,
    ) -> None:
        """Post one frame's sends; its tensors (or the ring ``buffer`` it was packed into) stay held until sent."""
        group, dst = self.routes[peer]
        link.reap(self.timeout, self.bound)
        for part, tag in parts:
            if not packed:
                part = part.detach().to(self.device).contiguous()
                part = torch.view_as_real(part) if part.is_complex() else part
            # the process group's own send (what ``dist.isend`` calls after checks that hold for every wire's group)
            work = group.send([part], dst, tag)
            if buffer is not None:
                buffer.busy = True
            link.pending.append((work, part if buffer is None else buffer))
        link.last_send = time.monotonic()
