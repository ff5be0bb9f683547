"""`SocketGroup`: a gloo group's point to point calls, over one TCP connection per pair of processes on one machine.

A `Wire` sends and receives through two calls of its group, ``send`` and ``recv`` of tensors by peer and tag. gloo's
pay for a rendezvous (a posted receive is announced to the sender, which sends only then) and for gloo's loop thread,
which takes each message off the socket and wakes the thread that waits; a stream read by the thread that waits does
neither (`benchmarks/link_latency.py`, docs/overhead.md). `SocketGroup` keeps gloo's matching: each message goes
with its tag and length, a receive takes the oldest message of its tag (posted ahead or not), and may be larger
than what it receives. Only CPU tensors; used where two processes of one machine share a link (`pair_on_loopback`).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import socket
import struct
import threading
import time
from collections import defaultdict, deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("lightning_pipe")
_HEADER = struct.Struct("=qq")  # tag, bytes
_HELLO = 16  # bytes of the token each side proves itself with


class SocketGroup:
    """``send`` and ``recv`` of a process group (ranks 0 and 1: this process is ``rank``) over ``sock``."""

    def __init__(self, sock: socket.socket, rank: int, timeout: float) -> None:
        self.rank = rank
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        self._sock = sock
        self._timeout = timeout
        self._sending = threading.Lock()
        self._reading = threading.Lock()  # one reader of the stream at a time
        self._matching = threading.Lock()  # the posted receives and the messages that came before theirs
        self._posted: dict[int, deque[_Receive]] = defaultdict(deque)
        self._early: dict[int, deque[bytearray]] = defaultdict(deque)
        self._header = memoryview(bytearray(_HEADER.size))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Sent:
        (tensor,) = tensors
        data = _bytes_of(tensor)
        with self._sending:
            self._sock.sendall(_HEADER.pack(tag, len(data)))
            if len(data):
                self._sock.sendall(data)
        return _SENT

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Receive:
        (tensor,) = tensors
        work = _Receive(self, _bytes_of(tensor))
        with self._matching:
            early = self._early[tag]
            if early:
                work.fill(early.popleft())
            else:
                self._posted[tag].append(work)
        return work

    def abort(self) -> None:
        """End the connection both ways (its peer is lost): a thread blocked reading it wakes with an error at once,
        which a gloo wait cannot (it lasts until its timeout). The socket stays open until `close`."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already shut down, or the peer's close came first
            pass

    def close(self) -> None:
        self.abort()
        self._sock.close()

    def _until(self, work: _Receive, timeout: timedelta | None) -> None:
        """Read the stream until ``work`` is filled (by this thread or another reader); each read waits at most
        ``timeout`` (default: the group's)."""
        seconds = timeout.total_seconds() if timeout is not None else self._timeout
        while not work.done:
            with self._reading:
                if work.done:
                    return
                if seconds != self._sock.gettimeout():
                    self._sock.settimeout(seconds)
                self._read_one()

    def _read_one(self) -> None:
        self._read_into(self._header)  # one reader at a time: one header buffer
        tag, size = _HEADER.unpack(self._header)
        with self._matching:
            posted = self._posted[tag]
            target = posted.popleft() if posted else None
            if target is None:  # its receive is not posted yet: kept for it (gloo holds it at the sender)
                data = bytearray(size)
                self._read_into(memoryview(data))
                self._early[tag].append(data)
                return
        if size > len(target.view):
            raise RuntimeError(f"a message of {size} bytes for a receive of {len(target.view)} (tag {tag})")
        self._read_into(target.view[:size])
        target.done = True

    def _read_into(self, view: memoryview) -> None:
        try:
            _receive_into(self._sock, view)
        except TimeoutError:
            waited = self._sock.gettimeout() or 0.0
            raise RuntimeError(f"timed out after {waited:.1f} s waiting for the peer's message") from None


class _Sent:
    """A send's work: `SocketGroup.send` returns once the bytes are handed to the socket."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_SENT = _Sent()


class _Receive:
    """A receive's work: filled by whichever thread reads its message off the stream."""

    def __init__(self, group: SocketGroup, view: memoryview) -> None:
        self.group, self.view, self.done = group, view, False

    def fill(self, data: bytearray) -> None:
        if len(data) > len(self.view):
            raise RuntimeError(f"a message of {len(data)} bytes for a receive of {len(self.view)}")
        self.view[: len(data)] = data
        self.done = True

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.group._until(self, timeout)
        return True

    def is_completed(self) -> bool:
        return self.done


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (the same memory)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("a socket link carries contiguous CPU tensors")
    if tensor.numel() == 0:
        return memoryview(b"")
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array)


