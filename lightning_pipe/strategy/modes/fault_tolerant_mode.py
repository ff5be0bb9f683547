"""Fault-tolerant launched mode: this torchrun is one torchft replica group of a run of several.

Launched mode with one replica inside the torchrun (S processes, one per stage); the replicas are torchft replica
groups, each started by its own torchrun, averaging their stages' gradients over torchft's quorum instead of a process
group of the whole run (`lightning_pipe.strategy.fault_tolerance`, docs/faults.md).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.strategy.fault_tolerance import FaultTolerance, ReplicaGroup
from lightning_pipe.strategy.layout import LAUNCHED
from lightning_pipe.strategy.model_state import ModelState
from lightning_pipe.strategy.modes.launched_mode import LaunchedMode
from lightning_pipe.strategy.pipe_config import PipeConfig


class FaultTolerantMode(LaunchedMode):
    """`LaunchedMode` whose replicas are torchft replica groups: each stage process joins torchft's quorum, and the
    data is cut into one shard per replica group."""

    group: ReplicaGroup | None = None  # this process's torchft Manager and healing state, after `connect`
    _settings: FaultTolerance | None = None

    @property
    def settings(self) -> FaultTolerance:
        """The run's `FaultTolerance` with the environment's defaults filled in (read once, in this process)."""
        if self._settings is None:
            settings = self.config.fault_tolerance
            assert isinstance(settings, FaultTolerance), "a FaultTolerantMode runs with fault_tolerance settings"
            self._settings = settings.resolve()
        return self._settings

    @property
    @override
    def sampler_kwargs(self) -> dict[str, Any]:
        """Each replica group reads its own shard of the data (as each replica of Lightning's DDP does)."""
        settings = self.settings
        return {"num_replicas": settings.replica_groups, "rank": settings.replica_group}

    @override
    def connect(self, cluster_environment: Any) -> None:
        """Launched mode's processes and groups in this torchrun, then this process's torchft Manager."""
        super().connect(cluster_environment)
        if self.group is None:
            layout = self.layout
            self.group = ReplicaGroup(self.settings, layout.global_rank, layout.world_size, self.device,
                                      layout.coordinates)  # fmt: skip

    @override
    def describe(self) -> str:
        settings = self.settings
        return (
            f"{super().describe()}; fault tolerant (torchft): replica group {settings.replica_group} of "
            f"{settings.replica_groups}, lighthouse {settings.lighthouse}"
        )

    @override
    def on_stage_built(self, worker: Any) -> None:
        """A stage built in this process averages its gradients over the quorum and heals from a live group."""
        super().on_stage_built(worker)
        assert self.group is not None, "FaultTolerantMode.connect makes the replica group first"
        self.group.attach(worker)

    @override
    def built(self, state: ModelState, pipeline: Pipeline, device: torch.device) -> None:
        """As launched mode; the coordinator's Trainer (its step count, LR schedulers) heals a joining group's."""
        super().built(state, pipeline, device)
        module = state.host.lightning_module
        if self.group is not None and module is not None:
            self.group.follow(module.trainer)


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
