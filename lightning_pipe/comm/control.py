"""The control channel: handshake, rank assignment and liveness between the coordinator and workers.

JSON lines over a plain TCP connection, apart from RPC: a worker proves it belongs to this run (shared token,
matching versions) before any pickled message, and the open connection is the liveness signal (a dead
worker's socket closes at once)::

    worker                                coordinator
      | -- hello {token, versions, device} -> |   refused {reason} and closed, or
      | <- welcome --------------------------- |
      | <- assign {rank, world, store} ------- |   once enough slots joined
      | -- heartbeat (every 2 s) ------------> |   ... until the run ends
"""

from __future__ import annotations

import hmac
import importlib
import json
import platform
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pipe.base.errors import PipeTimeoutError, TransportError

PROTOCOL = 1
HEARTBEAT = 2.0  # seconds between a worker's heartbeats
HELLO_TIMEOUT = 10.0  # seconds a new connection has to say hello
MAX_LINE = 1 << 16  # a control message is small; longer lines are refused


def versions() -> dict[str, str]:
    """What must match between the coordinator and its workers for pickled messages to make sense."""
    package = importlib.import_module("lightning_pipe")
    return {
        "protocol": str(PROTOCOL),
        "lightning_pipe": str(getattr(package, "__version__", "unknown")),
        "torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
        "python": platform.python_version().rsplit(".", 1)[0],
    }


def parse_address(address: str, default_port: int | None = None) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"[v6]:PORT"``) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        if default_port is None:
            raise TransportError(f"coordinator address {address!r} has no port; write it as HOST:PORT")
        return address, default_port
    try:
        return host.strip("[]") or "127.0.0.1", int(port)
    except ValueError:
        raise TransportError(f"coordinator address {address!r}: the port must be a number (HOST:PORT)") from None