def pair_on_loopback(store: Any, prefix: str, me: int, timeout: float) -> socket.socket | None:
    """A TCP connection on 127.0.0.1 between processes 0 and 1 of ``store``'s world (both call it), or None for both
    where they cannot reach each other there (other machines, other network namespaces).

    Process 0 listens and publishes its port and a token; process 1 connects and answers with the token and one of
    its own, which process 0 sends back: each knows the other is its peer. Process 1 publishes the outcome.
    """
    key = f"{prefix}-socket"
    wait = min(timeout, 10.0)
    if me == 0:
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(0.1)
        token = secrets.token_bytes(_HELLO)
        store.set(f"{key}-port", str(server.getsockname()[1]))
        store.set(f"{key}-token", token.hex())
        peer: socket.socket | None = None
        until = time.monotonic() + timeout
        try:
            while True:
                if time.monotonic() > until:
                    raise RuntimeError(f"process 1 of the data plane did not connect within {timeout:.0f} s")
                if peer is None:
                    try:
                        candidate, _ = server.accept()
                    except TimeoutError:
                        candidate = None
                    if candidate is not None:
                        peer = _greet_from_listener(candidate, token, wait)
                if _outcome(store, key) is not None:
                    break
        finally:
            server.close()
        if _outcome(store, key) == "yes" and peer is not None:
            return peer
        if peer is not None:
            peer.close()
        return None
    store.wait([f"{key}-port", f"{key}-token"], timedelta(seconds=timeout))
    port, token = int(store.get(f"{key}-port")), bytes.fromhex(store.get(f"{key}-token").decode())
    sock = None
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=wait)
        sock.settimeout(wait)
        mine = secrets.token_bytes(_HELLO)
        sock.sendall(token + mine)
        echoed = _read_exact(sock, _HELLO)
        ok = echoed == mine
    except OSError:
        ok = False
    store.set(f"{key}-outcome", "yes" if ok else "no")
    if ok:
        return sock
    if sock is not None:
        sock.close()
    log.info("lightning_pipe: the two processes of a link cannot reach each other on 127.0.0.1; it runs on gloo")
    return None


def _greet_from_listener(sock: socket.socket, token: bytes, wait: float) -> socket.socket | None:
    try:
        sock.settimeout(wait)
        hello = _read_exact(sock, 2 * _HELLO)
        if hello[:_HELLO] != token:
            sock.close()
            return None
        sock.sendall(hello[_HELLO:])
        return sock
    except OSError:
        sock.close()
        return None


def _outcome(store: Any, key: str) -> str | None:
    if not store.check([f"{key}-outcome"]):
        return None
    return str(store.get(f"{key}-outcome").decode())


def _read_exact(sock: socket.socket, count: int) -> bytes:
    data = bytearray(count)
    _receive_into(sock, memoryview(data))
    return bytes(data)


def _receive_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; the peer's close raises."""
    got = 0
    while got < len(view):
        count = sock.recv_into(view[got:])
        if count == 0:
            raise ConnectionError("connection closed by peer")
        got += count


_PAIRINGS = itertools.count()


def pipeline_socket(ranks: list[int], timeout: float = 60.0) -> SocketGroup | None:
    """The connection of this process's pipeline of two processes (global ``ranks`` of the default group, both call it
    at once), or None where they cannot reach each other on 127.0.0.1. The handshake goes over the default group's
    store (a launch's rendezvous store)."""
    from torch.distributed.distributed_c10d import _get_default_store  # the store the launch made, no public getter

    me = ranks.index(dist.get_rank())
    # every process makes its groups in the same order: the n-th pairing has the same keys in both
    store = dist.PrefixStore(
        f"lightning_pipe-socket-{next(_PAIRINGS)}-{'-'.join(map(str, ranks))}", _get_default_store()
    )
    sock = pair_on_loopback(store, "pipeline", me, timeout)
    return SocketGroup(sock, me, timeout) if sock is not None else None
