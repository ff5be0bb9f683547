"""Launched mode: R pipeline replicas x P ranks in the processes that Lightning's launchers start.

`PipeLauncher` (Lightning's launcher, or none under torchrun and SLURM) makes every process but the first of
each replica's block serve its stage; the coordinators (the first of each block, holding its last stage) run
the Trainer's loop, and Lightning's collectives span them only. Process groups: a DeviceMesh ``("replica",
"pipeline")`` and a coordinators' group (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from typing_extensions import override

from lightning_pipe.base.allocator import give_back_large_blocks
from lightning_pipe.checkpoint.background import writes_for
from lightning_pipe.checkpoint.reader import IN_PARTS
from lightning_pipe.comm import P2PCommunicator, serve_stages
from lightning_pipe.comm.p2p.dtensor_frames import use_tensor_mesh
from lightning_pipe.engine.runners import worker_of_stages
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.arguments import fsdp_without_replicas
from lightning_pipe.strategy.building import Destination
from lightning_pipe.strategy.launcher import PipeLauncher
from lightning_pipe.strategy.layout import LAUNCHED, Layout
from lightning_pipe.strategy.modes.launched_checkpoints import LaunchedCheckpoints
from lightning_pipe.strategy.modes.launched_collectives import CoordinatorCollectives
from lightning_pipe.strategy.modes.mode import Collectives, Mode, Write
from lightning_pipe.strategy.modes.mode_parts import ModeParts
from lightning_pipe.strategy.modes.replica_groups import replicas_of
from lightning_pipe.strategy.modes.whole_file import WholeFile
from lightning_pipe.strategy.patch import Patches
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.process_groups import PROCESS_GROUP_TIMEOUT, ProcessGroups, attempt_store
from lightning_pipe.strategy.unread import checkpoint_io_unused


class LaunchedMode(Mode):
    """Launched mode in this process: its place in the `Layout`, its device, the process groups, the
    point-to-point transport of its pipeline, and Lightning's collectives among the coordinators.

    `PipeStrategy` makes one when Lightning sets the world's ranks and hands its collectives here.
    """

    name = LAUNCHED

    def __init__(self, layout: Layout, devices: Sequence[torch.device], config: PipeConfig, parts: ModeParts) -> None:
        self.config = config  # the strategy's arguments (``timeout``, ``runner``, ``virtual_stages`` are read)
        self._layout = layout
        self.devices = list(devices)  # this node's devices, one per local rank
        self.host, self.state, self.builder = parts.host, parts.state, parts.builder
        self.optimization = parts.optimization
        self.stage = parts.stage  # this process's part of the model: the stages built here bind to it
        self._groups: ProcessGroups | None = None
        self._p2p: P2PCommunicator | None = None
        self._released = True  # the serving ranks were told that this fit ended
        self._collectives = CoordinatorCollectives(layout, self.device)
        self.writes = writes_for(config.async_checkpoint)  # this process's checkpoint write in flight
        self.file = WholeFile(self.writes, parts.host, first=layout.global_rank == 0)  # no LightningModule attached
        self.checkpoints = LaunchedCheckpoints(config, layout, self.writes, parts, self._collectives)
        self.replicas = replicas_of(config)  # the run's own, or torchft replica groups (``fault_tolerance=``)

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
        rank_zero_only.rank = utils_rank_zero_only.rank = self.layout.global_rank  # type: ignore[attr-defined]

    @override
    def launcher(self, environment: Any, devices: int, num_nodes: int, prepare: Callable[[Any], None]) -> Any:
        """Lightning's subprocess launcher (a no-op under torchrun or SLURM); a serving rank serves its stage (after
        ``prepare``: the strategy binds this process's model and joins the processes)."""

        def serve(trainer: Any) -> None:
            prepare(trainer)
            self.serve()

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
        return self.replicas.sampler_kwargs(self.layout)

    @property
    @override
    def distributed(self) -> bool:
        return True

    @override
    def transport(self) -> P2PCommunicator:
        return self.communicator()

    @override
    def fsdp_warning(self) -> str | None:
        where = "launched mode with one replica (devices x num_nodes == stages)"
        return fsdp_without_replicas(self.config.data_parallel, where, self.layout.replicas)

    @override
    def unread(self, checkpoint_io: Any) -> list[str | None]:
        writers = "every process writes its own stage (torch.distributed.checkpoint, or one file made of the parts)"
        return [checkpoint_io_unused(self.name, writers, checkpoint_io)]

    @override
    def stage_devices(self, trainer_devices: Sequence[torch.device] | None = None, placement: str = LOOP) -> list[str]:
        """The device of each stage: that of the process holding it in this replica (the schedule's ``placement``)."""
        virtual = self.config.virtual_stages
        stages = self.layout.ranks_per_pipeline * virtual
        holder = worker_of_stages(self.config.runner, stages, virtual, placement)
        ranks = self.layout.pipeline_ranks()
        return [str(self.devices[self.layout.local_index(ranks[holder[s]])]) for s in range(stages)]

    @override
    def connect(self, cluster_environment: Any) -> None:
        """Join torch.distributed (unless joined) and make this layout's process groups; this process's stage learns
        its replicas."""
        give_back_large_blocks()  # this process holds its stage, not the freed space of its gradients
        device = self.device
        if not dist.is_initialized():
            backend = _get_default_process_group_backend_for_device(device)
            store = attempt_store(cluster_environment, self.layout.global_rank, self.layout.world_size)
            _init_dist_connection(cluster_environment, backend, timeout=PROCESS_GROUP_TIMEOUT, **store)
            ProcessGroups.made_default_group()
        self._groups = groups = ProcessGroups.of(self.layout, device.type)
        self._collectives.groups = groups  # Lightning's collectives span the coordinators' group from now on
        self.writes.connect(groups.checkpoint_writes)  # async_checkpoint: the group of async_save's collectives
        if self.layout.replicas > 1:  # this process's stage is spread over them (`ProcessStage.sharded`)
            self.stage.replicate_over(groups.replicas, groups.mesh["data_parallel"])
        if self.layout.tensor_parallel > 1:  # DTensors crossing between stages are rebuilt over the stage's ranks
            use_tensor_mesh(self._groups.mesh["tensor_parallel"])
        self.replicas.connect(self.layout, device)

    @property
    @override
    def device_mesh(self) -> Any:
        """The DeviceMesh of the launched world (`ProcessGroups`), after `connect`."""
        groups = self._groups
        assert groups is not None, "LaunchedMode.connect makes the process groups first"
        return groups.mesh

    @override
    def describe(self) -> str:
        """The line logged once at the start: the processes and which pipeline rank each holds."""
        layout = self.layout
        tensor = f" x {layout.tensor_parallel} tensor rank(s)" if layout.tensor_parallel > 1 else ""
        return (
            f"PipeStrategy: launched mode, {layout.world_size} processes = {layout.replicas} replica(s) x "
            f"{layout.ranks_per_pipeline} pipeline rank(s){tensor}; {layout.picture()}{self.replicas.describe()}"
        )

    def communicator(self) -> P2PCommunicator:
        """The point-to-point transport of this replica's pipeline (one per world, reused by every fit)."""
        if self._p2p is None:
            self._p2p = P2PCommunicator(**self._pipeline(), send_values=False)
        return self._p2p

    def serve(self) -> None:
        """What a process that does not coordinate runs instead of the Trainer's loop (after `connect`)."""
        serve_stages(**{**self._pipeline(), "on_build": self._built_to_serve})
        self.writes.finish()  # the fit's last checkpoint: this process's part written (its staging copy released)

    def on_stage_built(self, worker: Any) -> None:
        """A stage built in this process: it binds to this process's model and writes its checkpoints' parts through
        this process's `writes`."""
        worker.checkpoints.writes = self.writes
        self.stage.built(worker)
        self.replicas.attach(worker)

    def _built_to_serve(self, worker: Any) -> None:
        """A stage built in a serving process: this process keeps that stage of its model and nothing else."""
        self.on_stage_built(worker)
        self.stage.release()

    def _pipeline(self) -> dict[str, Any]:
        """This process's pipeline as both sides of the p2p transport take it: group, ranks, names, and the hooks
        that bind a stage built here to this process's model and spread it over its replicas (`ProcessStage`)."""
        groups = self._groups
        assert groups is not None, "LaunchedMode.connect makes the process groups first"
        return {
            "group": groups.socket or groups.pipeline,
            "reverse": groups.socket or groups.reverse,
            "ranks": self.layout.pipeline_ranks(),
            "describe": self.layout.describe,
            "on_build": self.on_stage_built,
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

    @property
    @override
    def collectives(self) -> Collectives:
        """Among the coordinators (the processes that run Lightning's loop)."""
        return self._collectives

    # where the stages and the optimizers live: each process's own stage, in its own LightningModule
    @override
    def prepare_optimization(self, outside: Iterable[nn.Parameter]) -> None:
        """Lightning's optimizers step this process's stage, on it."""
        self.optimization.setup(outside)
        self.optimization.step_stages()

    @override
    def built(self, pipeline: Pipeline, device: torch.device) -> None:
        """This process keeps its own stage and the tensors outside the pipeline, nothing else; the optimizers step
        the stages' parameters (found by name) and keep only meta stand-ins of them."""
        module = self.host.lightning_module
        if module is not None:
            self.stage.release(keep=self.builder.outside_tensors(module))
        optimizers = self.host.optimizers
        self.optimization.step_on_stages(pipeline, optimizers, device, by_name=True)
        self.optimization.stand_in(optimizers)
        if module is not None:  # the coordinator: its Trainer heals a joining torchft group's (`Replicas.follow`)
            self.replicas.follow(module.trainer)

    @override
    def continue_from(self, destination: Destination) -> None:
        """Nothing: each process's LightningModule holds its own stage's trained tensors."""

    @override
    def install(self, patches: Patches) -> None:
        """This process's stage trains the LightningModule's own tensors, in its stage thread, and Lightning posts it
        the optimizer step without waiting. Before validation Lightning frees the module's gradients from the loop's
        thread (``on_validation_model_zero_grad``): the stages first finish what was posted to them, or the step
        would lose gradients it is reading."""
        module, builder = self.state.module, self.builder
        release = module.on_validation_model_zero_grad  # the user's override, or Lightning's

        def after_the_stages() -> None:
            if builder.pipeline is not None:
                builder.pipeline.flush()
            release()

        patches.set(module, "on_validation_model_zero_grad", after_the_stages)

    @override
    def keep_stages(self) -> None:
        """Nothing: each process keeps its last stage worker for a checkpoint after the fit (`ProcessStage`)."""

    @override
    def fold_back(self) -> None:
        """Nothing: each process's LightningModule holds its own stage's trained tensors already."""

    # the training state: every process reads and writes its own stage, nothing is gathered
    @override
    def load_checkpoint(self, path: Any, weights_only: bool | None, lightning: Callable[..., Any]) -> dict[str, Any]:
        """Opened part by part: each process reads its own stage."""
        return self.state.open_checkpoint(path, weights_only)

    @override
    def load_optimizer_state(self, checkpoint: Any) -> None:
        self.state.load_stage_optimizer_states(checkpoint)

    @override
    def module_state(self, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return self.state.shapes()  # each process writes its own stage (`save_checkpoint`): the hooks see shapes

    @override
    def optimizer_state(self, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return {}  # as above: the stages write their own

    @override
    def random_state(self, stages: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """Not asked: each process's part of a checkpoint holds its own stages' (`LaunchedCheckpoints`), so a save
        does not wait for every process to end the step first; asked where Lightning writes one file (no
        LightningModule attached)."""
        if self.host.lightning_module is None:
            return stages()
        return {"stages": IN_PARTS}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path, storage_options: Any, lightning: Write) -> None:
        """Every process writes its part (`LaunchedCheckpoints.save`); with no LightningModule attached, Lightning
        writes one file from global rank 0."""
        if self.host.lightning_module is None:
            self.file.save(checkpoint, path, storage_options, lightning)
        else:
            self.checkpoints.save(checkpoint, path)

    @override
    def remove_checkpoint(self, path: Path, lightning: Write) -> None:
        if self.layout.global_rank == 0:  # once the checkpoint replacing it is published
            self.writes.then(lambda: self.state.remove(path, lightning))
        else:
            lightning(path)  # Lightning's removal: on global rank 0 only

    @override
    def end_fit(self, error: BaseException | None = None) -> None:
        self.writes.finish(error)
