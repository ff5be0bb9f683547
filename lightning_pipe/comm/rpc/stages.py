"""The stages an RPC worker process serves: built, stopped and queried by the coordinator through RPC.

Every function here runs in the worker process, called by ``rpc_async`` from the coordinator; the
coordinator's process calls the same ones directly for the stage it holds itself (`rpc.home`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from lightning_pipe.base.errors import PipeError, StageError
from lightning_pipe.comm.host import StageHost
from lightning_pipe.comm.rpc.endpoint import RpcEndpoint, TransportStats, register_inbox
from lightning_pipe.comm.rpc.plane import DataPlane
from lightning_pipe.comm.rpc.world import quiet_closing

_HOSTS: dict[tuple[str, int], StageHost] = {}  # the stages this process serves, by (launch, rank)
_LOCK = threading.Lock()
EXIT = threading.Event()  # a worker process leaves when the coordinator asks
#: in a worker process: sends a failure to the coordinator over the control link
REPORT: list[Callable[[str], None]] = []
#: in a worker process: its side of the world's data plane, once it joined the world
PLANE: list[DataPlane] = []
#: in a worker process: the intra-op threads of its main thread, which its stage threads take too (a new thread
#: starts with OpenMP's default pool, every core: on a shared machine its spinning slowed each action many times)
THREADS: list[int] = []

Built = tuple[bool, Any]  # (True, where the stage runs: `StageHost.describe`) or (False, its StageError)


def build_stage(
    launch: str,
    spec: Any,
    worker_cls: type,
    names: dict[int, str],
    hosts: dict[int, str],
    device: str | None,
    codec: Any = None,
    processes: dict[int, int] | None = None,
    plane: DataPlane | None = None,
) -> Built:
    """Build the stage worker of ``spec`` in this process and start its event loop.

    ``processes``: the world rank of every pipeline rank and of the coordinator (`rpc.home.RankProcesses`);
    ``plane``: this process's data plane (a worker's own).
    A failed build comes back as its `StageError` (a value: RPC would lose its fields if it were raised).
    """
    plane = plane if plane is not None else PLANE[0] if PLANE else None
    endpoint = RpcEndpoint(spec.rank, launch, names, hosts, codec, plane, processes)
    host = StageHost(spec, worker_cls, endpoint, device, on_crash=_report)
    failure = host.build()
    if failure is not None:
        return False, failure
    endpoint.watch(p for shard in host.worker.shards.values() for p in shard.module.parameters())
    with _LOCK:
        register_inbox(launch, spec.rank, endpoint.inbox)
        _HOSTS[(launch, spec.rank)] = host
    host.start(THREADS[0] if THREADS else None)
    return True, host.describe()


def _report(crash: StageError) -> None:
    """In a worker process: tell the coordinator through the control link (it counts the worker as lost)."""
    report = REPORT[0] if REPORT else None
    if report is not None:
        report(str(crash))


def stage_ended(launch: str, rank: int) -> PipeError | None:
    """Why the event loop of a built stage ended unasked (None while it runs, or once it was stopped)."""
    with _LOCK:
        host = _HOSTS.get((launch, rank))
    return host.ended() if host is not None else None


def stop_stage(launch: str, rank: int, timeout: float) -> bool:
    """Stop a stage's event loop; True once its thread has ended."""
    with _LOCK:
        host = _HOSTS.pop((launch, rank), None)
        register_inbox(launch, rank, None)
    if host is None:
        return True
    host.endpoint.close()
    return host.stop(timeout)


def stage_stats(launch: str, rank: int, reset: bool) -> TransportStats:
    host = _HOSTS.get((launch, rank))
    if host is None:
        return TransportStats()
    endpoint = host.endpoint
    stats = endpoint.stats
    if reset:
        endpoint.stats = TransportStats()
    return stats


def quiet_worker() -> None:
    """The world is about to end: its connections close without warnings from now on (see `quiet_closing`)."""
    quiet_closing()  # nothing to restore: the process ends with the world


def request_exit() -> None:
    """Make this worker process leave the world."""
    EXIT.set()
