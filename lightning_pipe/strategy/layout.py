"""Which mode a `PipeStrategy` runs in, and in launched mode which process holds what.

The mode rule: ``transport="local"`` one process, stages as threads; ``"rpc"`` one Lightning process, stages in
worker processes; ``"p2p"`` launched mode; ``None`` (the default) launched mode when the Trainer has more than
one process, else local. In launched mode the processes form R replicas of P consecutive ranks; each block's
first process is its coordinator and holds the last stage's pipeline rank (rank 0 for a schedule placed in a
V), so a microbatch's output and its loss never cross processes. With ``tensor_parallel=T`` a stage of a
replica is T consecutive processes (tensor innermost), and each tensor rank is a pipeline of its own, with its
own coordinator. The layout drawn: docs/internals.md and docs/launched.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.comm.transports import TRANSPORTS
from lightning_pipe.schedule.placement import LOOP, stage_rank

LOCAL, RPC, LAUNCHED = "local", "rpc", "launched"


def choose_mode(transport: str | None, processes: int) -> str:
    """The mode for ``transport`` (``None``: decided by the number of processes) in a run of ``processes``."""
    if transport is None:
        return LAUNCHED if processes > 1 else LOCAL
    if transport == "p2p":
        return LAUNCHED
    return RPC if transport == "rpc" else LOCAL


def check_transport(transport: str | None, streams: bool, options: Mapping[str, Any]) -> None:
    """What the mode rule refuses when the strategy is made: an unknown ``transport``, ``schedule="async"``
    (``streams``) outside local mode, rpc's ``options`` (coordinator, token, compress) without ``transport="rpc"``."""
    if transport is not None and transport not in TRANSPORTS and transport != "p2p":
        known = ", ".join(sorted({*TRANSPORTS, "p2p"}))
        raise ConfigurationError(f"unknown transport {transport!r}; available: {known} (or None: by the process count)")
    if streams and transport not in (None, LOCAL):
        raise ConfigurationError(
            f"PipeStrategy(schedule='async') runs with transport='local'; with transport={transport!r} train "
            "with lightning_pipe.Pipeline(...).train_async(...) or pick schedule='1f1b'"
        )
    if options and transport != RPC:
        verb = "needs" if len(options) == 1 else "need"
        raise ConfigurationError(f"{' and '.join(options)} {verb} transport='rpc' (stages in worker processes)")


def check_tensor_parallel_transport(tensor_parallel: int, transport: str | None) -> None:
    """``tensor_parallel`` > 1 runs in launched mode only: ``transport="local"`` and ``"rpc"`` are refused."""
    if transport in (LOCAL, RPC):
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel}, transport={transport!r}): tensor parallel runs in "
            "launched mode, one process per stage and tensor rank; leave transport out (or pass 'p2p') and start "
            "devices x num_nodes = replicas x stages x tensor_parallel processes"
        )


def check_launched(processes: int, devices: Sequence[str] | None, runner: str, streams: bool) -> None:
    """What launched mode cannot do fails when the Trainer is built, before any process starts (``streams``:
    ``schedule="async"``)."""
    if devices is not None:
        raise ConfigurationError(
            "PipeStrategy(devices=[...]) places the stages of one process; in launched mode "
            f"({processes} processes) each process holds its stage on its own device: leave devices out, "
            "or pass transport='local' to run every stage in this process"
        )
    if runner == "linear":
        raise ConfigurationError(
            "runner='linear' walks every stage from one thread; in launched mode each process runs its own "
            "stage: use runner='parallel' or 'dataflow', or transport='local'"
        )
    if streams:
        raise ConfigurationError(
            "PipeStrategy(schedule='async') runs with transport='local' in one process; in launched mode "
            "pick a synchronous schedule such as '1f1b'"
        )


