"""The links of one process of a pipeline to its peers, over torch.distributed point-to-point sends.

A send posts its frame's ``isend``s from the sending thread, under the link's lock, and returns: transfers
overlap the next computation and each link keeps its order. Each peer gets a receiving thread (`p2p.receive`)
that puts messages into the inbox of their destination endpoint; messages between endpoints of this process go
straight into the inbox, by reference. A broken link marks the peer lost (`TransportError` from every
endpoint's next ``recv``); idle links get keep-alives; `close` sends a close frame on every link and joins the
threads, and an ``atexit`` hook closes every wire still open, so no thread is left blocked in gloo's ``wait``
at exit (docs/internals.md).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.base.errors import TransportError
from lightning_pipe.comm.base import COORDINATOR, Message, QueueInbox, deadline, remaining
from lightning_pipe.comm.p2p import frames
from lightning_pipe.comm.p2p.direct import LOOK, Baton, DirectLink, WakingInbox
from lightning_pipe.comm.p2p.receive import Receiver, first_line
from lightning_pipe.comm.p2p.send import Link, Sender, WireStats
from lightning_pipe.comm.p2p.socket_group import SocketGroup
from lightning_pipe.comm.process_device import group_ranks_of, process_device

WIRE = -2  # the endpoint id of a process's own control inbox (builds, releases, notices)
LOST = "p2p-lost"  # wakes a waiting endpoint: a peer is gone
STATS = "p2p-stats"  # asks a process for its statistics, answered by its receiver thread
STATS_REPLY = "p2p-stats-reply"
CRASHED = "p2p-crashed"  # a serving process's stage loop broke: the receiving process counts it as lost
EXIT_CLOSE_TIMEOUT = 10.0  # seconds the exit hook waits for the peers of a wire still open


class Wire:
    """This process's links to the other processes of one pipeline (``ranks`` in pipeline order), or of an RPC
    world's data plane (`rpc.plane`, over groups made apart from the default one: ``group_ranks`` and ``backend``)."""

    def __init__(
        self,
        group: Any,
        ranks: Sequence[int],
        me: int,
        describe: Callable[[int], str],
        timeout: float,
        coordinator: int = 0,
        group_ranks: Sequence[int] | None = None,
        backend: str | None = None,
        sends_to: Sequence[int] | None = None,
        hears_from: Sequence[int] | None = None,
        device: str | None = None,
        reverse: Any = None,
        direct: bool = False,
        look: float = LOOK,
    ) -> None:
        group = group if group is not None else dist.group.WORLD  # the default group
        self.group, self.ranks, self.me, self.describe, self.timeout = group, list(ranks), me, describe, timeout
        self.coordinator = coordinator  # the pipeline rank whose process runs the coordinator
        #: each process's rank in ``group``, what its sends and receives name: given for a group made apart from
        #: the default one (the rpc transport's, which torch.distributed does not know), else ``ranks`` translated
        own = isinstance(group, SocketGroup)  # two processes' own connection: framed as gloo, ranks 0 and 1
        if group_ranks is None:
            group_ranks = range(len(self.ranks)) if own else group_ranks_of(group, self.ranks)
        self.group_ranks = list(group_ranks)
        #: ``reverse``: a second group over the same processes that carries the messages to lower pipeline ranks
        #: (``group`` those to higher ones), so a link's two directions never share a gloo pair (one connection,
        #: whose lock the group's I/O thread holds while it reads: a send waited behind the peer's messages)
        downward = (group, self.group_ranks)
        upward = downward
        if reverse is not None:
            upward = (reverse, list(group_ranks) if group_ranks is not None else group_ranks_of(reverse, self.ranks))
        #: per peer, the group and the peer's rank in it that messages to it go out on, and those from it come in on
        self.routes: dict[int, tuple[Any, int]] = {}
        self.sources: dict[int, tuple[Any, int]] = {}
        for peer in range(len(self.ranks)):
            out, back = (downward, upward) if peer > me else (upward, downward)
            self.routes[peer] = (out[0], out[1][peer])
            self.sources[peer] = (back[0], back[1][peer])
        self.backend = backend or ("gloo" if own else str(dist.get_backend(group)))
        #: where its tensors travel: the CPU under gloo; under NCCL ``device``, or the process's current CUDA device
        self.device = process_device(self.backend, device)
        #: gloo matches a receive by (source, tag) and takes a receive larger than its send: messages go as
        #: inline frames into buffers posted ahead (`p2p.receive`); NCCL gets each part of a frame in order
        self.framed = self.backend == "gloo"
        self.keepalive = max(0.05, min(5.0, timeout / 4))
        self.lost: tuple[int, str] | None = None  # the first peer lost (its index in ranks) and why
        self._dead: set[int] = set()  # peers whose link broke
        self._closed: set[int] = set()  # peers that closed their side: nothing more goes to them
        self._inboxes: dict[int, QueueInbox] = {WIRE: QueueInbox()}
        self._stats: dict[int, WireStats] = {}
        self._lock = threading.Lock()
        self._links: dict[int, Link] = {}
        self.sender = Sender(self.routes, self.device, self.framed, timeout, self._count, self._lock)
        self._threads: list[threading.Thread] = []
        self._local = threading.local()  # each thread's CUDA stream for sends and receives
        self._closing = threading.Event()
        _OPEN.add(self)
        others = [peer for peer in range(len(self.ranks)) if peer != me]
        # a link one way only (``sends_to``, ``hears_from``): NCCL runs a pair's sends and receives on one stream,
        # where a receive posted ahead would hold back every send behind it; the rpc transport's NCCL wires go
        # one way each
        for peer in others if sends_to is None else sends_to:
            self._links[peer] = Link()
        hears = others if hears_from is None else list(hears_from)
        #: ``direct``: the one link this process hears from is read by its consumer while it waits (`p2p.direct`)
        #: ``look``: how soon the receiving thread notices the consumer left the link (`p2p.direct.Baton`)
        baton = Baton(look) if direct and self.framed and len(hears) == 1 else None
        self.direct: DirectLink | None = None  # its consumer wakes by a poke of the peer
        for peer in hears:
            receiver = Receiver(self, peer, baton)
            if baton is not None:
                poke = functools.partial(self._control_frame, peer, frames.POKE)
                self.direct = DirectLink(baton, receiver.pump, poke)
            name = f"lightning_pipe-p2p-recv-{self.ranks[peer]}"
            thread = threading.Thread(target=receiver.run, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._links:
            name = f"lightning_pipe-p2p-keepalive-{self.ranks[me]}"
            thread = threading.Thread(target=self._keepalive_loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    # endpoints of this process
    def inbox(self, endpoint: int) -> QueueInbox:
        """The inbox of ``endpoint`` in this process (made on first use)."""
        with self._lock:
            return self._inboxes.setdefault(endpoint, QueueInbox())

    def consumer_inbox(self, endpoint: int) -> QueueInbox:
        """The inbox of ``endpoint``, the one consumer of the wire's one link (`direct`): a message put into it by
        another thread of this process while the consumer waits on the link wakes it (`p2p.direct.WakingInbox`)."""
        if self.direct is None:
            return self.inbox(endpoint)
        with self._lock:
            before = self._inboxes.get(endpoint)
            if isinstance(before, WakingInbox):
                return before
            inbox = self._inboxes[endpoint] = WakingInbox(self.direct.baton, self.direct.wake)
        while before is not None and (message := before.get(0)) is not None:  # what came before it was made
            inbox.put(message)
        return inbox

    def keepalive_to(self, peer: int) -> None:
        """Send ``peer`` a keep-alive now (the answer to its poke), unless a send to it is under way: that send wakes
        it as well, and the reader that calls this must not wait behind a send that waits for this reader (a
        `SocketGroup`'s send blocks until the peer reads, and the peer's reader may be waiting likewise)."""
        self._control_frame(peer, frames.KEEPALIVE, wait=False)

    def _control_frame(self, peer: int, marker: int, wait: bool = True) -> None:
        """A frame without a message (a keep-alive, a poke) to ``peer``, unless its link is gone (or, not ``wait``:
        busy with another send)."""
        link = self._links.get(peer)
        if link is None or peer in self._dead or peer in self._closed:
            return
        if not link.lock.acquire(blocking=wait):
            return
        try:
            if not link.closed:
                self.sender.control(peer, link, marker)
        except Exception as exc:
            self.mark_lost(peer, f"sending failed: {first_line(exc)}")
        finally:
            link.lock.release()

    def attach(self, endpoint: int, inbox: QueueInbox) -> None:
        """Deliver the messages for ``endpoint`` into ``inbox`` (an inbox its owner made)."""
        with self._lock:
            self._inboxes[endpoint] = inbox

    def drop_inbox(self, endpoint: int) -> None:
        with self._lock:
            self._inboxes.pop(endpoint, None)

    def send(self, process: int, destination: int, message: Message, bundled: int = 1) -> None:
        """Deliver ``message`` to endpoint ``destination`` of pipeline rank ``process``; a lost peer's are dropped."""
        if process == self.me:
            stats = self._count(message.source)
            with self._lock:
                stats.local[message.kind] += 1
            self.deliver(destination, message)
        elif process not in self._dead and process not in self._closed:
            link = self._links[process]
            try:
                with link.lock, self.on_stream(self._ready()):
                    if not link.closed:
                        self.sender.message(process, link, destination, message, bundled)
            except Exception as exc:
                self.mark_lost(process, f"sending failed: {first_line(exc)}")

    def send_many(self, process: int, destination: int, messages: list[Message]) -> None:
        """Deliver ``messages`` (tensor messages of one kind, step and stage, of consecutive microbatches) in
        order; to another process as one message (`p2p.frames.bundle`): one frame instead of one each."""
        if process == self.me or len(messages) == 1:
            for message in messages:
                self.send(process, destination, message)
            return
        self.send(process, destination, frames.bundle(messages), bundled=len(messages))

    def is_gone(self, peer: int) -> bool:
        """Whether nothing can reach ``peer`` any more (its link broke or it closed it)."""
        return peer in self._dead or peer in self._closed

    def in_flight(self) -> dict[int, int]:
        """Per peer this process sends to, the sends its link still holds (`p2p.send.Link.reap` bounds them)."""
        return {peer: link.in_flight() for peer, link in self._links.items()}

    def error(self) -> TransportError | None:
        """The error every endpoint raises once a peer is lost."""
        if self.lost is None:
            return None
        peer, reason = self.lost
        return TransportError(f"lost {self.describe(self.ranks[peer])}: {reason}; the pipeline stops")

    def stats(self, reset: bool = False) -> dict[int, WireStats]:
        with self._lock:
            out = copy.deepcopy(self._stats)  # a snapshot: the live counters keep counting
            if reset:
                self._stats = {}
            return out

    def close(self, timeout: float) -> list[str]:
        """Close every link and wait for the peers' close frames; the names of threads still running."""
        until = deadline(timeout)
        self._closing.set()
        for peer, link in self._links.items():
            with link.lock:
                if link.closed:
                    continue
                link.closed = True
                if peer in self._dead:
                    continue
                try:
                    self.sender.close(peer, link)
                    link.drain(remaining(until))
                except Exception as exc:
                    self.mark_lost(peer, f"closing failed: {first_line(exc)}")
        for thread in self._threads:
            thread.join(remaining(until))
        left = [t.name for t in self._threads if t.is_alive()]
        if not left:
            _OPEN.discard(self)
        return left

    def mark_lost(self, peer: int, reason: str) -> None:
        with self._lock:
            if peer in self._dead:
                return
            self._dead.add(peer)
            if self.lost is None:
                self.lost = (peer, reason)
            inboxes = list(self._inboxes.values())
        for group, _ in (self.routes[peer], self.sources[peer]):
            if isinstance(group, SocketGroup):  # a reader of the link (a stage waiting on it) wakes now
                group.abort()
        for inbox in inboxes:  # wake whoever waits
            inbox.put(Message(LOST))

    # delivery
    def peer_closed(self, peer: int) -> None:
        """``peer`` closed its side of the link (its receiving thread saw the close frame)."""
        self._closed.add(peer)

    def deliver(self, destination: int, message: Message) -> None:
        """Put ``message`` into the inbox of endpoint ``destination`` of this process (or answer a notice)."""
        if destination == WIRE and message.kind == STATS:
            process = self.coordinator if message.source == COORDINATOR else message.source
            self.send(process, WIRE, Message(STATS_REPLY, payload=self.stats(message.payload), source=self.me))
            return
        if destination == WIRE and message.kind == CRASHED:
            self.mark_lost(message.source, message.payload)
            return
        inbox = self._inboxes.get(destination)  # one dict read, atomic: no lock on every message
        if inbox is not None:  # else: an endpoint that has already stopped
            inbox.put(message)

    def _count(self, source: int) -> WireStats:
        stats = self._stats.get(source)  # on every send: a new WireStats only for a new source
        if stats is None:
            with self._lock:
                stats = self._stats.setdefault(source, WireStats())
        return stats

    # the keep-alives
    def _keepalive_loop(self) -> None:
        while not self._closing.wait(self.keepalive / 2):
            now = time.monotonic()
            for peer, link in self._links.items():
                if now - link.last_send >= self.keepalive:
                    self._control_frame(peer, frames.KEEPALIVE, wait=False)  # a send under way says as much

    # CUDA ordering (the same code with another device; not exercised on CPU)
    def _ready(self) -> Any:
        """In the sending thread: an event after the work that produced the message's tensors (CUDA only)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the wire's device: the thread's may be another
        return event

    def on_stream(self, ready: Any) -> Any:
        """A dedicated stream of the calling link thread, after ``ready``; nothing on the CPU."""
        if self.device.type != "cuda":
            return _NO_STREAM  # one do-nothing context, not a new one per message
        stream = torch.cuda.Stream(self.device) if not hasattr(self._local, "stream") else self._local.stream
        self._local.stream = stream
        if ready is not None:
            stream.wait_event(ready)
        return torch.cuda.stream(stream)


_NO_STREAM = contextlib.nullcontext()
_OPEN: weakref.WeakSet[Wire] = weakref.WeakSet()  # wires whose threads have not all ended


@atexit.register
def close_open_wires() -> None:
    """Close the wires still open (a run that ended by an error or Ctrl-C) and join their threads before the
    interpreter finalizes: a receiving thread blocked in a gloo wait at exit would abort the process."""
    for wire in list(_OPEN):
        try:
            left = wire.close(EXIT_CLOSE_TIMEOUT)
        except Exception as exc:  # the process is exiting: say what happened, never raise from here
            left = [f"closing failed: {first_line(exc)}"]
        if left:
            print(f"lightning_pipe: p2p threads still waiting for their peers at exit: {', '.join(left)}",
                  file=sys.stderr, flush=True)  # fmt: skip
