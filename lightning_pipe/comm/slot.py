"""A stage slot process: one device that joins a coordinator's RPC world and serves whatever stage it builds there.

A slot connects to the coordinator, says hello (token, versions, device), waits for its rank, makes
its side of the world's data plane (`rpc.plane`), joins the coordinator's RPC world and then serves
the stages the coordinator builds on it, until the coordinator ends the run. If the coordinator goes
away, the slot exits: nothing is left behind. The ``lightning-pipe worker`` command
(`lightning_pipe.comm.worker_command`) starts one per device; ``transport="rpc"`` without a coordinator address
spawns them itself.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.base.allocator import give_back_large_blocks
from lightning_pipe.base.errors import TransportError
from lightning_pipe.comm.control import parse_address
from lightning_pipe.comm.control_link import WorkerLink, WorkerRefused
from lightning_pipe.comm.rpc.plane import PlaneLayout, describe_process, is_cuda, open_plane, world_rank
from lightning_pipe.comm.rpc.stages import EXIT, PLANE, REPORT, THREADS
from lightning_pipe.comm.rpc.world import join_world, leave_world

WORKER_ENV = "LIGHTNING_PIPE_WORKER"  # set in stage worker processes: `import lightning_pipe` skips Lightning
TOKEN_ENV = "LIGHTNING_PIPE_TOKEN"


def run_slot(
    coordinator: str,
    device: str,
    token: str,
    group: str,
    index: int = 0,
    threads: int | None = None,
    wait: float = 300.0,
    interface: str | None = "lo",
    local: bool = False,
    parent: int | None = None,
) -> int:
    """Serve one stage slot until the coordinator ends the run; returns the exit code."""
    if local:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the coordinator, which stops us
    if parent is not None:
        _exit_with_parent(parent)
    if threads:
        torch.set_num_threads(threads)
    THREADS[:] = [torch.get_num_threads()]  # the stage threads' pools too (`rpc.stages.build_stage`)
    give_back_large_blocks()  # a worker holds its stage, not the freed space of its gradients (as launched mode)
    try:
        link = WorkerLink(coordinator, wait)
        link.hello(token, device, group, index)
    except WorkerRefused as exc:
        print(f"lightning-pipe worker: {exc}", file=sys.stderr, flush=True)
        return 2
    except TransportError as exc:
        print(f"lightning-pipe worker: {exc}", file=sys.stderr, flush=True)
        return 1
    if not local:
        print(f"lightning-pipe worker: {device} joined the coordinator at {coordinator}", flush=True)
    message = link.next(None)
    if message is None:
        print("lightning-pipe worker: the coordinator went away before assigning a rank", file=sys.stderr)
        return 1
    if message.get("type") != "assign":
        print(f"lightning-pipe worker: released ({message.get('reason', 'not needed')})", flush=True)
        link.close()
        return 0
    rank, timeout = int(message["rank"]), float(message["timeout"])
    host, port = parse_address(coordinator)[0], int(message["store_port"])
    try:
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))
        tag = message["tag"]
        if is_cuda(device):
            torch.cuda.set_device(torch.device(device))  # this process's device: its NCCL group's and its stages'
        # the data plane first: the coordinator builds stages here once every process joined the RPC world
        layout = PlaneLayout.from_json(message["plane"])
        PLANE[:] = [open_plane(store, f"lp{tag}-plane", world_rank(rank), layout, interface, timeout, describe_process)]
        join_world(f"lp{tag}-{rank}", rank + 1, int(message["world_size"]), store, timeout, interface, f"lp{tag}")
    except Exception as exc:
        link.send({"type": "failed", "error": f"could not join the RPC world: {exc}"})
        print(f"lightning-pipe worker: could not join the RPC world: {exc}", file=sys.stderr, flush=True)
        return 1
    REPORT[:] = [lambda text: link.send({"type": "failed", "error": text})]
    while not EXIT.wait(0.2):
        if link.lost.is_set():  # the coordinator died or dropped us: leave at once, without ceremony
            print("lightning-pipe worker: lost the coordinator; exiting", file=sys.stderr, flush=True)
            os._exit(1)
    PLANE.pop().close(min(5.0, timeout))  # the coordinator and the other slots close theirs meanwhile
    leave_world()
    link.close()
    return 0


def run_slot_process(**kwargs: object) -> None:
    """Target of a spawned slot process. Leaves with os._exit: the stage and RPC are already shut down,
    and the interpreter's own teardown of torch would take seconds."""
    exit_process(run_slot(**kwargs))  # type: ignore[arg-type]


def run_spawned_slot(arguments: dict[str, Any]) -> None:
    """Entry of a worker process that ``transport="rpc"`` started on this machine (`local_workers`)."""
    run_slot_process(token=os.environ.pop(TOKEN_ENV, ""), **arguments)


def exit_process(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="lightning_pipe-parent-watch", daemon=True).start()


def serve(
    coordinator: str,
    devices: Sequence[str],
    token: str,
    interface: str | None,
    wait: float,
    threads: int | None,
) -> int:
    """One slot per device: in this process for one device, in child processes for several."""
    group = f"{socket.gethostname()}-{os.getpid()}"
    if len(devices) == 1:
        return run_slot(coordinator, devices[0], token, group, 0, threads, wait, interface)
    context = mp.get_context("spawn")
    children = []
    for index, device in enumerate(devices):
        kwargs = dict(
            coordinator=coordinator, device=device, token=token, group=group, index=index,
            threads=threads, wait=wait, interface=interface, parent=os.getpid(),
        )  # fmt: skip
        child = context.Process(target=run_slot_process, kwargs=kwargs, name=f"lightning_pipe-slot-{index}")
        child.start()
        children.append(child)
    try:
        for child in children:
            child.join()
    except KeyboardInterrupt:
        for child in children:
            child.terminate()
        for child in children:
            child.join(5.0)
            if child.is_alive():
                child.kill()
        return 130
    return max(abs(child.exitcode or 0) for child in children)
