"""A stage worker process: ``lightning-pipe worker --coordinator HOST:PORT`` (or ``python -m lightning_pipe.worker``).

Each device given with ``--devices`` is one stage slot and runs in its own process. A slot
connects to the coordinator, says hello (token, versions, device), waits for its rank, joins the
coordinator's RPC world and then serves whatever stage the coordinator builds on it, until the
coordinator ends the run. If the coordinator goes away, the worker exits: nothing is left behind.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_pipe.comm import rpc as rpc_comm
from lightning_pipe.comm.control import WorkerLink, WorkerRefused, interface_of, parse_address
from lightning_pipe.errors import TransportError


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
        rpc_comm.join_world(
            f"lp{tag}-{rank}", rank + 1, int(message["world_size"]), store, timeout, interface, f"lp{tag}"
        )
    except Exception as exc:
        link.send({"type": "failed", "error": f"could not join the RPC world: {exc}"})
        print(f"lightning-pipe worker: could not join the RPC world: {exc}", file=sys.stderr, flush=True)
        return 1
    rpc_comm._REPORT[:] = [lambda text: link.send({"type": "failed", "error": text})]
    while not rpc_comm._EXIT.wait(0.2):
        if link.lost.is_set():  # the coordinator died or dropped us: leave at once, without ceremony
            print("lightning-pipe worker: lost the coordinator; exiting", file=sys.stderr, flush=True)
            os._exit(1)
    rpc_comm.leave_world()
    link.close()
    return 0


def _run_slot_process(**kwargs: object) -> None:
    """Target of a spawned slot process. Leaves with os._exit: the stage and RPC are already shut down,
    and the interpreter's own teardown of torch would take seconds."""
    _exit(run_slot(**kwargs))  # type: ignore[arg-type]


def _exit(code: int) -> None:
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
        child = context.Process(target=_run_slot_process, kwargs=kwargs, name=f"lightning_pipe-slot-{index}")
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


def resolve_interface(host: str | None) -> str | None:
    """``--host``: an interface name or an address of this machine; default loopback."""
    if host is None:
        return "lo"
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    if host in names:
        return host
    interface = interface_of(host)
    if interface is None:
        raise SystemExit(
            f"lightning-pipe worker: --host {host!r} is neither a network interface of this machine "
            f"({', '.join(sorted(names)) or 'none found'}) nor one of its addresses"
        )
    return interface


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the training script (its coordinator)")
    parser.add_argument("--devices", default="cpu", help="comma-separated devices, one stage slot each (cpu)")
    parser.add_argument("--token", default=None, help="shared secret of the run (default: $LIGHTNING_PIPE_TOKEN)")
    parser.add_argument(
        "--host", default=None, help="interface name or address to serve RPC on (default: loopback only)"
    )
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the coordinator (300)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per slot (default: torch's)")


def run(args: argparse.Namespace) -> int:
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    token = args.token if args.token is not None else os.environ.get(rpc_comm.TOKEN_ENV, "")
    host = parse_address(args.coordinator)[0]
    if args.host is None and not (host == "localhost" or host == "::1" or host.startswith("127.")):
        print(
            f"lightning-pipe worker: serving RPC on loopback only, but the coordinator is at {host}: unless it runs "
            "on this machine, pass --host with this machine's interface or address",
            file=sys.stderr,
            flush=True,
        )
    return serve(args.coordinator, devices, token, resolve_interface(args.host), args.wait, args.threads)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-pipe worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    _exit(main())
