"""The stage worker command: ``lightning-pipe worker --coordinator HOST:PORT``.

Each device given with ``--devices`` is one stage slot (`lightning_pipe.comm.slot`) and runs in its
own process until the coordinator ends the run.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence

from lightning_pipe.comm.control import interface_of, parse_address
from lightning_pipe.comm.slot import TOKEN_ENV, exit_process, serve


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
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")
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
    exit_process(main())
