"""Joining and leaving a private torch.distributed.rpc world, with every wait bounded."""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed import autograd as dist_autograd
from torch.distributed.rpc import constants

RPC_THREADS = 4


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for a block; the earlier values (or their absence) come back afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _interface(name: str | None) -> contextlib.AbstractContextManager[None]:
    """Make TensorPipe and gloo listen on interface ``name`` while the agent starts."""
    return environment({"TP_SOCKET_IFNAME": name, "GLOO_SOCKET_IFNAME": name} if name else {})


def host_store(host: str, timeout: float) -> dist.TCPStore:
    """The rendezvous store of a new RPC world, on a free port of ``host`` (read ``.port``)."""
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)


def join_world(
    name: str,
    rank: int,
    world_size: int,
    store: dist.Store,
    timeout: float,
    interface: str | None,
    prefix: str,
) -> None:
    """Start this process's RPC agent; every wait is bounded by ``timeout``.

    ``rpc.init_rpc`` would rendezvous through a store that waits up to 30 minutes for missing
    ranks, so the agent is started here from our own store (the same steps init_rpc takes).
    """
    # TCP (libuv) only: TensorPipe's shared-memory transport polls without sleeping, and each of its
    # processes took about 60% of a core doing so while idle (measured on 2 cores: the stages' cores); what
    # RPC carries (builds, stops, stats; a pipeline's messages go over the data plane, `rpc.plane`) is small
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=RPC_THREADS, rpc_timeout=timeout, _transports=["uv"], _channels=["basic"]
    )
    store.set_timeout(timedelta(seconds=timeout))
    with _interface(interface), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ProcessGroupGloo.*as a ProcessGroup")  # torch's own use
        saved = constants.DEFAULT_PROCESS_GROUP_TIMEOUT
        constants.DEFAULT_PROCESS_GROUP_TIMEOUT = timedelta(seconds=timeout)  # the agent's gloo group
        try:
            dist_autograd._init(rank)
            rpc._set_profiler_node_id(rank)  # type: ignore[attr-defined]
            backend = rpc.BackendType.TENSORPIPE  # type: ignore[attr-defined]
            rpc._init_rpc_backend(backend, dist.PrefixStore(prefix, store), name, rank, world_size, options)  # type: ignore[attr-defined]
        finally:
            constants.DEFAULT_PROCESS_GROUP_TIMEOUT = saved


def leave_world() -> None:
    """Stop this process's RPC agent without waiting for the others."""
    with contextlib.suppress(Exception):
        rpc.shutdown(graceful=False)


def quiet_closing() -> Callable[[], None]:
    """Hold back TensorPipe's C++ warnings about closing connections while this process's world ends;
    returns what restores the earlier level (call it once the agent has stopped).

    When an RPC world ends, every agent logs a warning for each connection that closes under it
    ("pipe closed", "eof", "error when sending response"), and one stage error shows a dozen of
    them. rpc's graceful shutdown would avoid them, but its barrier counts ids in a process-wide
    counter that a coordinator which opened a world before never shares with fresh workers (its
    barrier then waits for keys nobody writes). So for the time the world ends, and only then,
    c10's log threshold is ERROR: the runtime form of ``TORCH_CPP_LOG_LEVEL=ERROR``, which torch
    reads only once, at import. Where libc10 does not export the flag, the warnings stay.
    """
    flag = _c10_log_level()
    if flag is None:
        return lambda: None
    before = flag.value
    flag.value = max(before, _C10_ERROR)

    def restore() -> None:
        flag.value = before

    return restore


_C10_ERROR = 2  # c10's severities: INFO 0, WARNING 1, ERROR 2, FATAL 3


def _c10_log_level() -> ctypes.c_int | None:
    """c10's ``FLAGS_caffe2_log_level`` (messages below it are dropped), in the libc10 torch has loaded."""
    for path in sorted(Path(torch.__file__).parent.joinpath("lib").glob("*c10.*")):
        with contextlib.suppress(OSError, ValueError):
            return ctypes.c_int.in_dll(ctypes.CDLL(str(path)), "FLAGS_caffe2_log_level")
    return None
