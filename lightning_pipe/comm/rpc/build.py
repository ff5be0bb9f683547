"""Building one pipeline's stages in an RPC world: the remote builds, and the ready ping that follows them.

Each remote rank builds its stage from its pickled `StageSpec` (`rpc.stages.build_stage`); what the
training script defines itself goes by value (`by_value`). The builds run at once, while the caller
builds the stage its own process holds (`rpc.home`); then every rank answers a ping sent through the
path every later message takes, so a pipeline starts only once all of them can be reached. Each wait
is bounded and calls ``wait_step`` between polls: it raises when a worker is lost or time is up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed.rpc as rpc

from lightning_pipe.base.errors import StageError
from lightning_pipe.comm.base import PING, Message, MessageKind, remaining
from lightning_pipe.comm.by_value import ByValue
from lightning_pipe.comm.rpc.endpoint import RpcEndpoint
from lightning_pipe.comm.rpc.hosted import wait_future
from lightning_pipe.comm.rpc.stages import build_stage

WaitStep = Callable[[float, str], None]  # (deadline, what is awaited): raises if the wait must end


def start_builds(
    launch: str, ranks: Sequence[int], specs: list[Any], worker_cls: Any, devices: Mapping[int, str | None],
    names: Mapping[int, str], hosts: Mapping[int, str], codec: Any, processes: Any,
) -> dict[int, Any]:  # fmt: skip
    """Ask each of ``ranks`` to build its stage (``devices[rank]``: the device of the slot serving it, or None);
    the futures by rank."""
    futures = {}
    for rank in ranks:
        spec, by_value_codec = ByValue(specs[rank]), ByValue(codec)
        args = (launch, spec, ByValue(worker_cls), names, hosts, devices[rank], by_value_codec, processes)
        futures[rank] = rpc.rpc_async(names[rank], build_stage, args=args)
    return futures


def await_builds(
    futures: dict[int, Any],
    stages_of: dict[int, list[int]],
    hosts: Mapping[int, str],
    until: float,
    wait_step: WaitStep,
) -> None:
    """Wait for every build; a failed one raises `StageError` naming its first stage and host."""
    for rank, future in futures.items():
        while not wait_future(future, min(0.5, remaining(until))):
            wait_step(until, f"rank {rank} to build its stage")
        try:
            built, value = future.wait()
        except Exception as exc:  # the call itself failed (the spec could not be unpickled there)
            raise StageError(
                stages_of[rank][0], None, "build", f"building the stage failed: {first_error_line(exc)}",
                str(exc), hosts[rank],
            ) from None  # fmt: skip
        if not built:  # the build failed: its StageError, from the worker's `StageHost`
            raise value


def ready_ping(endpoint: RpcEndpoint, ranks: int, until: float, wait_step: WaitStep) -> None:
    """Ping every rank through the path of every later message and wait for all their replies."""
    for rank in range(ranks):
        endpoint.send(rank, Message(MessageKind.CALL, 0, payload=(PING, ())))
    ready: set[int] = set()
    while len(ready) < ranks:
        message = endpoint.recv(min(0.5, remaining(until)))
        if message is None:
            wait_step(until, f"the ready ping of ranks {sorted(set(range(ranks)) - ready)}")
            continue
        if message.kind == MessageKind.REPLY and message.step == 0:
            ok, value = message.payload
            if not ok:
                raise value
            ready.add(message.source)


def first_error_line(exc: BaseException) -> str:
    """The line of a remote error that names it (the last one mentioning an Error or Exception)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return (errors[-1] if errors else lines[0] if lines else type(exc).__name__).strip()
