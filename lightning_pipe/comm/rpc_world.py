"""Joining and leaving a private torch.distributed.rpc world, with every wait bounded."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed import autograd as dist_autograd
from torch.distributed.rpc import constants

RPC_THREADS = 4
LEAVE_TIMEOUT = 10.0  # seconds the participants of a world wait for each other when they leave together


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
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=RPC_THREADS, rpc_timeout=timeout)
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


def leave_world(store: dist.Store | None = None, timeout: float = LEAVE_TIMEOUT) -> None:
    """Stop this process's RPC agent: together with every other participant when ``store`` is given, else alone.

    The orderly way (``store``: the world's rendezvous store) is rpc's graceful shutdown, a barrier
    that every participant enters; each agent then knows the others are leaving too, so closing the
    connections logs nothing. Alone (a participant is lost or the coordinator is gone), each agent's
    TensorPipe warns about every connection the others closed ("pipe closed", "eof"), which is then
    the truth. The barrier waits on the store (bounded by ``timeout``, set here) and RPC calls
    (bounded by ``timeout`` too); if it fails, the agent stops alone.
    """
    if store is not None:
        store.set_timeout(timedelta(seconds=timeout))
        with contextlib.suppress(Exception):
            rpc.shutdown(graceful=True, timeout=timeout)
            return
    with contextlib.suppress(Exception):
        rpc.shutdown(graceful=False)
