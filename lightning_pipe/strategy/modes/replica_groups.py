"""How launched mode's replicas average their stages: within the run, or as torchft replica groups.

`LaunchedMode` holds one `Replicas`: `WithinTheRun` (the replicas are processes of this run; DDP or FSDP over their
process group) or, with ``fault_tolerance=``, `TorchftGroups`: this torchrun is one torchft replica group of a run of
several, one process per stage, averaging the stages' gradients over torchft's quorum instead of a process group of
the whole run (`lightning_pipe.strategy.fault_tolerance`, docs/faults.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.strategy.fault_tolerance import FaultTolerance, ReplicaGroup
from lightning_pipe.strategy.layout import LAUNCHED, Layout
from lightning_pipe.strategy.pipe_config import PipeConfig


class Replicas(ABC):
    """How launched mode's replicas average their stages: what the mode asks where they differ."""

    @abstractmethod
    def sampler_kwargs(self, layout: Layout) -> dict[str, Any]:
        """The ``num_replicas``/``rank`` of Lightning's distributed sampler: which shard of the data this reads."""

    @abstractmethod
    def connect(self, layout: Layout, device: torch.device) -> None:
        """After the run's process groups exist: join whatever else the replicas average over."""

    @abstractmethod
    def describe(self) -> str:
        """What the start's log line adds (empty: nothing)."""

    @abstractmethod
    def attach(self, worker: Any) -> None:
        """A stage worker built in this process: how it averages over the replicas."""

    @abstractmethod
    def follow(self, trainer: Any) -> None:
        """The coordinator's Trainer, once the pipeline is built."""


class WithinTheRun(Replicas):
    """The replicas are processes of this run: a stage averages over its replicas' process group (DDP or FSDP, set
    up by `ProcessStage`); nothing more to join."""

    def sampler_kwargs(self, layout: Layout) -> dict[str, Any]:
        """Each replica reads its own shard; the ranks of one pipeline read none (they serve)."""
        return {"num_replicas": layout.replicas, "rank": layout.replica}

    def connect(self, layout: Layout, device: torch.device) -> None:
        """The run's process groups are all there is."""

    def describe(self) -> str:
        return ""

    def attach(self, worker: Any) -> None:
        """`ProcessStage` replicated the stage over its group already."""

    def follow(self, trainer: Any) -> None:
        """Lightning's loop is the only one: nothing to heal."""


class TorchftGroups(Replicas):
    """Each torchrun is one torchft replica group (``fault_tolerance=``): each stage process joins torchft's quorum
    (`ReplicaGroup`), a joining group heals from a live one, and the data is cut into one shard per group."""

    def __init__(self, settings: FaultTolerance) -> None:
        self.given = settings
        self.group: ReplicaGroup | None = None  # this process's torchft Manager and healing state, after `connect`
        self._settings: FaultTolerance | None = None

    @property
    def settings(self) -> FaultTolerance:
        """The run's `FaultTolerance` with the environment's defaults filled in (read once, in this process)."""
        if self._settings is None:
            self._settings = self.given.resolve()
        return self._settings

    def sampler_kwargs(self, layout: Layout) -> dict[str, Any]:
        """Each replica group reads its own shard of the data (as each replica of Lightning's DDP does)."""
        settings = self.settings
        return {"num_replicas": settings.replica_groups, "rank": settings.replica_group}

    def connect(self, layout: Layout, device: torch.device) -> None:
        """This process's torchft Manager, once."""
        if self.group is None:
            self.group = ReplicaGroup(self.settings, layout.global_rank, layout.world_size, device, layout.coordinates)

    def describe(self) -> str:
        settings = self.settings
        return (
            f"; fault tolerant (torchft): replica group {settings.replica_group} of {settings.replica_groups}, "
            f"lighthouse {settings.lighthouse}"
        )

    def attach(self, worker: Any) -> None:
        """A stage built in this process averages its gradients over the quorum and heals from a live group."""
        assert self.group is not None, "TorchftGroups.connect makes the replica group first"
        self.group.attach(worker)

    def follow(self, trainer: Any) -> None:
        """The coordinator's Trainer (its step count, LR schedulers) heals a joining group's."""
        if self.group is not None:
            self.group.follow(trainer)


def replicas_of(config: PipeConfig) -> Replicas:
    """``fault_tolerance=``'s replica groups, else the run's own replicas."""
    settings = config.fault_tolerance
    if settings is None:
        return WithinTheRun()
    assert isinstance(settings, FaultTolerance), "PipeConfig.of resolves fault_tolerance= to its settings"
    return TorchftGroups(settings)


def check_fault_tolerant(config: PipeConfig, mode: str, processes: int) -> None:
    """What fault tolerance refuses when the Trainer is built: a mode other than launched, tensor parallel, and a
    torchrun of more processes than one replica group's (``stages``: each torchrun is one group)."""
    if config.fault_tolerance is None:
        return
    if mode != LAUNCHED:
        raise ConfigurationError(
            f"PipeStrategy(fault_tolerance=...) runs in launched mode, one torchrun per replica group of `stages` "
            f"processes, but this Trainer runs {processes} process(es) in {mode} mode: start each group with torchrun "
            "--nproc-per-node <stages> (docs/faults.md)"
        )
    if config.tensor_parallel > 1:
        raise ConfigurationError("PipeStrategy(fault_tolerance=...) with tensor_parallel > 1 is not built yet: leave "
                                 "one of them out")  # fmt: skip
    stages = config.stages or processes
    if processes != stages // config.virtual_stages:
        raise ConfigurationError(
            f"PipeStrategy(fault_tolerance=...): each torchrun is one replica group, one process per stage, but this "
            f"one runs {processes} processes for {stages} stages; start it with --nproc-per-node {stages} and one "
            "torchrun per replica group (REPLICA_GROUP_ID=0, 1, ...)"
        )
