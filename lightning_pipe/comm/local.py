"""The local communicator: one thread per rank in this process, inboxes are queues."""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Any

from lightning_pipe.comm.base import (
    COORDINATOR,
    Communicator,
    Endpoint,
    Message,
    MessageKind,
    QueueInbox,
    deadline,
    remaining,
)
from lightning_pipe.errors import ConfigurationError, TransportError


class LocalEndpoint(Endpoint):
    def __init__(self, rank: int, inboxes: dict[int, QueueInbox]) -> None:
        self.rank = rank
        self._inboxes = inboxes

    def send(self, rank: int, message: Message) -> None:
        message.source = self.rank
        self._inboxes[rank].put(message)

    def recv(self, timeout: float | None) -> Message | None:
        return self._inboxes[self.rank].get(timeout)

    def host(self, rank: int) -> str:
        return ""  # same process: nothing to add to "stage N"


class LocalCommunicator(Communicator):
    """Stage workers are threads of the coordinator's process; messages are passed by reference."""

    name = "local"

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._inboxes: dict[int, QueueInbox] = {}

    def launch(self, specs: list[Any], worker_cls: Any) -> Endpoint:
        if self._threads:
            raise TransportError("this communicator already runs stage workers; shut it down first")
        _check_shared_tensors(specs)
        self._inboxes = {COORDINATOR: QueueInbox()} | {rank: QueueInbox() for rank in range(len(specs))}
        for rank, spec in enumerate(specs):
            worker = worker_cls(spec, LocalEndpoint(rank, self._inboxes))
            thread = threading.Thread(target=worker.serve, name=f"lightning_pipe-stage-{rank}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return LocalEndpoint(COORDINATOR, self._inboxes)

    def shutdown(self, timeout: float) -> None:
        for rank in range(len(self._threads)):
            self._inboxes[rank].put(Message(MessageKind.STOP))
        until = deadline(timeout)
        for thread in self._threads:
            thread.join(remaining(until))
        alive = [t.name for t in self._threads if t.is_alive()]
        self._threads = []
        if alive:  # a thread cannot be killed: it is a daemon and ends when its current action returns
            warnings.warn(
                f"stage threads still busy {timeout:.0f} s after the stop request: {', '.join(alive)}; "
                "they end when their current action returns",
                RuntimeWarning,
                stacklevel=2,
            )

    def check_alive(self) -> None:
        dead = [t.name for t in self._threads if not t.is_alive()]
        if dead:
            raise TransportError(f"stage worker thread ended unexpectedly: {', '.join(dead)}")


def _check_shared_tensors(specs: list[Any]) -> None:
    """Stages of this process share module objects: a tensor used by shards on two devices cannot work."""
    holders: dict[int, list[tuple[int, str, str]]] = {}
    for spec in specs:
        for shard in spec.shards:
            named = itertools.chain(shard.module.named_parameters(), shard.module.named_buffers())
            for name, tensor in named:
                holders.setdefault(id(tensor), []).append((shard.index, str(shard.device), name))
    for places in holders.values():
        if len({device for _, device, _ in places}) > 1:
            where = ", ".join(f"stage {i} ({device}) as {name!r}" for i, device, name in places)
            raise ConfigurationError(
                f"one tensor is used by stages on different devices: {where}; with the local transport the stages "
                "share it, so keep the layers using it in one stage (split_points=...) or put those stages on one "
                "device"
            )