@dataclass(frozen=True)
class Layout:
    """Launched mode: ``replicas`` pipelines of ``ranks_per_pipeline`` processes; this process is ``global_rank``."""

    world_size: int
    global_rank: int
    ranks_per_pipeline: int
    devices_per_node: int
    #: the pipeline rank that holds the last stage, the coordinator's (the last rank unless placed in a V)
    coordinator: int = -1
    #: processes per stage of a replica (``tensor_parallel``): a stage's tensor group, consecutive global ranks
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.coordinator < 0:
            object.__setattr__(self, "coordinator", self.ranks_per_pipeline - 1)

    @classmethod
    def of(
        cls,
        world_size: int,
        global_rank: int,
        stages: int,
        virtual_stages: int,
        devices_per_node: int,
        placement: str = LOOP,
        tensor_parallel: int = 1,
    ) -> Layout:
        """The layout of ``stages`` stages in ``world_size`` processes, placed on the pipeline ranks by the
        schedule's ``placement``; raises naming the numbers and the fix."""
        per_pipeline = stages // virtual_stages
        if tensor_parallel > 1:
            check_tensor_parallel(world_size, stages, per_pipeline, tensor_parallel, devices_per_node)
        if world_size % per_pipeline:
            fits = [p * virtual_stages for p in range(1, world_size + 1) if world_size % p == 0]
            raise ConfigurationError(
                f"PipeStrategy(stages={stages}) in {world_size} processes: each pipeline replica takes "
                f"{per_pipeline} processes (one per {'worker of ' if virtual_stages > 1 else ''}stage), and "
                f"{world_size} is not a multiple of {per_pipeline}; pick stages from "
                f"{', '.join(map(str, fits))}, or a Trainer with devices x num_nodes a multiple of {per_pipeline}"
            )
        last = stage_rank(placement, stages - 1, per_pipeline)
        return cls(world_size, global_rank, per_pipeline, devices_per_node, last, tensor_parallel)

    @property
    def replicas(self) -> int:
        """R: the data-parallel replicas (each reads its own shard of the data)."""
        return self.world_size // (self.ranks_per_pipeline * self.tensor_parallel)

    @property
    def replica(self) -> int:
        return self.global_rank // (self.ranks_per_pipeline * self.tensor_parallel)

    @property
    def tensor_rank(self) -> int:
        """This process's rank in its stage's tensor group (0 without tensor parallel)."""
        return self.global_rank % self.tensor_parallel

    @property
    def pipelines(self) -> int:
        """How many pipelines run (R x T): each is the P processes of one replica and one tensor rank."""
        return self.replicas * self.tensor_parallel

    @property
    def pipeline_rank(self) -> int:
        return self.pipeline_rank_of(self.global_rank)

    def pipeline_rank_of(self, global_rank: int) -> int:
        """The pipeline rank a process holds: the first of a replica's block holds the coordinator's (the last
        stage's), the next ones count down from it."""
        block = global_rank // self.tensor_parallel  # the processes of one stage of one replica count as one
        return (self.coordinator - block % self.ranks_per_pipeline) % self.ranks_per_pipeline

    def _offset(self, pipeline_rank: int) -> int:
        """Where in its replica's block the processes holding ``pipeline_rank`` are (in units of T processes)."""
        return (self.coordinator - pipeline_rank) % self.ranks_per_pipeline

    def _rank(self, replica: int, pipeline_rank: int, tensor_rank: int) -> int:
        return (replica * self.ranks_per_pipeline + self._offset(pipeline_rank)) * self.tensor_parallel + tensor_rank

    @property
    def coordinates(self) -> bool:
        """Whether this process runs Lightning's loop (the first of its replica's block)."""
        return self.pipeline_rank == self.coordinator

    def pipeline_ranks(self, replica: int | None = None, tensor_rank: int | None = None) -> list[int]:
        """Global ranks of a pipeline (default: this process's), in pipeline order (stage 0 first)."""
        replica = self.replica if replica is None else replica
        tensor_rank = self.tensor_rank if tensor_rank is None else tensor_rank
        return [self._rank(replica, rank, tensor_rank) for rank in range(self.ranks_per_pipeline)]

    def replica_ranks(self, pipeline_rank: int | None = None) -> list[int]:
        """Global ranks holding the same pipeline rank and tensor rank in every replica (its data-parallel group)."""
        rank = self.pipeline_rank if pipeline_rank is None else pipeline_rank
        return [self._rank(r, rank, self.tensor_rank) for r in range(self.replicas)]

    def tensor_ranks(self) -> list[int]:
        """Global ranks of this process's stage in its replica: its tensor group (consecutive)."""
        return [self._rank(self.replica, self.pipeline_rank, t) for t in range(self.tensor_parallel)]

    @property
    def coordinator_ranks(self) -> list[int]:
        """The processes that run Lightning's loop (one per replica and tensor rank): Lightning's collectives
        (logging, checkpoints) span these."""
        return [self._rank(r, self.coordinator, t) for r in range(self.replicas) for t in range(self.tensor_parallel)]

    def local_index(self, global_rank: int) -> int:
        """The device index of ``global_rank`` on its node (ranks fill the nodes in order)."""
        return global_rank % self.devices_per_node

    def describe(self, global_rank: int) -> str:
        tensor = f", tensor rank {global_rank % self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return (
            f"global rank {global_rank} (pipeline rank {self.pipeline_rank_of(global_rank)}{tensor} "
            f"of replica {global_rank // (self.ranks_per_pipeline * self.tensor_parallel)})"
        )

    def picture(self) -> str:
        """One line per replica: which global rank holds which pipeline rank (logged at the start)."""
        return "; ".join(
            f"replica {r}: "
            + ", ".join(
                f"rank {g} -> pipeline rank {self.pipeline_rank_of(g)}"
                + (f" tensor rank {g % self.tensor_parallel}" if self.tensor_parallel > 1 else "")
                + (" (coordinator)" if self.pipeline_rank_of(g) == self.coordinator else "")
                for g in sorted(g for t in range(self.tensor_parallel) for g in self.pipeline_ranks(r, t))
            )
            for r in range(self.replicas)
        )


def check_tensor_parallel(world_size: int, stages: int, per_pipeline: int, tensor: int, devices_per_node: int) -> None:
    """``tensor_parallel`` fits the launched world: a stage's tensor group on one node, S x T dividing the world."""
    if tensor > devices_per_node or devices_per_node % tensor:
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor}) with {devices_per_node} devices per node: a stage's {tensor} "
            f"tensor ranks must share one node (their collectives run in every layer); pick tensor_parallel from "
            f"{', '.join(str(t) for t in range(1, devices_per_node + 1) if devices_per_node % t == 0)}, or give the "
            f"Trainer more devices per node"
        )
    if world_size % (per_pipeline * tensor):
        virtual = stages // per_pipeline
        fits = [str(p * virtual) for p in range(1, world_size + 1) if world_size % (p * tensor) == 0]
        raise ConfigurationError(
            f"PipeStrategy(stages={stages}, tensor_parallel={tensor}) in {world_size} processes (devices x num_nodes):"
            f" each replica takes {per_pipeline} x {tensor} = {per_pipeline * tensor} processes, and {world_size} is "
            f"not a multiple of it; pick stages from {', '.join(fits)}, a smaller tensor_parallel, or "
            f"devices x num_nodes a multiple of {per_pipeline * tensor}"
        )