def send_line(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


class LineBuffer:
    """Collects bytes from a socket and cuts them into JSON messages."""

    def __init__(self) -> None:
        self._data = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._data += data
        if len(self._data) > MAX_LINE and b"\n" not in self._data:
            raise ValueError(f"a control message longer than {MAX_LINE} bytes")
        *lines, self._data = self._data.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


@dataclass
class Slot:
    """One stage slot offered by a worker process (one device)."""

    conn: socket.socket
    address: str
    host: str
    pid: int
    device: str
    group: str  # the machine and launcher it belongs to; slots of one group get consecutive ranks
    index: int
    joined: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    rank: int | None = None
    gone: str | None = None  # why the connection ended, once it did
    released: bool = False

    def where(self) -> str:
        return f"{self.host} ({self.address}, pid {self.pid})"


class ControlServer:
    """The coordinator's side: accepts workers, checks them, assigns ranks and watches them live.

    One I/O thread serves every connection with a selector; the coordinator's thread waits on a
    condition for enough slots and reads the slots' state in `check_alive`.
    """

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host = host
        self.token = token
        self._versions = versions()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._buffers: dict[socket.socket, LineBuffer] = {}
        self._new: dict[socket.socket, tuple[float, str]] = {}  # connected, no hello yet
        self._slots: dict[socket.socket, Slot] = {}
        self.refused: list[str] = []
        self._closed_for_joins: str | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lightning_pipe-control", daemon=True)
        self._thread.start()

    # the coordinator's thread
    def wait_for(self, count: int, until: float, check: Callable[[], None]) -> list[Slot]:
        """Block until ``count`` slots joined (or raise at ``until``); ``check`` runs every half second."""
        while True:
            with self._cond:
                ready = self.slots()
                if len(ready) >= count:
                    return ready
                left = until - time.monotonic()
                if left <= 0:
                    raise PipeTimeoutError(self._join_timeout_message(count, ready))
                self._cond.wait(min(0.5, left))
            check()

    def slots(self) -> list[Slot]:
        """Joined slots still connected, machine by machine, in the order machines joined."""
        alive = [s for s in self._slots.values() if s.gone is None and not s.released]
        first: dict[str, float] = {}
        for slot in sorted(alive, key=lambda s: s.joined):
            first.setdefault(slot.group, slot.joined)
        return sorted(alive, key=lambda s: (first[s.group], s.group, s.index))

    def assign(self, used: list[Slot], unused: list[Slot], world: dict[str, Any]) -> None:
        """Give each used slot its rank and the RPC world's address; release the others (also those that joined
        since ``used`` was chosen)."""
        with self._cond:
            self._closed_for_joins = "its pipeline is already running"
            chosen = {id(slot) for slot in [*used, *unused]}
            late = [slot for slot in self.slots() if id(slot) not in chosen]
        for rank, slot in enumerate(used):
            slot.rank = rank
            self._send(slot, {"type": "assign", "rank": rank, **world})
        for slot in [*unused, *late]:
            slot.released = True
            self._send(slot, {"type": "release", "reason": "the pipeline has enough stage slots"})

    def lost(self, heartbeat_timeout: float) -> list[tuple[Slot, str]]:
        """Assigned slots whose connection closed or went silent, with the reason."""
        now = time.monotonic()
        out = []
        for slot in list(self._slots.values()):
            if slot.rank is None:
                continue
            if slot.gone is not None:
                out.append((slot, slot.gone))
            elif now - slot.last_seen > heartbeat_timeout:
                out.append((slot, f"no heartbeat for {now - slot.last_seen:.0f} s"))
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for conn in list(self._buffers):
            close_socket(conn)
        self._listener.close()
        self._selector.close()

    def _send(self, slot: Slot, message: dict[str, Any]) -> None:
        try:
            send_line(slot.conn, message)
        except OSError as exc:
            slot.gone = slot.gone or f"the control connection failed ({exc})"

    def _join_timeout_message(self, count: int, ready: list[Slot]) -> str:
        where = f"{self.host}:{self.port}"
        text = (
            f"only {len(ready)} of {count} stage slots joined the coordinator at {where} within the timeout; "
            f"start `lightning-pipe worker --coordinator {where} --token ...` on the worker machines "
            "(one slot per device) or raise timeout=..."
        )
        if ready:
            text += "; joined: " + ", ".join(f"{s.device} on {s.where()}" for s in ready)
        if self.refused:
            text += "; refused: " + "; ".join(self.refused)
        return text

    # the I/O thread
    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                else:
                    self._read(sock)
            now = time.monotonic()
            for conn, (since, address) in list(self._new.items()):
                if now - since > HELLO_TIMEOUT:
                    self._refuse(conn, address, f"no hello within {HELLO_TIMEOUT:.0f} s")

    def _accept(self) -> None:
        try:
            conn, peer = self._listener.accept()
        except OSError:
            return
        conn.setblocking(True)
        conn.settimeout(5.0)  # sends only; reads go through the selector
        self._buffers[conn] = LineBuffer()
        self._new[conn] = (time.monotonic(), str(peer[0]))
        self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
            messages = self._buffers[conn].feed(data) if data else None
        except (OSError, ValueError) as exc:
            data, messages = b"", None
            reason = f"the control connection failed ({exc})"
        else:
            reason = "the worker process ended or its connection closed"
        if not data or messages is None:
            self._drop(conn, reason)
            return
        for message in messages:
            self._handle(conn, message)

    def _handle(self, conn: socket.socket, message: dict[str, Any]) -> None:
        slot = self._slots.get(conn)
        if slot is None:
            self._hello(conn, message)
            return
        slot.last_seen = time.monotonic()
        if message.get("type") == "failed":
            slot.gone = f"the worker reported: {message.get('error', 'an error')}"

    def _hello(self, conn: socket.socket, message: dict[str, Any]) -> None:
        _, address = self._new.pop(conn, (0.0, "?"))
        host = str(message.get("host", "?"))
        who = f"{host} ({address}, pid {message.get('pid', '?')})"
        if message.get("type") != "hello":
            self._refuse(conn, address, f"{who} did not start with a hello")
            return
        if not hmac.compare_digest(str(message.get("token", "")).encode(), self.token.encode()):
            self._refuse(conn, address, f"{who} presented a wrong token (a worker of another run?)")
            return
        theirs = message.get("versions", {})
        mismatched = [f"{k} {theirs.get(k)} != {v}" for k, v in self._versions.items() if theirs.get(k) != v]
        if mismatched:
            self._refuse(conn, address, f"{who} runs other versions ({', '.join(mismatched)})")
            return
        with self._cond:
            if self._closed_for_joins:
                self._refuse(conn, address, f"{who} came late: {self._closed_for_joins}")
                return
            slot = Slot(
                conn, address, host, int(message.get("pid", 0)), str(message.get("device", "cpu")),
                str(message.get("group", address)), int(message.get("index", 0)),
            )  # fmt: skip
            self._slots[conn] = slot
            self._send(slot, {"type": "welcome"})
            self._cond.notify_all()

    def _refuse(self, conn: socket.socket, address: str, reason: str) -> None:
        self._new.pop(conn, None)
        self.refused.append(reason)
        try:
            send_line(conn, {"type": "refused", "reason": f"the coordinator refused this worker: {reason}"})
        except OSError:
            pass
        self._drop(conn, reason)

    def _drop(self, conn: socket.socket, reason: str) -> None:
        self._new.pop(conn, None)
        slot = self._slots.get(conn)
        if slot is not None and slot.gone is None:
            slot.gone = reason
        self._buffers.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        close_socket(conn)
        with self._cond:
            self._cond.notify_all()


def close_socket(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (waking a reader blocked on it) and close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (Linux), or None when it can't be told."""
    if address in ("127.0.0.1", "localhost"):
        return "lo" if sys.platform.startswith("linux") else None
    try:
        import fcntl
        import struct

        wanted = socket.gethostbyname(address)
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == wanted:
                    return name
        finally:
            probe.close()
    except (ImportError, OSError):
        return None
    return None
