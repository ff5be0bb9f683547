"""Launched mode: R pipeline replicas x P ranks in the processes that Lightning's launchers start.

`PipeLauncher` (Lightning's launcher, or none under torchrun and SLURM) makes every process but the first of
each replica's block serve its stage; the coordinators (the first of each block, holding its last stage) run
the Trainer's loop, and Lightning's collectives span them only. Process groups: a DeviceMesh ``("replica",
"pipeline")`` and a coordinators' group (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from typing_extensions import override

from lightning_pipe.allocator import give_back_large_blocks
from lightning_pipe.comm import P2PCommunicator, serve_stages
from lightning_pipe.engine.runners import worker_of_stages
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.config import PipeConfig
from lightning_pipe.strategy.launcher import PipeLauncher
from lightning_pipe.strategy.layout import LAUNCHED, Layout
from lightning_pipe.strategy.mode import Mode
from lightning_pipe.strategy.process_groups import PROCESS_GROUP_TIMEOUT, ProcessGroups
from lightning_pipe.strategy.stage_placement import ProcessStage


class LaunchedMode(Mode):
    """Launched mode in this process: its place in the `Layout`, its device, the process groups, the
    point-to-point transport of its pipeline, and Lightning's collectives among the coordinators.

    `PipeStrategy` makes one when Lightning sets the world's ranks and hands its collectives here.
    """

    name = LAUNCHED
    folds_stages_back = False  # each process's LightningModule holds its own stage's trained tensors

    def __init__(
        self,
        layout: Layout,
        devices: Sequence[torch.device],
        config: PipeConfig,
        stage: ProcessStage,
    ) -> None:
        self._layout = layout
        self.devices = list(devices)  # this node's devices, one per local rank
        self.config = config  # the strategy's arguments (``timeout``, ``runner``, ``virtual_stages`` are read)
        self.stage = stage  # this process's part of the model: the stages built here bind to it
        self._groups: ProcessGroups | None = None
        self._p2p: P2PCommunicator | None = None
        self._released = True  # the serving ranks were told that this fit ended

    @property
    @override
    def layout(self) -> Layout:
        return self._layout

    @property
    def device(self) -> torch.device:
        """This process's device: where its stage and, on a coordinator, the loss live."""
        return self.devices[self.layout.local_index(self.layout.global_rank)]

    @override
    def root_device(self, placed: Callable[[], torch.device]) -> torch.device:
        return self.device

    @override
    def set_ranks(self, environment: Any) -> None:
        environment.set_global_rank(self.layout.global_rank)
        environment.set_world_size(self.layout.world_size)

    @override
    def launcher(self, environment: Any, devices: int, num_nodes: int, serve: Callable[[Any], None]) -> Any:
        """Lightning's subprocess launcher (a no-op under torchrun or SLURM); a serving rank serves its stage."""
        return PipeLauncher(environment, devices, num_nodes, None if self.layout.coordinates else serve)

    @override
    def world_size(self, lightning: int) -> int:
        """1, as Lightning's loop must see it.

        Lightning's training loop broadcasts a SIGTERM flag over the whole torch.distributed world
        before every batch when ``world_size > 1``; the processes that serve a stage do not run that
        loop and cannot join it. The collectives here span the coordinators, one per replica;
        ``layout`` holds the real numbers (``layout.world_size`` processes, ``layout.replicas`` replicas).
        """
        return 1

    @property
    @override
    def sampler_kwargs(self) -> dict[str, Any]:
        """Each replica reads its own shard of the data; the ranks of one pipeline read none (they serve)."""
        return {"num_replicas": self.layout.replicas, "rank": self.layout.replica}

    @property
    @override
    def distributed(self) -> bool:
        return True

    @override
    def transport(self, name: str | None) -> P2PCommunicator:
        return self.communicator()

    @override
    def stage_devices(self, given: Callable[[], list[str]] | None = None, placement: str = LOOP) -> list[str]:
        """The device of each stage: that of the process holding it in this replica (the schedule's ``placement``)."""
        virtual = self.config.virtual_stages
        stages = self.layout.ranks_per_pipeline * virtual
        holder = worker_of_stages(self.config.runner, stages, virtual, placement)
        ranks = self.layout.pipeline_ranks()
        return [str(self.devices[self.layout.local_index(ranks[holder[s]])]) for s in range(stages)]

    @override
    def connect(self, cluster_environment: Any) -> None:
        """Join torch.distributed (unless joined) and make this layout's process groups."""
        give_back_large_blocks()  # this process holds its stage, not the freed space of its gradients
        device = self.device
        if not dist.is_initialized():
            backend = _get_default_process_group_backend_for_device(device)
            _init_dist_connection(cluster_environment, backend, timeout=PROCESS_GROUP_TIMEOUT)
            ProcessGroups.made_default_group()
        self._groups = ProcessGroups.of(self.layout, device.type)

    @override
    def describe(self) -> str:
        """The line logged once at the start: the processes and which pipeline rank each holds."""
        layout = self.layout
        return (
            f"PipeStrategy: launched mode, {layout.world_size} processes = {layout.replicas} replica(s) x "
            f"{layout.ranks_per_pipeline} pipeline rank(s); {layout.picture()}"
        )

    def communicator(self) -> P2PCommunicator:
        """The point-to-point transport of this replica's pipeline (one per world, reused by every fit)."""
        if self._p2p is None:
            self._p2p = P2PCommunicator(**self._pipeline(), send_values=False)
        return self._p2p

    def serve(self) -> None:
        """What a process that does not coordinate runs instead of the Trainer's loop (after `connect`)."""
        serve_stages(**{**self._pipeline(), "on_build": self._built_to_serve})

    def _built_to_serve(self, worker: Any) -> None:
        """A stage built in a serving process: this process keeps that stage of its model and nothing else."""
        self.stage.built(worker)
        self.stage.release()

    def _pipeline(self) -> dict[str, Any]:
        """This process's pipeline as both sides of the p2p transport take it: group, ranks, names, and the hooks
        that bind a stage built here to this process's model and spread it over its replicas (`ProcessStage`)."""
        groups = self._groups
        assert groups is not None, "LaunchedMode.connect makes the process groups first"
        if self.layout.replicas > 1:
            self.stage.replicate_over(groups.replicas, groups.mesh["replica"])
        return {
            "group": groups.pipeline,
            "ranks": self.layout.pipeline_ranks(),
            "describe": self.layout.describe,
            "on_build": self.stage.built,
            "prepare": self.stage.prepare,
            "timeout": self.config.timeout,
            "coordinator": self.layout.coordinator,
        }

    @override
    def hold(self) -> None:
        """A fit starts: the serving ranks serve until `release`."""
        self._released = False

    @override
    def release(self, error: BaseException | None = None) -> None:
        """End the serving ranks' ``fit`` (with the coordinator's error, if it failed); once per fit."""
        if self._released or not self.layout.coordinates:
            return
        self._released = True
        if self._p2p is None and self.layout.ranks_per_pipeline == 1:
            return
        # the serving ranks serve from the fit's start: a fit that failed before its pipeline was built (a
        # checkpoint that does not match) releases them too, or they would take the next fit's for this one
        p2p = self._p2p if self._p2p is not None else self.communicator()
        text = None
        if error is not None:
            who = self.layout.describe(self.layout.global_rank)
            text = f"its coordinator, {who}, failed: {type(error).__name__}: {error}"
        p2p.release(text)

    # Lightning's collectives: among the coordinators (the processes that run Lightning's loop)
    def _coordinator_group(self) -> Any:
        """The coordinators' group; None where there is nothing to agree on (one replica, or a serving rank)."""
        layout = self.layout
        if layout.replicas == 1 or self._groups is None or not layout.coordinates:
            return None
        return self._groups.coordinators

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._coordinator_group() is None:
            return decision
        votes = self.reduce(torch.tensor(int(decision), device=self.device), reduce_op="sum")
        return bool(votes == self.layout.replicas) if all else bool(votes)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        coordinators = self._coordinator_group()
        if coordinators is None or not isinstance(tensor, torch.Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group or coordinators, reduce_op=reduce_op)

    @override
    def barrier(self) -> None:
        coordinators = self._coordinator_group()
        if coordinators is None:
            return
        device = self.device
        if device.type == "cuda":
            dist.barrier(group=coordinators, device_ids=[device.index or 0])
        else:
            dist.barrier(group=coordinators)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        coordinators = self._coordinator_group()
        if coordinators is None:
            return obj
        box = [obj]
        ranks = self.layout.coordinator_ranks  # Lightning names a global rank; only coordinators take part
        dist.broadcast_object_list(box, src=src if src in ranks else ranks[0], group=coordinators)
        return box[0]

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        coordinators = self._coordinator_group()
        if coordinators is None:
            return tensor
        return _all_gather_ddp_if_available(tensor, group=group or coordinators, sync_grads=sync_grads)
