"""The local communicator: one thread per rank in this process, inboxes are queues."""

from __future__ import annotations

import itertools
import os
import warnings
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError, TransportError
from lightning_pipe.comm.base import (
    COORDINATOR,
    Communicator,
    Endpoint,
    Message,
    QueueInbox,
    deadline,
    remaining,
)
from lightning_pipe.comm.host import StageHost
from lightning_pipe.comm.parameter_home import SharedParameters
from lightning_pipe.runtime import runtime_registry


class LocalEndpoint(Endpoint):
    def __init__(self, rank: int, inboxes: dict[int, QueueInbox]) -> None:
        self.rank = rank
        self.inbox = inboxes[rank]
        self._inboxes = inboxes

    def send(self, rank: int, message: Message) -> None:
        message.source = self.rank
        self._inboxes[rank].put(message)

    def recv(self, timeout: float | None) -> Message | None:
        return self.inbox.get(timeout)

    def host(self, rank: int) -> str:
        return ""  # same process: nothing to add to "stage N"


class LocalCommunicator(Communicator):
    """Stage workers are threads of the coordinator's process; messages are passed by reference.

    Args:
        threads: torch intra-op threads of each CPU stage thread; default: this machine's cores
            shared among the CPU stages (see `stage_threads`).
    """

    name = "local"
    shares_objects = True
    parameters = SharedParameters()

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise ConfigurationError(f"threads={threads}: pass a positive number of intra-op threads per stage")
        self.threads = threads
        self._hosts: list[StageHost] = []
        self._inboxes: dict[int, QueueInbox] = {}

    def launch(self, specs: list[Any], worker_cls: Any) -> Endpoint:
        if self._hosts:
            raise TransportError("this communicator already runs stage workers; shut it down first")
        _check_shared_tensors(specs)
        device_types = [_device_type(spec) for spec in specs]
        num_threads = stage_threads(self.threads, device_types)
        for spec, device_type in zip(specs, device_types, strict=True):
            spec.options["num_threads"] = num_threads if device_type == "cpu" else None
        self._inboxes = {COORDINATOR: QueueInbox()} | {rank: QueueInbox() for rank in range(len(specs))}
        try:
            for rank, spec in enumerate(specs):
                host = StageHost(spec, worker_cls, LocalEndpoint(rank, self._inboxes))
                failure = host.build()
                if failure is not None:  # one process: the build's own error, as the unsplit model raises it
                    raise failure.__cause__ or failure
                self._hosts.append(host)
                host.start()
        except BaseException:  # a stage that failed to build, or Ctrl-C: the threads already started stop
            self.shutdown(10.0)
            raise
        return LocalEndpoint(COORDINATOR, self._inboxes)

    def shutdown(self, timeout: float) -> None:
        hosts, self._hosts = self._hosts, []
        for host in hosts:
            host.request_stop()
        until = deadline(timeout)
        busy = [host.name for host in hosts if not host.join(remaining(until))]
        if busy:  # a thread cannot be killed: it is a daemon and ends when its current action returns
            warnings.warn(
                f"stage threads still busy {timeout:.0f} s after the stop request: {', '.join(busy)}; "
                "they end when their current action returns",
                RuntimeWarning,
                stacklevel=2,
            )

    def check_alive(self) -> None:
        """Raise the `StageError` of a stage whose event loop crashed (`TransportError` if it ended otherwise)."""
        for host in self._hosts:
            failure = host.ended()
            if failure is not None:
                raise failure


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


def stage_threads(threads: int | None, device_types: list[str]) -> int | None:
    """Intra-op threads of each CPU stage thread: ``threads``, or this machine's cores shared among CPU stages.

    The stage threads compute at the same time, so each takes its share of the cores instead of
    every stage starting a pool as large as the machine (which oversubscribes the cores and leaves
    OpenMP spinning). Never more than the caller's own count. None: no CPU stage.
    """
    cpu_stages = sum(t == "cpu" for t in device_types)
    if cpu_stages == 0:
        return None
    if threads is not None:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores // cpu_stages))


def _device_type(spec: Any) -> str:
    """The device type of a worker (its first shard's runtime)."""
    shard = spec.shards[0]
    runtime = spec.runtime.get(shard.index) if isinstance(spec.runtime, dict) else spec.runtime
    return str((runtime or runtime_registry.create(shard.device)).torch_device.type)
