"""The RPC communicator: stage workers in other processes, on this machine or others.

Built on ``torch.distributed.rpc`` (TensorPipe). The coordinator owns a private RPC world, apart from
Lightning's: it waits for enough stage slots on its control port (`control.ControlServer`), hands out ranks,
and every participant joins a world whose store it hosts; each stage is built remotely from its `StageSpec`
and pings back when ready. Steps, calls, activations and gradients go point to point over the world's data plane
(`rpc.plane`, `rpc.endpoint`); RPC builds and stops the stages. The coordinator's process holds the
last stage itself (`rpc.home`): an S-rank pipeline takes S - 1 worker processes (docs/internals.md).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import warnings
import weakref
from typing import Any

import torch.distributed.rpc as rpc

from lightning_pipe.base.allocator import give_back_large_blocks
from lightning_pipe.base.errors import PipeTimeoutError, TransportError
from lightning_pipe.comm.base import COORDINATOR, Communicator, Endpoint, deadline, remaining
from lightning_pipe.comm.compress import resolve_codec
from lightning_pipe.comm.control import ControlServer, Slot, parse_address
from lightning_pipe.comm.local_workers import exit_reason
from lightning_pipe.comm.rpc.build import await_builds, ready_ping, start_builds
from lightning_pipe.comm.rpc.endpoint import RpcEndpoint, TransportStats, register_inbox
from lightning_pipe.comm.rpc.home import HomeStage, RankProcesses, device_of, home_device, moved_devices, place
from lightning_pipe.comm.rpc.hosted import HostedWorld, wait_all
from lightning_pipe.comm.rpc.plane import DataPlane
from lightning_pipe.comm.rpc.stages import stage_stats, stop_stage
from lightning_pipe.comm.slot import TOKEN_ENV

log = logging.getLogger("lightning_pipe")

HEARTBEAT_TIMEOUT = 20.0  # seconds without a heartbeat before a worker counts as lost


_ACTIVE: RpcCommunicator | None = None  # RPC allows one agent per process: the communicator whose world runs


class RpcCommunicator(Communicator):
    """Stage workers in processes of a private torch.distributed.rpc world.

    Args:
        coordinator: ``"HOST:PORT"`` where ``lightning-pipe worker`` processes (on this or other
            machines) join; HOST must be an address of this machine they can reach. Without it the
            communicator starts the worker processes on this machine (127.0.0.1). Either way the worker
            processes serve every rank but the last stage's, which this process holds (see ``colocate``):
            start S - 1 workers for S stages.
        token: shared secret a worker must present (default: ``$LIGHTNING_PIPE_TOKEN``, or a
            random one for local workers); workers of another run are refused.
        workers: local mode: how many worker processes to start (default: one per rank the workers serve);
            more lets pipelines with more stages reuse the same processes (with ``keep_alive``).
        keep_alive: keep the worker processes between pipelines; `close` ends them.
        threads: torch intra-op threads per local worker (default: this machine's cores / workers).
        heartbeat_timeout: seconds without a heartbeat before a worker counts as lost.
        compress: how the tensors of activation and gradient messages cross the wire: ``None``,
            ``"bf16"`` / ``"fp16"`` (lossy casts), ``"zstd"`` (lossless), ``"bf16+zstd"``,
            ``"fp16+zstd"``, or a codec object (`lightning_pipe.comm.compress.Codec`).
        colocate: the coordinator's process holds the rank of the last stage itself, on that stage's device
            (`rpc.home`), as launched mode does; False: every rank in a worker process, the losses computed
            by the coordinator from the last stage's outputs (which then cross, and their gradients too).
    """

    name = "rpc"

    def __init__(
        self,
        coordinator: str | None = None,
        token: str | None = None,
        workers: int | None = None,
        keep_alive: bool = False,
        threads: int | None = None,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        compress: Any = None,
        colocate: bool = True,
    ) -> None:
        self.codec = resolve_codec(compress)
        self.colocate = colocate
        self.address = coordinator
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.workers = workers
        self.keep_alive = keep_alive
        self.threads = threads
        self.heartbeat_timeout = heartbeat_timeout
        self._world: HostedWorld | None = None
        self._endpoint: RpcEndpoint | None = None
        self._stages_of: dict[int, list[int]] = {}
        self._ranks = RankProcesses(0, None)
        self._home: HomeStage | None = None  # the stage worker this process holds while a pipeline runs
        self._threads: int | None = None  # intra-op threads of a CPU stage (local workers and the home stage)
        self._lost: str | None = None
        self._refused: list[str] = []
        _OPEN.add(self)

    @property
    def local(self) -> bool:
        return self.address is None

    @property
    def shares_objects(self) -> bool:  # type: ignore[override]
        """Whether this process holds the last stage (`rpc.home`): then it computes the losses itself."""
        return self._ranks.home is not None

    @property
    def ranks_served(self) -> RankProcesses:
        """Which process serves which rank of the running (or last) pipeline."""
        return self._ranks

    @property
    def pids(self) -> dict[int, int]:
        """Process id of the worker process (on its own machine) of each rank served by one, in the running (or
        last) pipeline; the rank of the last stage runs in this process (`ranks_served`). Before any pipeline
        ran: by slot."""
        if self._world is None:
            return {}
        pids = [slot.pid for slot in self._world.slots]
        return self._ranks.slot_values(pids) if self._ranks.ranks else dict(enumerate(pids))

    @property
    def data_plane(self) -> DataPlane | None:
        """This process's side of the world's data plane (the groups activations and gradients cross), once
        the workers joined; kept while the world lives (a pool's pipelines share it)."""
        return self._world.plane if self._world else None

    @property
    def refused(self) -> list[str]:
        """Why workers were turned away (wrong token, other versions, too late), this world and earlier ones."""
        return self._refused + (self._world.server.refused if self._world else [])

    # Communicator
    def launch(self, specs: list[Any], worker_cls: Any) -> Endpoint:
        if self._endpoint is not None:
            raise TransportError("this communicator already runs a pipeline; shut it down first")
        timeout = float(specs[0].timeout)
        until = deadline(timeout)
        try:
            served = self._ranks = place(specs, self.colocate)
            remote = served.remote
            here = home_device(specs, served)
            reused = self._world
            world = self._world or self._open(len(remote), timeout, [device_of(specs[r]) for r in remote], here)
            moved = moved_devices(specs, served, [slot.device for slot in world.slots]) if reused else []
            if moved:
                warnings.warn(
                    f"this pool's worker processes were started for another pipeline's devices: {'; '.join(moved)}; "
                    "their tensors are copied between devices on every send: use an RpcCommunicator of its own "
                    "for this pipeline",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if len(remote) > len(world.slots):
                raise TransportError(
                    f"the pipeline's workers serve {len(remote)} ranks but this communicator's workers offer "
                    f"{len(world.slots)} slots; create it with workers=... large enough"
                )
            self._stages_of = {spec.rank: [shard.index for shard in spec.shards] for spec in specs}
            by_process = {process: rank for rank, process in served.processes().items() if process > 0}
            layout = world.plane.layout.describe(served.home, by_process) if world.plane is not None else ""
            log.info("lightning_pipe rpc: %s; %s", served.describe(self._stages_of, here or "cpu"), layout)
            return self._build(world, specs, worker_cls, until, timeout)
        except BaseException:
            self._endpoint = None
            self.close()
            raise

    def shutdown(self, timeout: float) -> None:
        endpoint, self._endpoint = self._endpoint, None
        home, self._home = self._home, None
        if endpoint is not None:
            register_inbox(endpoint.launch, COORDINATOR, None)
            endpoint.close()
            until = deadline(timeout)
            futures = []
            # the stage of this process may be reading a lost worker's link: that link ends first
            lost_slots = self._world.drop_lost(self.heartbeat_timeout) if self._world else []
            lost = {self._ranks.rank_of_slot(slot.rank) for slot, _ in lost_slots}
            for rank in self._ranks.remote:
                if rank in lost or rank not in self._stages_of:
                    continue
                with contextlib.suppress(Exception):
                    args = (endpoint.launch, rank, max(1.0, timeout - 1.0))
                    futures.append(rpc.rpc_async(endpoint.names[rank], stop_stage, args=args))
            if home is not None and not home.stop(max(1.0, remaining(until) - 1.0)):
                warnings.warn(f"the stage thread of rank {home.rank} in this process did not stop", stacklevel=2)
            wait_all(futures, until)
        if not self.keep_alive or self._lost is not None:
            self.close(timeout)

    def check_alive(self) -> None:
        world = self._world
        if world is None:
            return
        problems = []
        for slot, reason in world.lost(self.heartbeat_timeout):
            problems.append(self._describe(slot, self._exit_reason(slot) or reason))
        ended = self._home.ended() if self._home is not None else None
        if ended is not None:
            problems.append(f"rank {self._ranks.home} in the coordinator's process: {ended}")
        endpoint = self._endpoint
        if endpoint is not None and endpoint.stats.failures and not problems:
            problems.append("messages could not be delivered: " + "; ".join(endpoint.stats.failures[:3]))
        if problems:
            self._lost = "; ".join(problems)
            if ended is not None and len(problems) == 1:  # only the stage this process holds: its own error
                raise ended
            raise TransportError(f"lost a stage worker, the pipeline stops: {self._lost}")

    # beyond the Communicator interface
    def start(self, timeout: float = 300.0) -> RpcCommunicator:
        """Start (or wait for) the workers now instead of at the first launch; a pool to reuse with ``keep_alive``."""
        if self._world is None:
            count = self.workers or 1
            try:
                self._open(count, timeout, ["cpu"] * count, None)
            except BaseException:
                self.close()
                raise
        return self

    def stats(self, reset: bool = False) -> dict[int, TransportStats]:
        """What each participant sent (``COORDINATOR`` and every rank) since the launch or the last reset."""
        endpoint = self._endpoint
        if endpoint is None:
            raise TransportError("no pipeline is running on this communicator")
        out = {COORDINATOR: endpoint.stats}
        if reset:
            endpoint.stats = TransportStats()
        for rank in self._stages_of:
            if self._home is not None and rank == self._home.rank:
                out[rank] = self._home.stats(reset)
                continue
            future = rpc.rpc_async(endpoint.names[rank], stage_stats, args=(endpoint.launch, rank, reset))
            out[rank] = future.wait()
        return out

    def close(self, timeout: float = 30.0) -> None:
        """End the RPC world and every worker process (nothing is left behind, also after errors)."""
        world, self._world = self._world, None
        home, self._home = self._home, None
        if home is not None:  # a launch that failed half way
            home.stop(min(timeout, 5.0))
        if world is None:
            return
        world.close(timeout, self.heartbeat_timeout)
        self._refused += world.server.refused
        self._lost = None
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self) -> RpcCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # opening a world
    def _open(self, count: int, timeout: float, devices: list[str], home: str | None) -> HostedWorld:
        """Open a world of ``count`` slots (local: spawned on ``devices``); ``home``: the device of the stage this
        process holds, if it holds one (its data plane takes the GPU to GPU path where it can)."""
        global _ACTIVE
        give_back_large_blocks()  # this process holds the last stage, not the freed space of its gradients
        if _ACTIVE is not None and _ACTIVE is not self:
            raise TransportError(
                "another RpcCommunicator's world is running in this process (torch.distributed.rpc allows one "
                "per process); close that pipeline or communicator first"
            )
        _ACTIVE = self
        if self.local:
            host, port, token = "127.0.0.1", 0, self.token or secrets.token_hex(16)
        else:
            assert self.address is not None
            host, port = parse_address(self.address)
            token = self.token or ""
            if not token:
                warnings.warn(
                    f"transport='rpc' without a token: any worker that reaches {host}:{port} can join this run; "
                    f"pass token=... or set ${TOKEN_ENV} on the coordinator and the workers",
                    RuntimeWarning,
                    stacklevel=4,
                )
        try:
            server = ControlServer(host, port, token)
        except OSError as exc:
            raise TransportError(f"cannot listen for workers on {host}:{port}: {exc}") from None
        world = HostedWorld(server, host)
        self._world = world  # closed by the caller if opening fails
        spawn = None
        if self.local:
            total = max(count, self.workers or 0)
            # the cores are shared by the worker processes and the stage this process holds
            self._threads = self.threads or max(1, (os.cpu_count() or 1) // (total + (home is not None)))
            spawn = (devices + ["cpu"] * (total - len(devices)), self._threads)
            count = total
        else:
            self._threads = self.threads
        world.open(count, timeout, spawn, home)
        return world

    def _build(
        self, world: HostedWorld, specs: list[Any], worker_cls: Any, until: float, timeout: float
    ) -> RpcEndpoint:
        launch = f"{world.tag}-{secrets.token_hex(3)}"
        served = self._ranks
        names, hosts = served.address_book(world.names, world.hosts)
        processes = served.processes()
        endpoint = RpcEndpoint(COORDINATOR, launch, names, hosts, self.codec, world.plane, processes)
        register_inbox(launch, COORDINATOR, endpoint.inbox)
        self._endpoint = endpoint
        devices = served.slot_values([None if self.local else slot.device for slot in world.slots])  # local: spec's
        futures = start_builds(launch, served.remote, specs, worker_cls, devices, names, hosts, self.codec, processes)
        if served.home is not None:  # built here meanwhile; stopped by `close` if anything fails from here on
            home = self._home = HomeStage(launch, served.home)
            home.build(specs[served.home], worker_cls, names, hosts, self.codec, world.plane, processes, self._threads)
        await_builds(futures, self._stages_of, hosts, until, self._wait_step)
        ready_ping(endpoint, len(specs), until, self._wait_step)
        return endpoint

    def _wait_step(self, until: float, what: str) -> None:
        self.check_alive()
        if remaining(until) <= 0:
            raise PipeTimeoutError(f"the coordinator waited too long for {what}; raise timeout=... if needed")

    # describing losses
    def _describe(self, slot: Slot, reason: str) -> str:
        rank = self._ranks.rank_of_slot(slot.rank)
        stages = self._stages_of.get(rank) if rank is not None else None
        if not stages:
            return f"an idle worker (slot {slot.rank}) on {slot.where()}: {reason}"
        return f"stage {', '.join(map(str, stages))} (rank {rank}) on {slot.where()}: {reason}"

    def _exit_reason(self, slot: Slot) -> str | None:
        world = self._world
        return exit_reason(world.processes, slot.pid) if world else None


_OPEN: weakref.WeakSet[RpcCommunicator] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for communicator in list(_OPEN):
        with contextlib.suppress(Exception):
            communicator.close(5.0)
