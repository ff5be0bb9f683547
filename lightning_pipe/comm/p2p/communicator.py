"""The p2p communicator: stages in the processes of a torch.distributed pipeline group, messages point to point.

Launched mode: a pipeline is the S processes ``ranks`` of one process group. The process of
``ranks[coordinator]`` runs the coordinator and, in a thread, the stage worker of that pipeline rank (the
strategy puts it with the last stage, so a microbatch's loss costs no round trip); the others run
`serve_stages`. Stage specs are pickled by value once and built where they run; activations and gradients go
from process to process with ``isend``/``irecv`` (`p2p.wire`, `p2p.frames`). It needs a process group, so it
is no ``transport=`` name of `Pipeline`: the strategy passes an instance (docs/internals.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.base.errors import ConfigurationError, PipeTimeoutError, StageError, TransportError
from lightning_pipe.comm import by_value
from lightning_pipe.comm.base import COORDINATOR, Communicator, Endpoint, Message, deadline, remaining
from lightning_pipe.comm.host import Hook, StageHost
from lightning_pipe.comm.p2p.send import WireStats
from lightning_pipe.comm.p2p.serve import (
    BUILD,
    BUILT,
    RELEASE,
    STOPPED,
    P2PEndpoint,
    built_reply,
    default_describe,
    stop_message,
)
from lightning_pipe.comm.p2p.wire import LOST, STATS, STATS_REPLY, WIRE, Wire
from lightning_pipe.weights import meta_copy

_POLL = 0.2  # seconds between liveness checks while the coordinator waits for its processes


class P2PCommunicator(Communicator):
    """Stage workers in the processes of ``group``: pipeline rank k in the process of global rank ``ranks[k]``.

    Args:
        group: the process group of this pipeline (exactly the processes of ``ranks``); for two processes of one
            machine it may be their own connection (`p2p.socket_group.pipeline_socket`, passed as ``reverse`` too).
        ranks: global ranks in pipeline order; ``ranks[coordinator]`` is this process.
        describe: names a global rank in errors (default ``"global rank N"``).
        on_build: called with each stage worker right after it is built, in any process of the
            pipeline (here for pipeline rank ``coordinator``; `serve_stages` takes its own for the others).
        prepare: called with the spec of this process's stage worker before it is built (the same).
        send_values: whether stage specs travel with their tensors' values; False where every process has its
            own copy of the model and ``prepare`` binds the stage to it (launched mode): shapes only travel.
        timeout: seconds any single wait may take (a build, a send, a stop, hearing from a peer).
        coordinator: the pipeline rank whose stage worker runs in this process (the others are remote).
        reverse: a second group over the same processes (gloo), for the messages to lower pipeline ranks: a link's
            two directions then never share a gloo pair (`p2p.wire`); every process of the pipeline passes one, or none.
    """

    name = "p2p"

    @property
    def shares_objects(self) -> bool:  # type: ignore[override]
        """Whether the last stage runs in this process: then it computes the losses itself (no round trip)."""
        return self._last_rank == self.coordinator

    def __init__(
        self,
        group: Any,
        ranks: Sequence[int],
        describe: Callable[[int], str] | None = None,
        on_build: Hook | None = None,
        timeout: float = 300.0,
        coordinator: int = 0,
        prepare: Hook | None = None,
        send_values: bool = True,
        reverse: Any = None,
    ) -> None:
        if not 0 <= coordinator < len(ranks) or dist.get_rank() != ranks[coordinator]:
            raise ConfigurationError(
                f"P2PCommunicator runs in the process of ranks[{coordinator}] (the coordinator's), but "
                f"ranks={list(ranks)} and this is global rank {dist.get_rank()}; the other processes call serve_stages"
            )
        self.group, self.ranks, self.timeout, self.coordinator = group, list(ranks), timeout, coordinator
        self.describe = describe or default_describe
        self.on_build = on_build
        self.prepare = prepare
        self.send_values = send_values
        self.reverse = reverse
        self._wire: Wire | None = None
        self._built: list[int] = []  # pipeline ranks whose worker runs
        self._local: StageHost | None = None  # the stage worker of this process (pipeline rank coordinator)
        self._early: list[Message] = []  # control notices that arrived while waiting for others
        self._last_rank = -1  # the pipeline rank of the last stage, once launched
        # the intra-op threads this process was given (Lightning's launcher: cores // processes; torchrun: 1); a
        # new thread starts with OpenMP's default (every core), so the local stage thread takes this count
        self._threads = torch.get_num_threads()

    # Communicator
    def launch(self, specs: list[Any], worker_cls: Any) -> Endpoint:
        if self._built:
            raise TransportError("this communicator already runs a pipeline; shut it down first")
        if len(specs) != len(self.ranks):
            raise ConfigurationError(
                f"the pipeline has {len(specs)} ranks but this communicator's group has {len(self.ranks)} processes "
                f"(ranks={self.ranks}); pass stages that fit the launched pipeline dimension"
            )
        wire = self._open()
        self.check_alive()
        endpoint = P2PEndpoint(COORDINATOR, wire)
        until = deadline(self.timeout)
        here = self.coordinator
        if not self.send_values:  # every process binds its stage to its own copy of the model: shapes travel
            specs = [meta_copy(spec, [shard.module for shard in spec.shards]) for spec in specs]
        for k, spec in enumerate(specs):  # the spec holds the user's modules: by value
            if k != here:
                wire.send(k, WIRE, Message(BUILD, payload=(spec, worker_cls)))
        self._built = list(range(len(specs)))
        self._last_rank = specs[0].rank_of_stage[-1]
        local = specs[here] if not self.send_values else by_value.copy(specs[here])
        host = self._local = StageHost(
            local, worker_cls, P2PEndpoint(here, wire, consumer=True), str(wire.device), self.prepare, self.on_build
        )
        # built in its thread, on that thread's pool: the remote ranks build meanwhile
        host.start(
            self._threads,
            lambda failure: wire.send(here, WIRE, Message(BUILT, payload=built_reply(host, failure), source=here)),
        )
        replies = self._await(BUILT, self._built, until, "the stage builds")
        failed = [rank for rank in self._built if not replies[rank][0]]
        if failed:
            self._built = [rank for rank in self._built if rank not in failed]
            self.shutdown(self.timeout)
            error: StageError = replies[failed[0]][1]
            raise error
        return endpoint

    def shutdown(self, timeout: float) -> None:
        """Stop every built worker (they go back to waiting for a build); returns within ``timeout`` seconds."""
        wire, built, self._built = self._wire, self._built, []
        if wire is None or not built:
            return
        until = deadline(timeout)
        here = self.coordinator
        remote = [rank for rank in built if rank != here]
        for rank in remote:
            wire.send(rank, rank, stop_message())
        if self._local is not None:
            self._local.stop(remaining(until))
        try:
            self._await(STOPPED, [rank for rank in remote if not wire.is_gone(rank)], until, "the stages to stop")
        except (PipeTimeoutError, TransportError) as exc:
            warnings.warn(f"stopping the stages: {exc}", RuntimeWarning, stacklevel=2)
        wire.drop_inbox(COORDINATOR)

    def check_alive(self) -> None:
        """Raise `TransportError` naming the lost process once any process of the pipeline is gone."""
        error = self._wire.error() if self._wire is not None else None
        if error is not None:
            raise error
        ended = self._local.ended() if self.coordinator in self._built and self._local is not None else None
        if ended is not None:  # the stage of this process: a crash's StageError
            raise ended

    # beyond the Communicator interface
    def release(self, error: str | None = None, timeout: float | None = None) -> None:
        """End `serve_stages` on every other process of the pipeline (with ``error``: it raises that there).

        Never hangs: bounded by ``timeout`` (default: this communicator's), also with processes gone.
        """
        timeout = self.timeout if timeout is None else timeout
        until = deadline(timeout)
        self.shutdown(timeout)
        wire = self._open()
        for rank in self._others():
            wire.send(rank, WIRE, Message(RELEASE, payload=error))
        self._wire = None
        left = wire.close(remaining(until))
        if left:
            warnings.warn(f"p2p links still open after release: {', '.join(left)}", RuntimeWarning, stacklevel=2)

    def stats(self, reset: bool = False) -> dict[int, WireStats]:
        """What each endpoint sent (``COORDINATOR`` and every pipeline rank) since it started or the last reset."""
        wire = self._open()
        out = dict(wire.stats(reset))
        others = self._others()
        for rank in others:
            wire.send(rank, WIRE, Message(STATS, payload=reset))
        for stats in self._await(STATS_REPLY, list(others), deadline(self.timeout), "statistics").values():
            out.update(stats)
        return out

    def in_flight(self) -> dict[int, int]:
        """Per pipeline rank this process sends to, the sends not yet known complete (a bounded few)."""
        return self._open().in_flight()

    # internals
    def _open(self) -> Wire:
        if self._wire is None:
            here = self.coordinator
            # two processes: each hears from one peer, and its stage reads that link itself (`p2p.direct`)
            self._wire = Wire(
                self.group, self.ranks, here, self.describe, self.timeout, here, reverse=self.reverse, direct=True
            )
        return self._wire

    def _others(self) -> list[int]:
        """The pipeline ranks in other processes."""
        return [rank for rank in range(len(self.ranks)) if rank != self.coordinator]

    def _await(self, kind: str, ranks: list[int], until: float, what: str) -> dict[int, Any]:
        """The payload of a ``kind`` notice from each of ``ranks`` (others are kept for their own wait)."""
        wire = self._open()
        inbox, got = wire.inbox(WIRE), {}
        for early in [m for m in self._early if m.kind == kind and m.source in ranks]:
            self._early.remove(early)
            got[early.source] = early.payload
        while len(got) < len(set(ranks)):
            message = inbox.get(min(_POLL, remaining(until)))
            if message is None or message.kind == LOST:
                self.check_alive()
                if remaining(until) <= 0:
                    missing = ", ".join(self.describe(self.ranks[r]) for r in sorted(set(ranks) - set(got)))
                    raise PipeTimeoutError(f"waited {self.timeout:.0f} s for {what} of {missing}")
            elif message.kind == kind and message.source in ranks:
                got[message.source] = message.payload
            else:
                self._early.append(message)
        return got
