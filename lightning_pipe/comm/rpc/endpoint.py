"""A participant of an RPC world: an inbox that keeps each sender's order, and sends over the data plane or RPC.

Every message to another process crosses the world's data plane (`rpc.plane`, point to point): activations,
outputs and gradients, and the control messages (steps, calls, replies, a stage's end), each pair of processes
over one link, so each sender's order holds. Its reader decompresses the tensors (`compress`) and puts the
message into the receiver's inbox, the stage's own thread where it reads its link itself (`p2p.direct`). Without
a data plane a message is one ``rpc_async`` call of `deliver`, which the `OrderedInbox` puts in the sender's order.
Messages between endpoints of one process (the coordinator and the rank its process holds, `rpc.home`) go
straight into the receiver's inbox, by reference: nothing is pickled, compressed or counted as sent.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed.rpc as rpc

from lightning_pipe.base import tree
from lightning_pipe.comm.base import COORDINATOR, Endpoint, Message, MessageKind, QueueInbox
from lightning_pipe.comm.by_value import ByValue
from lightning_pipe.comm.compress import Codec, decode_payload, encode_payload, wire_bytes
from lightning_pipe.comm.p2p import direct
from lightning_pipe.comm.p2p.direct import DirectLink
from lightning_pipe.comm.p2p.wire import LOST
from lightning_pipe.comm.rpc.plane import DataPlane, address

_CONTROL = (MessageKind.STEP, MessageKind.CALL, MessageKind.POST)  # the coordinator's control messages to stages
_TENSORS = (MessageKind.ACTIVATION, MessageKind.OUTPUT, MessageKind.GRAD, MessageKind.INPUT_GRAD)  # compressed
_COPIED = (MessageKind.CALL, MessageKind.POST, MessageKind.REPLY)  # their tensors are copied within a process
_INBOXES: dict[tuple[str, int], OrderedInbox] = {}  # the inboxes of this process, by (launch, rank)


class OrderedInbox(QueueInbox):
    """An inbox that puts each sender's messages in the order they were sent.

    RPC handlers run on a thread pool, so two messages of one sender may be handled out of order;
    a sequence number per sender restores it (the engine relies on STEP arriving before ABORT).
    ``decode`` (decompression) runs in the handler's thread before the message takes its place.
    """

    def __init__(self, decode: Callable[[Message], Message] | None = None) -> None:
        super().__init__()
        self.decode = decode
        #: a stage that reads the data plane's link itself (`p2p.direct`): what is put in wakes it from that wait
        self.waking: DirectLink | None = None
        self._order = threading.Lock()
        self._next: dict[int, int] = defaultdict(int)
        self._early: dict[int, dict[int, Message]] = defaultdict(dict)

    def put(self, message: Message) -> None:
        if self.waking is None:
            super().put(message)
        else:
            direct.put_waking(self, self.waking.baton, self.waking.wake, message)

    def receive(self, source: int, seq: int, message: Message) -> None:
        """Decode ``message`` (in the calling I/O thread, in parallel with others) and put it in order."""
        self.put_in_order(source, seq, self.decode(message) if self.decode is not None else message)

    def put_in_order(self, source: int, seq: int, message: Message) -> None:
        with self._order:
            if seq != self._next[source]:
                self._early[source][seq] = message
                return
            self.put(message)
            self._next[source] += 1
            early = self._early[source]
            while self._next[source] in early:
                self.put(early.pop(self._next[source]))
                self._next[source] += 1


@dataclass
class TransportStats:
    """What one endpoint sent: messages and tensor bytes by message kind (and its compression's work)."""

    messages: Counter[str] = field(default_factory=Counter)
    tensor_bytes: Counter[str] = field(default_factory=Counter)
    #: the same tensors' bytes as sent: after compression (`compress`), equal to tensor_bytes without it
    wire_bytes: Counter[str] = field(default_factory=Counter)
    parameter_tensors: int = 0  # tensors that were (views of) this process's parameters
    #: bytes of tensors on a device (CUDA) that crossed through host memory: over gloo or RPC, not device to device
    host_bytes: Counter[str] = field(default_factory=Counter)
    #: messages handed by reference to an endpoint of the same process (the coordinator and the rank it holds)
    local: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    encode_seconds: float = 0.0  # compressing what it sent
    decode_seconds: float = 0.0  # decompressing what it received (in its I/O threads)

    def total_bytes(self) -> int:
        return sum(self.tensor_bytes.values())

    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())


