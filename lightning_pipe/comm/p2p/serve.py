"""The stage side of the p2p communicator: building a stage worker, and the loop of a serving process.

In launched mode every process of a pipeline but the coordinator's runs `serve_stages`: it waits for
the coordinator's builds, serves each built stage until its STOP, and returns when the coordinator
releases the pipeline. The coordinator's own pipeline rank is hosted the same way
(`StageHost`), in a thread of the coordinator's process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from lightning_pipe.base.errors import ConfigurationError, StageError, TransportError
from lightning_pipe.comm.base import COORDINATOR, Endpoint, Message, MessageKind
from lightning_pipe.comm.host import Hook, StageHost
from lightning_pipe.comm.p2p import direct
from lightning_pipe.comm.p2p.wire import CRASHED, LOST, WIRE, Wire

BUILD = "p2p-build"  # coordinator -> process: (spec, worker class), pickled by value
BUILT = "p2p-built"  # process -> coordinator: (True, where it runs) or (False, StageError)
STOPPED = "p2p-stopped"  # process -> coordinator: its stage worker left its event loop
RELEASE = "p2p-release"  # coordinator -> process: leave serve_stages (payload: None or the error)
_POLL = 0.5  # seconds between liveness checks of an idle serving process


class P2PEndpoint(Endpoint):
    """An endpoint of this process: its inbox on the wire; ``recv`` raises once a peer of the pipeline is lost."""

    bundles = True

    def __init__(self, rank: int, wire: Wire, consumer: bool = False) -> None:
        self.rank = rank
        self.wire = wire
        #: the one consumer of what the wire's one link brings (the stage of a process of a two-process pipeline):
        #: it waits on the link itself while its inbox is empty (`p2p.direct`)
        self.direct = wire.direct if consumer else None
        self.inbox = wire.consumer_inbox(rank) if consumer else wire.inbox(rank)

    def send(self, rank: int, message: Message) -> None:
        message.source = self.rank
        self.wire.send(self._process(rank), rank, message)

    def send_many(self, rank: int, messages: list[Message]) -> None:
        for message in messages:
            message.source = self.rank
        self.wire.send_many(self._process(rank), rank, messages)

    def recv(self, timeout: float | None) -> Message | None:
        if self.direct is not None:
            message = direct.receive(self.inbox, self.direct.baton, self.direct.pump, timeout)
        else:
            message = self.inbox.get(timeout)
        error = self.wire.error()
        if error is not None:
            raise error
        return None if message is not None and message.kind == LOST else message

    def host(self, rank: int) -> str:
        return self.wire.describe(self.wire.ranks[self._process(rank)])

    def close(self) -> None:
        self.wire.drop_inbox(self.rank)

    def _process(self, rank: int) -> int:
        """The pipeline rank of the process that holds endpoint ``rank``."""
        return self.wire.coordinator if rank == COORDINATOR else rank


def serve_stages(
    group: Any,
    ranks: Sequence[int],
    describe: Callable[[int], str] | None = None,
    on_build: Hook | None = None,
    timeout: float = 300.0,
    coordinator: int = 0,
    prepare: Hook | None = None,
    reverse: Any = None,
) -> None:
    """Serve the stages the coordinator (the process of ``ranks[coordinator]``) builds here, until it releases
    the pipeline.

    Raises `TransportError` naming the lost process when a process of the pipeline dies (also while
    idle between builds), or when the coordinator releases the pipeline with an error. ``prepare`` sees each
    spec before its worker is built, ``on_build`` each worker after (the strategy's: bind the stage to this
    process's own copy of the model, replicate or shard it over its replicas). ``reverse``: as `P2PCommunicator`'s.
    """
    me = _pipeline_rank(ranks, coordinator)
    # a process of a two-process pipeline hears from one peer only: its stage reads that link itself (`p2p.direct`)
    wire = Wire(group, ranks, me, describe or default_describe, timeout, coordinator, reverse=reverse, direct=True)
    control = wire.inbox(WIRE)
    try:
        while True:
            message = control.get(_POLL)
            error = wire.error()
            if error is not None:
                raise error
            if message is None or message.kind == LOST:
                continue
            if message.kind == RELEASE:
                if message.payload is not None:
                    raise TransportError(f"the coordinator released the pipeline after an error: {message.payload}")
                return
            if message.kind == BUILD:
                spec, worker_cls = message.payload
                _serve_one(wire, spec, worker_cls, on_build, prepare)
    finally:
        wire.close(min(timeout, 10.0))


def _serve_one(wire: Wire, spec: Any, worker_cls: Any, on_build: Hook | None, prepare: Hook | None) -> None:
    host = StageHost(
        spec, worker_cls, P2PEndpoint(spec.rank, wire, consumer=True), str(wire.device), prepare, on_build,
        on_crash=lambda crash: wire.send(wire.coordinator, WIRE, Message(CRASHED, payload=str(crash), source=wire.me)),
    )  # fmt: skip
    failure = host.build()
    wire.send(wire.coordinator, WIRE, Message(BUILT, payload=built_reply(host, failure), source=wire.me))
    if failure is not None:
        return
    host.serve()  # a crash of its loop: the coordinator counts this process as lost (``on_crash``)
    wire.send(wire.coordinator, WIRE, Message(STOPPED, source=wire.me))


def built_reply(host: StageHost, failure: StageError | None) -> tuple[bool, Any]:
    """The BUILT notice's payload: ``(True, where it runs)`` or ``(False, StageError)``."""
    return (True, host.describe()) if failure is None else (False, failure)


def stop_message() -> Message:
    return Message(MessageKind.STOP)


def default_describe(rank: int) -> str:
    return f"global rank {rank}"


def _pipeline_rank(ranks: Sequence[int], coordinator: int) -> int:
    rank, ranks = dist.get_rank(), list(ranks)
    if rank not in ranks or ranks.index(rank) == coordinator:
        raise ConfigurationError(
            f"serve_stages runs on the pipeline ranks of ranks={list(ranks)} but {coordinator}, and this is global "
            f"rank {rank}; the process of ranks[{coordinator}] runs the coordinator (P2PCommunicator)"
        )
    return ranks.index(rank)
