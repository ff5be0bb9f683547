"""`Mode`: what differs between local, rpc and launched mode, behind one small interface.

Lightning chooses behaviour by class (DDP, FSDP, ModelParallel); `PipeStrategy` is one class whose
hooks ask its mode, chosen once when Lightning sets the world's ranks (`lightning_pipe.strategy.modes.mode_choice`).
A mode answers: how many processes Lightning's loop sees and which share of the data each reads, the
collectives among them, the coordinator's device and the stages' devices, which transport the pipeline's
stages use, where the stages' parameters and the optimizers' state live, how the training state is written
(`lightning_pipe.strategy.model_state`), and what a fit's start and end mean for the processes.
`LocalMode` (here) and `lightning_pipe.strategy.modes.rpc_mode.RpcMode` run Lightning's loop in one process
(every collective is the identity); `lightning_pipe.strategy.modes.launched_mode.LaunchedMode` spans the processes that
Lightning's launchers start (DDP or FSDP over its replicas: its ``data_parallel``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.background import writes_for
from lightning_pipe.comm import Communicator
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.arguments import fsdp_without_replicas
from lightning_pipe.strategy.building import Destination
from lightning_pipe.strategy.layout import LOCAL, Layout
from lightning_pipe.strategy.model_state import ModelState
from lightning_pipe.strategy.modes.launched_checkpoints import in_fit, write_file
from lightning_pipe.strategy.patch import Patches
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.unread import folder_in_local_mode
from lightning_pipe.weights import on_meta

Write = Callable[..., None]  # Lightning's own way of writing or removing a checkpoint (the strategy's base class's)


class Mode:
    """One Lightning process, stages wherever its transport puts them: the defaults every mode starts from.

    ``config``: the strategy's arguments (``transport``, ``stages``, ``devices``, ``data_parallel`` are read).
    """

    name: ClassVar[str]
    #: the stages hold their own parameters and optimizer state (workers, other processes), not the module's
    stages_own_parameters: ClassVar[bool] = True

    def __init__(self, config: PipeConfig) -> None:
        self.config = config
        self._described = False  # the line saying what runs is logged once
        self.writes = writes_for(config.async_checkpoint)  # this process's checkpoint write in flight

    def start(self, environment: Any, lightning_module: Any = None, checkpoint_io: Any = None) -> None:
        """Lightning sets up the environment (each fit): join the processes (`connect`), give the LightningModule
        their `device_mesh` for ``configure_model`` (as Lightning's ``ModelParallelStrategy`` does), hold the serving
        ranks for this fit (whatever fails before setup), and say once what runs and which arguments it does not read
        (`lightning_pipe.strategy.unread`; ``checkpoint_io``: the strategy's)."""
        self.connect(environment)
        mesh = self.device_mesh
        if mesh is not None and lightning_module is not None:
            lightning_module._device_mesh = mesh
        self.hold()
        if not self._described:
            self._described = True
            rank_zero_info(self.describe())
            alone = self.fsdp_warning()
            for said in [alone, *self.unread(checkpoint_io)]:
                if said is not None:
                    rank_zero_warn(said)

    def unread(self, checkpoint_io: Any) -> list[str | None]:
        """The warnings for the arguments this mode does not read (`lightning_pipe.strategy.unread`; ``checkpoint_io``:
        the strategy's); None where one does not apply."""
        return []

    @property
    def layout(self) -> Layout | None:
        """The processes, replicas and pipeline ranks of launched mode; None in one process."""
        return None

    def describe(self) -> str:
        """The line logged once when the run starts."""
        return f"PipeStrategy: {self.name} mode, one Lightning process"

    def set_ranks(self, environment: Any) -> None:
        """Lightning's connector sets the world's ranks: this process is the only one Lightning sees."""
        if environment is not None:
            environment.set_global_rank(0)
            environment.set_world_size(1)

    def connect(self, environment: Any) -> None:
        """Lightning sets up the environment: join whatever the mode's processes share (nothing here)."""

    @property
    def device_mesh(self) -> Any:
        """The DeviceMesh of the mode's processes, for ``configure_model`` (None: one process, no mesh)."""
        return None

    def joined_mesh(self) -> Any:
        """`device_mesh`, or an error naming when it exists."""
        if self.device_mesh is None:
            raise ConfigurationError(
                "PipeStrategy.device_mesh exists in launched mode (devices x num_nodes > 1), after the processes "
                "joined (from configure_model on)"
            )
        return self.device_mesh

    def launcher(self, environment: Any, devices: int, num_nodes: int, serve: Callable[[Any], None]) -> Any:
        """Lightning's launcher for this mode (None: Lightning's loop runs in this process only)."""
        return None

    def world_size(self, lightning: int) -> int:
        """The world size Lightning's loop sees (``lightning``: what Lightning's own reckoning gives)."""
        return lightning

    @property
    def sampler_kwargs(self) -> dict[str, Any]:
        """Which share of the data this process's loop reads (Lightning's distributed sampler)."""
        return {"num_replicas": 1, "rank": 0}

    @property
    def distributed(self) -> bool:
        """Whether Lightning's connector gives the loop a distributed sampler."""
        return False

    def root_device(self, placed: Callable[[], torch.device]) -> torch.device:
        """The coordinator's device (``placed``: where the strategy's placement puts the last stage's output)."""
        return placed()

    def stage_devices(self, trainer_devices: Sequence[torch.device] | None = None, placement: str = LOOP) -> list[str]:
        """One device per stage: ``devices=``, else the Trainer's devices (``trainer_devices``), or cpu for every
        stage (``placement``, which rank holds each stage, places them in launched mode)."""
        config = self.config
        if config.stage_devices is not None:
            return config.stage_devices
        names = [str(d) for d in (trainer_devices or [torch.device("cpu")])]
        stages = config.stages or len(names)
        if all(d == "cpu" for d in names):
            return ["cpu"] * stages
        if stages > len(names):
            raise ConfigurationError(
                f"stages={stages} but the Trainer has {len(names)} devices ({', '.join(names)}); "
                "pass devices=[...] with one device per stage (stages may share a device)"
            )
        return names[:stages]

    def transport(self) -> str | Communicator:
        """The pipeline's transport: the strategy's ``transport`` here."""
        return self.config.transport or LOCAL

    def fsdp_warning(self) -> str | None:
        """The warning for ``data_parallel="fsdp"`` where no stage has a second replica to shard over."""
        return fsdp_without_replicas(self.config.data_parallel, f"{self.name} mode", 1)

    # a fit
    def hold(self) -> None:
        """A fit (or validate, test, predict) starts."""

    def release(self, error: BaseException | None = None) -> None:
        """It ended (with ``error`` if it failed)."""

    # where the stages and the optimizers live
    def built(self, state: ModelState, pipeline: Pipeline, device: torch.device) -> None:
        """A pipeline was built: each optimizer steps the stages' parameters where they live (here: on the stages,
        each optimizer with its per-stage parts)."""
        state.optimization.step_on_stages(pipeline, state.host.optimizers, device, by_name=False)

    def continue_from(self, state: ModelState, destination: Destination) -> None:
        """At setup, after `ModelState.prepare`: where a later run of a module an earlier run here trained finds the
        values its stages start from, where the module does not hold them (``destination.init``)."""

    def install(self, state: ModelState, patches: Patches) -> None:
        """At setup, after the optimizers: what this mode sets on the user's objects for the fit."""

    def keep_stages(self, state: ModelState) -> None:
        """At teardown, before the stages stop: what the checkpoints written after the fit need of them."""

    def fold_back(self, state: ModelState) -> None:
        """Before the stages stop: the LightningModule and its optimizers end up trained, as usual, where the
        module has values to take them (one built on meta keeps none)."""
        module = state.host.lightning_module
        state.optimization.fold(state.builder.pipeline, module is not None and not on_meta(module))

    # the training state in a checkpoint: one process holds the model, Lightning reads and writes it
    def module_state(self, state: ModelState, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``lightning_module_state_dict``: the LightningModule's state (``lightning``: Lightning's reading)."""
        return state.module_state(lightning)

    def optimizer_state(
        self, state: ModelState, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]
    ) -> dict[str, Any]:
        """``optimizer_state``: ``optimizer``'s state (``lightning``: Lightning's reading)."""
        return state.optimizer_state(optimizer, lightning)

    def save_checkpoint(
        self, state: ModelState, checkpoint: dict[str, Any], path: Path, storage_options: Any, lightning: Write
    ) -> None:
        """``save_checkpoint``: ``checkpoint`` (with the stages' generator states) at ``path``; ``lightning``:
        Lightning's writing, one file, under a temporary name and then published (`write_file`; with
        ``async_checkpoint``, in the background during a fit)."""
        self.writes.wait()
        if not self.first_process:  # Lightning writes a file from global rank 0 only
            lightning(checkpoint, path, storage_options=storage_options)
            return
        write_file(self.writes, lightning, checkpoint, path, storage_options, state.host.checkpoint_io)
        if not in_fit(state.host.lightning_module):
            self.writes.wait()  # no training to overlap: the checkpoint is there when save_checkpoint returns

    @property
    def first_process(self) -> bool:
        """Whether this process is global rank 0: the one that publishes a checkpoint and removes one."""
        return True

    def remove_checkpoint(self, state: ModelState, path: Path, lightning: Write) -> None:
        """``remove_checkpoint``: as Lightning removes it (``lightning``), once the checkpoint being written is
        published."""
        self.writes.then(lambda: lightning(path))

    def end_fit(self, error: BaseException | None = None) -> None:
        """The fit ends: its last checkpoint written and published first (or, after ``error``, left to finish)."""
        if error is None:
            self.writes.wait()
        else:
            self.writes.abandon()

    # Lightning's collectives: nothing to agree on in one process
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision


class LocalMode(Mode):
    """Stages are threads of this process on the Trainer's devices; they share the module's parameters."""

    name = LOCAL
    stages_own_parameters = False

    @override
    def describe(self) -> str:
        return f"{super().describe()}, stages in threads of this process"

    @override
    def unread(self, checkpoint_io: Any) -> list[str | None]:
        return [folder_in_local_mode(self.config)]  # Lightning writes one file

    @override
    def built(self, state: ModelState, pipeline: Pipeline, device: torch.device) -> None:
        """The stages are the LightningModule's modules: parameters they made real replace their meta ones in the
        optimizers."""
        pipelined = state.builder.pipelined
        assert pipelined is not None
        state.optimization.adopt_built(state.host.optimizers, pipelined)
        super().built(state, pipeline, device)
