"""The receiving side of a p2p link: one thread per peer turns the peer's frames into messages.

*Framed* (gloo, which matches a receive by source and tag and lets it be larger than its send): two frame
buffers stay posted, so most messages are one inline frame received as soon as it is sent; a message too large
to pack spills its parts onto tags of their own. *Ordered* (NCCL, which matches by order and size): header,
pickled bytes and tensors as separate receives of exact size. The close of a link is a `CLOSE` header, so no
receive is left pending (docs/internals.md; the layout of a frame: `p2p.frames`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch

from lightning_pipe.comm.base import Message
from lightning_pipe.comm.p2p import frames
from lightning_pipe.comm.p2p.direct import Baton
from lightning_pipe.comm.p2p.frames import FRAME_BUFFERS, FRAME_TAG, SPILL_TAG, ahead_of_time, body_tag


class ReceivingWire(Protocol):
    """What a `Receiver` needs of the links it receives for (`p2p.wire.Wire` is this)."""

    ranks: list[int]  # the pipeline's processes, in pipeline order
    sources: dict[int, tuple[Any, int]]  # per peer: the group its messages come in on, and its rank there
    device: torch.device  # where the frames land
    framed: bool  # gloo: frames into buffers posted ahead; else (NCCL) every part in order
    timeout: float

    def deliver(self, destination: int, message: Message) -> None: ...

    def mark_lost(self, peer: int, reason: str) -> None: ...

    def peer_closed(self, peer: int) -> None: ...

    def keepalive_to(self, peer: int) -> None: ...

    def on_stream(self, ready: Any) -> Any: ...


class Receiver:
    """The receiving thread of one peer's link (``Wire`` starts it); delivers into the wire's inboxes."""

    def __init__(self, wire: ReceivingWire, peer: int, baton: Baton | None = None) -> None:
        self.wire, self.peer = wire, peer
        self.patience = timedelta(seconds=wire.timeout)  # a gloo wait that times out closes the link: the whole timeout
        self.group, self.src = wire.sources[peer]
        self.signatures: dict[int, frames.FrameSignature] = {}
        self.ahead: dict[int, tuple[list[torch.Tensor], list[Any]]] = {}  # framed: one body per large signature
        #: framed: the link's receive shared with the thread that waits for its messages (`p2p.direct`); None: this
        #: receiving thread alone waits on it
        self.baton = baton
        self.ended = False  # the link closed or broke: no frame comes any more
        if wire.framed:  # posted at once: the first frame may be waited for by either thread
            self._buffers = [torch.empty(frames.INLINE_BYTES, dtype=torch.uint8) for _ in range(FRAME_BUFFERS)]
            self._views = [buffer.numpy() for buffer in self._buffers]  # the same memory: read without torch ops
            self._works = [self._irecv(buffer, FRAME_TAG) for buffer in self._buffers]
            self._turn = 0

    def run(self) -> None:
        """The receiving thread: every frame of the link (with a baton: those nobody else waits for)."""
        if not self.wire.framed:
            self._guarded(self._ordered)
            return
        while not self.ended:
            if self.baton is not None and not self.baton.take_for_thread():
                return
            self.pump()
            if self.baton is not None:
                self.baton.thread_done()

    def pump(self) -> None:
        """Wait for the link's next frame and deliver its message (framed links; from either thread)."""
        self._guarded(self._frame)

    def _guarded(self, receive: Any) -> None:
        try:
            receive()
        except Exception as exc:
            self._end()
            self.wire.mark_lost(self.peer, first_line(exc))

    def _end(self) -> None:
        self.ended = True
        if self.baton is not None:
            self.baton.end()

    # framed (gloo)
    def _frame(self) -> None:
        if self.ended:
            return
        turn, works = self._turn, self._works
        self._turn = (turn + 1) % FRAME_BUFFERS
        self._complete([works[turn]])
        frame, view = self._buffers[turn], self._views[turn]
        fields = frames.header_of(view)
        marker, destination, extra, inline = fields[0], fields[1], fields[6], fields[7] & 1  # bit 0 of flags
        if marker == frames.CLOSE:
            self._complete([work for k, work in enumerate(works) if k != turn])  # the peer's other close frames
            self._closed()
            return
        if marker == frames.POKE:
            self.wire.keepalive_to(self.peer)
        keepalive = marker in (frames.KEEPALIVE, frames.POKE)
        if inline and not keepalive:  # delivered before the buffer is posted again: the stage wakes sooner
            self._deliver(destination, self._inline(fields, view), fields)  # (the other buffer is posted)
            works[turn] = self._irecv(frame, FRAME_TAG)
        else:  # a header only: posted again before the parts that follow it are received
            works[turn] = self._irecv(frame, FRAME_TAG)
            if not keepalive:
                self._deliver(destination, self._spilled(fields, marker, extra), fields)

    def _deliver(self, destination: int, message: Message, fields: list[int]) -> None:
        for each in frames.unbundle(message, fields):
            self.wire.deliver(destination, each)

    def _inline(self, fields: list[int], frame: np.ndarray) -> Message:
        marker, extra = fields[0], fields[6]
        if marker == frames.CONTROL or marker not in self.signatures:  # the bytes say what the tensors are
            blob = frames.frame_bytes(frame, extra)
            if marker == frames.CONTROL:
                pickled, metas = frames.control_metas(blob)
                return frames.decode_control(pickled, metas, frames.frame_tensors(frame, extra, metas))
            self.signatures[marker] = frames.decode_signature(blob)  # the signature's first message
        known = self.signatures[marker]
        return frames.message_of(known, fields, frames.frame_tensors(frame, extra, known.metas))

    def _spilled(self, fields: list[int], marker: int, extra: int) -> Message:
        blob = self._receive_bytes(extra, SPILL_TAG)
        if marker == frames.CONTROL:
            pickled, metas = frames.control_metas(blob)
            return frames.decode_control(pickled, metas, self._receive_all(metas, SPILL_TAG))
        if blob:
            self.signatures[marker] = frames.decode_signature(blob)
        signature = self.signatures[marker]
        metas, tag = list(signature.metas), body_tag(marker)
        posted = self.ahead.pop(marker, None)
        tensors, works = posted if posted is not None else self._post(metas, tag)
        self._complete(works)
        if ahead_of_time(signature):
            self.ahead[marker] = self._post(metas, tag)
        return frames.message_of(signature, fields, tensors)

    # ordered (NCCL)
    def _ordered(self) -> None:
        device = self.wire.device
        while True:
            head = torch.empty(frames.HEADER_FIELDS, dtype=torch.int64, device=device)
            self._complete([self._irecv(head, 0)])
            fields = head.tolist()
            marker, destination, extra = fields[0], fields[1], fields[6]
            if marker == frames.CLOSE:
                self._closed()
                return
            if marker == frames.KEEPALIVE:
                continue
            blob = self._receive_bytes(extra, 0)
            if marker == frames.CONTROL:
                pickled, metas = frames.control_metas(blob)
                message = frames.decode_control(pickled, metas, self._receive_all(metas, 0))
            else:
                if blob:
                    self.signatures[marker] = frames.decode_signature(blob)
                signature = self.signatures[marker]
                message = frames.message_of(signature, fields, self._receive_all(list(signature.metas), 0))
            for each in frames.unbundle(message, fields):
                self.wire.deliver(destination, each)

    # receives
    def _closed(self) -> None:
        for _, works in self.ahead.values():  # the peer fills them with dummies on close
            self._complete(works)
        self._end()
        self.wire.peer_closed(self.peer)

    def _receive_bytes(self, count: int, tag: int) -> bytes:
        if count == 0:
            return b""
        buffer = torch.empty(count, dtype=torch.uint8, device=self.wire.device)
        self._complete([self._irecv(buffer, tag)])
        return bytes(buffer.cpu().numpy())

    def _receive_all(self, metas: list[frames.TensorHeader], tag: int) -> list[torch.Tensor]:
        tensors, works = self._post(metas, tag)
        self._complete(works)
        return tensors

    def _post(self, metas: list[frames.TensorHeader], tag: int) -> tuple[list[torch.Tensor], list[Any]]:
        """Post the receives of a body: its tensors (empty ones are not sent) and their works."""
        tensors = [meta.empty(self.wire.device) for meta in metas]
        return tensors, [self._irecv(t, tag) for t in tensors if t.numel() > 0]

    def _irecv(self, tensor: torch.Tensor, tag: int) -> Any:
        """The process group's own receive (what ``dist.irecv`` calls after checks that hold for a wire's group)."""
        tensor = torch.view_as_real(tensor) if tensor.is_complex() else tensor  # the same memory
        if self.wire.device.type != "cuda":
            return self.group.recv([tensor], self.src, tag)
        with self.wire.on_stream(None):
            return self.group.recv([tensor], self.src, tag)

    def _complete(self, works: list[Any]) -> None:
        if self.wire.device.type != "cuda":
            for work in works:
                if work is not None:
                    work.wait(self.patience)
            return
        with self.wire.on_stream(None):
            for work in works:
                if work is not None:
                    work.wait(self.patience)
            torch.cuda.current_stream().synchronize()  # ready for the stage's stream, whichever it is


def first_line(exc: BaseException) -> str:
    """What a failed send or receive says, in one line (a peer's process that ended, said plainly)."""
    text = str(exc)
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return "its process ended (connection closed by peer)"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
