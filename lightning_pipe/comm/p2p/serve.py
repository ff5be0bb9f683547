"""The stage side of the p2p communicator: building a stage worker, and the loop of a serving process.

In launched mode every process of a pipeline but the coordinator's runs `serve_stages`: it waits for
the coordinator's builds, serves each built stage until its STOP, and returns when the coordinator
releases the pipeline. The coordinator's own pipeline rank builds its stage the same way
(`build_worker`) in a thread of the coordinator's process.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from lightning_pipe.comm.base import COORDINATOR, Endpoint, Message, MessageKind
from lightning_pipe.comm.p2p.wire import CRASHED, LOST, WIRE, Wire
from lightning_pipe.comm.placement import retarget
from lightning_pipe.errors import ConfigurationError, StageError, TransportError

BUILD = "p2p-build"  # coordinator -> process: (spec, worker class), pickled by value
BUILT = "p2p-built"  # process -> coordinator: (True, where it runs) or (False, StageError)
STOPPED = "p2p-stopped"  # process -> coordinator: its stage worker left its event loop
RELEASE = "p2p-release"  # coordinator -> process: leave serve_stages (payload: None or the error)
_POLL = 0.5  # seconds between liveness checks of an idle serving process

OnBuild = Callable[[Any], None]  # a stage worker was built in this process
Prepare = Callable[[Any], None]  # a stage worker is about to be built here from this spec


class P2PEndpoint(Endpoint):
    """An endpoint of this process: its inbox on the wire; ``recv`` raises once a peer of the pipeline is lost."""

    bundles = True

    def __init__(self, rank: int, wire: Wire) -> None:
        self.rank = rank
        self.wire = wire
        self.inbox = wire.inbox(rank)

    def send(self, rank: int, message: Message) -> None:
        message.source = self.rank
        self.wire.send(self._process(rank), rank, message)

    def send_many(self, rank: int, messages: list[Message]) -> None:
        for message in messages:
            message.source = self.rank
        self.wire.send_many(self._process(rank), rank, messages)

    def recv(self, timeout: float | None) -> Message | None:
        message = self.inbox.get(timeout)
        error = self.wire.error()
        if error is not None:
            raise error
        return None if message is not None and message.kind == LOST else message

    def host(self, rank: int) -> str:
        return self.wire.describe(self.wire.ranks[self._process(rank)])

    def _process(self, rank: int) -> int:
        """The pipeline rank of the process that holds endpoint ``rank``."""
        return self.wire.coordinator if rank == COORDINATOR else rank


def build_worker(
    spec: Any, worker_cls: Any, endpoint: P2PEndpoint, on_build: OnBuild | None, prepare: Prepare | None = None
) -> tuple[Any, Any]:
    """``(worker, (True, where))``, or ``(None, (False, StageError))`` naming the stage and this process."""
    try:
        retarget(spec, str(endpoint.wire.device))
        if prepare is not None:
            prepare(spec)
        worker = worker_cls(spec, endpoint)
        if on_build is not None:
            on_build(worker)
        devices = sorted({str(runtime.torch_device) for runtime in worker.runtimes.values()})
        return worker, (True, {"rank": spec.rank, "pid": os.getpid(), "devices": devices})
    except Exception as exc:
        stage = spec.shards[0].index if spec.shards else spec.rank
        where = endpoint.host(spec.rank)
        failure = f"building the stage failed: {type(exc).__name__}: {exc}"
        return None, (False, StageError(stage, None, "build", failure, traceback.format_exc(), where))


def serve_stages(
    group: Any,
    ranks: Sequence[int],
    describe: Callable[[int], str] | None = None,
    on_build: OnBuild | None = None,
    timeout: float = 300.0,
    coordinator: int = 0,
    prepare: Prepare | None = None,
) -> None:
    """Serve the stages the coordinator (the process of ``ranks[coordinator]``) builds here, until it releases
    the pipeline.

    Raises `TransportError` naming the lost process when a process of the pipeline dies (also while
    idle between builds), or when the coordinator releases the pipeline with an error. ``prepare`` sees each
    spec before its worker is built, ``on_build`` each worker after (the strategy's: bind the stage to this
    process's own copy of the model, replicate or shard it over its replicas).
    """
    me = _pipeline_rank(ranks, coordinator)
    wire = Wire(group, ranks, me, describe or default_describe, timeout, coordinator)
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


def _serve_one(wire: Wire, spec: Any, worker_cls: Any, on_build: OnBuild | None, prepare: Prepare | None) -> None:
    endpoint = P2PEndpoint(spec.rank, wire)
    worker, reply = build_worker(spec, worker_cls, endpoint, on_build, prepare)
    wire.send(wire.coordinator, WIRE, Message(BUILT, payload=reply, source=wire.me))
    if worker is None:
        wire.drop_inbox(spec.rank)
        return
    try:
        worker.serve()
    except TransportError:
        raise
    except BaseException as exc:  # the event loop itself broke: the coordinator counts this process as lost
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C reaches every process of the run: no traceback to show
            crash = "it was interrupted (KeyboardInterrupt)"
        else:
            crash = f"its stage loop crashed:\n{traceback.format_exc()}"
        wire.send(wire.coordinator, WIRE, Message(CRASHED, payload=crash, source=wire.me))
        raise
    finally:
        wire.drop_inbox(spec.rank)
    wire.send(wire.coordinator, WIRE, Message(STOPPED, source=wire.me))


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
