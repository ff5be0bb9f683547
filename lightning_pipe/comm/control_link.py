"""`WorkerLink`: a worker's side of the control channel (see `lightning_pipe.comm.control` for the protocol)."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from typing import Any

from lightning_pipe.base.errors import TransportError
from lightning_pipe.comm.control import (
    HEARTBEAT,
    HELLO_TIMEOUT,
    LineBuffer,
    close_socket,
    parse_address,
    send_line,
    versions,
)


class WorkerRefused(TransportError):
    """The coordinator turned this worker away (wrong token, other versions, the run is full)."""


class WorkerLink:
    """The worker's side of the control channel: hello, the assignment, heartbeats, the coordinator's end."""

    def __init__(self, coordinator: str, wait: float) -> None:
        host, port = parse_address(coordinator)
        until = time.monotonic() + wait
        while True:  # the coordinator may start after its workers
            try:
                self._sock = socket.create_connection((host, port), timeout=5.0)
                break
            except OSError as exc:
                if time.monotonic() > until:
                    raise TransportError(
                        f"could not reach the coordinator at {coordinator} within {wait:.0f} s ({exc})"
                    ) from None
                time.sleep(0.5)
        self._sock.settimeout(None)
        self._messages: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self.lost = threading.Event()
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="lightning_pipe-link", daemon=True)
        self._reader.start()

    def hello(self, token: str, device: str, group: str, index: int) -> None:
        """Introduce this slot; raises `WorkerRefused` with the coordinator's reason."""
        hello = {
            "type": "hello",
            "token": token,
            "versions": versions(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": device,
            "group": group,
            "index": index,
        }
        self.send(hello)
        reply = self.next(HELLO_TIMEOUT + 5.0)
        if reply is None:
            raise TransportError("the coordinator closed the connection without answering the hello")
        if reply.get("type") == "refused":
            raise WorkerRefused(str(reply.get("reason")))
        threading.Thread(target=self._beat, name="lightning_pipe-heartbeat", daemon=True).start()

    def next(self, timeout: float | None) -> dict[str, Any] | None:
        """The coordinator's next message; None when the connection closed (or after ``timeout``)."""
        try:
            return self._messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            send_line(self._sock, message)

    def close(self) -> None:
        self._closing = True
        close_socket(self._sock)

    def _read(self) -> None:
        buffer = LineBuffer()
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                for message in buffer.feed(data):
                    self._messages.put(message)
        except (OSError, ValueError):
            pass
        self.lost.set()
        self._messages.put(None)

    def _beat(self) -> None:
        while not self.lost.wait(HEARTBEAT):
            try:
                self.send({"type": "heartbeat"})
            except OSError:
                return
