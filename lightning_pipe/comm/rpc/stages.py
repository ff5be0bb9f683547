"""The stages an RPC worker process serves: built, stopped and queried by the coordinator through RPC.

Every function here runs in the worker process, called by ``rpc_async`` from the coordinator; the
coordinator's process calls the same ones directly for the stage it holds itself (`rpc.home`).
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

from lightning_pipe.comm.base import Message, MessageKind
from lightning_pipe.comm.placement import retarget
from lightning_pipe.comm.rpc.endpoint import RpcEndpoint, TransportStats, register_inbox
from lightning_pipe.comm.rpc.plane import DataPlane
from lightning_pipe.comm.rpc.world import quiet_closing

_STAGES: dict[tuple[str, int], tuple[Any, threading.Thread, RpcEndpoint]] = {}  # by (launch, rank)
_LOCK = threading.Lock()
EXIT = threading.Event()  # a worker process leaves when the coordinator asks
#: in a worker process: sends a failure to the coordinator over the control link
REPORT: list[Callable[[str], None]] = []
#: in a worker process: its side of the world's data plane, once it joined the world
PLANE: list[DataPlane] = []
_CRASHES: dict[tuple[str, int], str] = {}  # why a stage's event loop broke, by (launch, rank)


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
) -> dict[str, Any]:
    """Build the stage worker of ``spec`` in this process and start its event loop.

    ``processes``: the world rank of each pipeline rank that another rule than `rpc.plane.world_rank` places
    (the coordinator's and the rank its process holds); ``plane``: this process's data plane (a worker's own).
    """
    if device is not None:
        retarget(spec, device)
    plane = plane if plane is not None else PLANE[0] if PLANE else None
    endpoint = RpcEndpoint(spec.rank, launch, names, hosts, codec, plane, processes)
    try:
        worker = worker_cls(spec, endpoint)
    except BaseException:
        endpoint.close()
        raise
    endpoint.watch(p for shard in worker.shards.values() for p in shard.module.parameters())
    thread = threading.Thread(
        target=_serve, args=(worker, launch), name=f"lightning_pipe-stage-{spec.rank}", daemon=True
    )
    with _LOCK:
        register_inbox(launch, spec.rank, endpoint.inbox)
        _STAGES[(launch, spec.rank)] = (worker, thread, endpoint)
    thread.start()
    devices = sorted({str(runtime.torch_device) for runtime in worker.runtimes.values()})
    return {"rank": spec.rank, "pid": os.getpid(), "devices": devices}


def _serve(worker: Any, launch: str) -> None:
    try:
        worker.serve()
    except BaseException:  # the event loop itself broke: tell the coordinator through the control link
        crash = f"the event loop of rank {worker.rank} crashed:\n{traceback.format_exc()}"
        _CRASHES[(launch, worker.rank)] = crash
        report = REPORT[0] if REPORT else None
        if report is not None:
            report(crash)
        raise


def stage_ended(launch: str, rank: int) -> str | None:
    """Why the event loop of a built stage is no longer running (None while it runs, or if it was stopped)."""
    with _LOCK:
        entry = _STAGES.get((launch, rank))
    if entry is None or entry[1].is_alive():
        return None
    return _CRASHES.get((launch, rank), "its event loop ended")


def stop_stage(launch: str, rank: int, timeout: float) -> bool:
    """Stop a stage's event loop; True once its thread has ended."""
    with _LOCK:
        entry = _STAGES.pop((launch, rank), None)
        inbox = register_inbox(launch, rank, None)
        _CRASHES.pop((launch, rank), None)
    if entry is None or inbox is None:
        return True
    _, thread, endpoint = entry
    endpoint.close()
    inbox.put(Message(MessageKind.STOP))
    if thread.ident is not None:  # started (an interrupted build may register it first)
        thread.join(timeout)
    return not thread.is_alive()


def stage_stats(launch: str, rank: int, reset: bool) -> TransportStats:
    entry = _STAGES.get((launch, rank))
    if entry is None:
        return TransportStats()
    endpoint = entry[2]
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