class _Arrivals(QueueInbox):
    """What the data plane delivers into: each message decoded (in the receiving thread), then put into ``inbox``."""

    def __init__(self, inbox: QueueInbox, decode: Callable[[Message], Message]) -> None:
        super().__init__()
        self.inbox = inbox
        self.decode = decode

    def put(self, message: Message) -> None:
        self.inbox.put(self.decode(message))


class RpcEndpoint(Endpoint):
    """One participant: an ordered inbox filled by the data plane (or RPC); the plane (or ``rpc_async``) to the rest.

    With a ``plane`` the endpoint's inbox is attached to it until `close`. ``processes`` gives the world rank of
    every pipeline rank and of the coordinator (`rpc.home.RankProcesses.processes`); endpoints of one process hand
    their messages over by reference.
    """

    def __init__(
        self,
        rank: int,
        launch: str,
        names: dict[int, str],
        hosts: dict[int, str],
        codec: Codec | None = None,
        plane: DataPlane | None = None,
        processes: dict[int, int] | None = None,
    ) -> None:
        self.rank = rank
        self.launch = launch
        self.names = names
        self.hosts = hosts
        self.codec = codec  # compresses the tensors of activation and gradient messages, both ways
        self.plane = plane
        self.processes = dict(processes or {})
        self.bundles = plane is not None  # a step's later inputs go as one message (one frame)
        self.inbox = OrderedInbox(self._decode if codec is not None else None)
        self.stats = TransportStats()
        self._seq: dict[int, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._watched: set[int] = set()
        #: a stage's endpoint on a plane of two processes reads the plane's link itself while its inbox is empty
        self.direct = plane.direct if plane is not None and rank != COORDINATOR else None
        self.inbox.waking = self.direct
        if plane is not None:
            arrivals = self.inbox if codec is None else _Arrivals(self.inbox, self._decode)
            plane.attach(address(launch, rank), arrivals)

    def close(self) -> None:
        """Detach the inbox from the data plane: what still arrives for this endpoint is dropped."""
        if self.plane is not None:
            self.plane.detach(address(self.launch, self.rank))

    def watch(self, tensors: Iterator[torch.Tensor]) -> None:
        """Count sends of these tensors' storages (a stage's parameters) in ``stats.parameter_tensors``."""
        self._watched |= {t.untyped_storage().data_ptr() for t in tensors}

    def send(self, rank: int, message: Message) -> None:
        if self._here(rank):
            self._hand_over(rank, message)
            return
        if self.plane is not None:  # every message, in the order sent: one link per pair of processes
            self._send_on_plane(rank, [message])
            return
        payload, nbytes = self._account(message)
        if message.kind in _CONTROL:  # the user's objects (an optimizer class, a traced call's code) go by value
            payload = ByValue(payload)
        elif self.codec is not None and message.kind in _TENSORS:
            payload, nbytes = self._encode(payload)
        self.stats.wire_bytes[message.kind] += nbytes
        message = replace(message, source=self.rank, payload=payload)
        with self._lock:
            seq = self._seq[rank]
            self._seq[rank] += 1
        try:
            future = rpc.rpc_async(self.names[rank], deliver, args=(self.launch, rank, self.rank, seq, message))
        except Exception as exc:  # the agent is gone or the peer unknown: check_alive reports it
            self._failed(rank, exc)
            return
        future.add_done_callback(lambda f: self._delivered(rank, f))

    def send_many(self, rank: int, messages: list[Message]) -> None:
        if self.plane is not None and messages and messages[0].kind in _TENSORS and not self._here(rank):
            self._send_on_plane(rank, messages)
        else:
            super().send_many(rank, messages)

    def recv(self, timeout: float | None) -> Message | None:
        if self.direct is not None:
            message = direct.receive(self.inbox, self.direct.baton, self.direct.pump, timeout)
        else:
            message = self.inbox.get(timeout)
        # the data plane lost a peer: the waiting caller checks the communicator (which names the worker)
        return None if message is not None and message.kind == LOST else message

    def host(self, rank: int) -> str:
        return self.hosts.get(rank, "?")

    def process(self, rank: int) -> int:
        """The world rank of the process that holds pipeline rank ``rank`` (``COORDINATOR``: -1)."""
        return self.processes[rank]

    def _here(self, rank: int) -> bool:
        """Whether ``rank`` is another endpoint of this process (a rank's messages to itself take the plane's
        route to its own process, which passes them by reference too)."""
        return rank != self.rank and self.process(rank) == self.process(self.rank)

    def _hand_over(self, rank: int, message: Message) -> None:
        """Put ``message`` into the inbox of ``rank`` in this process, by reference (in the sender's order).

        The tensors of control calls and their replies are copied, as they would be between processes: a
        checkpoint's state or an optimizer state loaded into the stage must not alias the stage's own tensors.
        """
        inbox = _INBOXES.get((self.launch, rank))
        self.stats.local[message.kind] += 1
        payload = message.payload
        if message.kind in _COPIED:
            payload = tree.map_tensors(lambda t: t.detach().clone(), payload)
        if inbox is not None:  # else: a stage that has already stopped
            inbox.put(replace(message, source=self.rank, payload=payload))

    def _decode(self, message: Message) -> Message:
        if message.kind not in _TENSORS:
            return message
        assert self.codec is not None
        start = time.perf_counter()
        message = replace(message, payload=decode_payload(self.codec, message.payload))
        with self._lock:  # several I/O threads decode at once
            self.stats.decode_seconds += time.perf_counter() - start
        return message

    def _send_on_plane(self, rank: int, messages: list[Message]) -> None:
        """Messages of one kind over the data plane (several: one bundle of tensor messages).

        Tensor messages go the plane's fastest way (NCCL between GPUs of their own) and through the codec;
        control messages over its gloo link, their tensors on the CPU as RPC delivered them, the payload pickled
        by value (the user's objects: an optimizer class, a traced call's code).
        """
        assert self.plane is not None
        process = self.process(rank)
        tensors = messages[0].kind in _TENSORS
        through_host = self.plane.through_host(process) if tensors else True
        portable = self.codec is not None or not tensors
        ready = []
        for message in messages:
            # the wire copies what it sends (or keeps it until sent); a codec needs the tensors on the CPU
            payload, nbytes = self._account(message, portable=portable, through_host=through_host)
            if self.codec is not None and tensors:
                payload, nbytes = self._encode(payload)
            self.stats.wire_bytes[message.kind] += nbytes
            ready.append(replace(message, source=self.rank, payload=payload))
        self.plane.send(process, address(self.launch, rank), ready, control=not tensors)

    def _encode(self, payload: Any) -> tuple[Any, int]:
        assert self.codec is not None
        start = time.perf_counter()
        payload = encode_payload(self.codec, payload)
        self.stats.encode_seconds += time.perf_counter() - start
        return payload, wire_bytes(payload)

    def _account(self, message: Message, portable: bool = True, through_host: bool = True) -> tuple[Any, int]:
        """Count the payload's tensors and their bytes; ``portable``: make them detached, on the CPU, compact."""
        nbytes = 0
        kind = message.kind

        def count(t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes
            if t.untyped_storage().data_ptr() in self._watched and t.numel() > 0:
                self.stats.parameter_tensors += 1
            size = t.numel() * t.element_size()
            nbytes += size
            t = t.detach()
            if t.device.type != "cpu" and (portable or through_host):
                self.stats.host_bytes[kind] += size
            if not portable:
                return t
            if t.device.type != "cpu":
                t = t.cpu()
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                t = t.clone()  # a view would drag its whole storage along
            return t

        payload = tree.map_tensors(count, message.payload)
        self.stats.messages[kind] += 1
        self.stats.tensor_bytes[kind] += nbytes
        return payload, nbytes

    def _delivered(self, rank: int, future: Any) -> None:
        try:
            future.value()
        except Exception as exc:
            self._failed(rank, exc)

    def _failed(self, rank: int, exc: BaseException) -> None:
        text = str(exc).strip().splitlines()
        self.stats.failures.append(f"rank {rank}: {text[0] if text else type(exc).__name__}")


def register_inbox(launch: str, rank: int, inbox: OrderedInbox | None) -> OrderedInbox | None:
    """Make ``inbox`` receive the messages for ``rank`` of ``launch`` (None removes it); returns the previous one."""
    previous = _INBOXES.pop((launch, rank), None)
    if inbox is not None:
        _INBOXES[(launch, rank)] = inbox
    return previous


def deliver(launch: str, rank: int, source: int, seq: int, message: Message) -> None:
    """Runs in the receiving process (called through RPC): put ``message`` into the inbox of ``rank``."""
    inbox = _INBOXES.get((launch, rank))
    if inbox is not None:  # else: a message of a pipeline that has already stopped
        inbox.receive(source, seq, message)
