"""`ProcessStrategy`: the processes of a pipelined run as Lightning sees them.

Lightning asks a strategy about its processes through methods of the strategy itself: the ranks
(``set_world_ranks``), the launcher, the environment, the data sampler, ``world_size`` and the collectives
(``reduce``, ``barrier``, ``broadcast``, ``all_gather``, ``reduce_boolean_decision``). `ProcessStrategy`
answers them from the mode rule (`lightning_pipe.strategy.layout`) and, in launched mode, from the
`LaunchedMode` it holds; `PipeStrategy` extends it with the pipeline. It owns everything it reads.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.arguments import check_launched, fsdp_without_replicas
from lightning_pipe.strategy.config import PipeConfig
from lightning_pipe.strategy.launched import LaunchedMode
from lightning_pipe.strategy.layout import LAUNCHED, RPC, Layout, choose_mode
from lightning_pipe.strategy.mode import LocalMode, Mode, RpcMode
from lightning_pipe.strategy.stage_placement import ProcessStage


class ProcessStrategy(ParallelStrategy):
    """A ParallelStrategy whose Lightning loop runs in one process, or on each pipeline replica's coordinator.

    Args: ``config`` (the strategy's arguments, `PipeConfig`: ``stages``, ``stage_devices``, ``transport``,
    ``virtual_stages``, ``runner``, ``timeout``, ``asynchronous`` are read here); ``stage``: launched mode's
    part of the model in this process.
    """

    def __init__(
        self,
        config: PipeConfig,
        stage: ProcessStage,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.config = config
        self.num_nodes = 1  # set by Lightning's connector from Trainer(num_nodes=...)
        self.stage = stage  # launched mode: this process's part of the model
        self._mode: Mode | None = None  # chosen when Lightning sets the ranks (`set_world_ranks`)
        self._mode_logged = False

    # the processes: Lightning's connector calls these when the Trainer is built
    @property
    def processes(self) -> int:
        """How many processes the run has: devices x num_nodes, or the ``WORLD_SIZE`` of torchrun or SLURM."""
        count = len(self.parallel_devices or [None]) * self.num_nodes
        environment = self.cluster_environment
        if environment is not None and environment.creates_processes_externally:
            count = max(count, environment.world_size())
        return count

    @property
    def mode(self) -> Mode:
        """The mode this run is in (`lightning_pipe.strategy.mode`), chosen when Lightning sets the ranks."""
        if self._mode is None:
            self._mode = self._choose_mode()
        return self._mode

    @property
    def world(self) -> LaunchedMode | None:
        """Launched mode's world in this process (None in one process)."""
        return self.mode if isinstance(self.mode, LaunchedMode) else None

    @property
    def layout(self) -> Layout | None:
        """Launched mode: the processes, replicas and pipeline ranks (None in one process)."""
        return self.mode.layout

    def _choose_mode(self) -> Mode:
        """The mode of ``transport`` and the number of processes (`layout.choose_mode`); launched mode's world is
        kept while the layout and devices stay the same (it holds the process groups and transport)."""
        config = self.config
        name = choose_mode(config.transport, self.processes)
        if name != LAUNCHED:
            return RpcMode() if name == RPC else LocalMode()
        check_launched(self.processes, config.stage_devices, config.runner, config.asynchronous)
        assert self.parallel_devices is not None
        devices = self.parallel_devices
        global_rank = self.node_rank * len(devices) + self.local_rank
        stages = config.stages or len(devices)
        layout = Layout.of(
            self.processes, global_rank, stages, config.virtual_stages, len(devices), self.rank_placement(),
            config.tensor_parallel,
        )  # fmt: skip
        held = self._mode
        if isinstance(held, LaunchedMode) and (held.layout, held.devices) == (layout, devices):
            return held
        return LaunchedMode(layout, devices, config, self.stage)

    def set_world_ranks(self) -> None:  # called by Lightning's connector (as on DDPStrategy)
        self._mode = self._choose_mode()
        self._mode.set_ranks(self.cluster_environment)
        if self.world is not None:
            rank_zero_only.rank = utils_rank_zero_only.rank = self.world.layout.global_rank  # type: ignore[attr-defined]

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        devices = len(self.parallel_devices or [None])
        self._launcher = self.mode.launcher(self.cluster_environment, devices, self.num_nodes, self.serve_stages)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.mode.connect(self.cluster_environment)
        if self.world is not None and self.lightning_module is not None:  # for configure_model, as Lightning's
            self.lightning_module._device_mesh = self.world.device_mesh  # ModelParallelStrategy gives it
        self.mode.hold()  # launched mode: the serving ranks serve this fit from now on, whatever fails before setup
        if not self._mode_logged:
            self._mode_logged = True
            rank_zero_info(self.mode.describe())
            replicas = self.layout.replicas if self.layout is not None else 1
            alone = fsdp_without_replicas(self.stage.data_parallel, self.mode.name, replicas)
            if alone is not None:
                rank_zero_warn(alone)

    def serve_stages(self, trainer: Any = None) -> None:
        """What a process that does not coordinate runs instead of the Trainer's loop (after `setup_environment`)."""
        assert self.world is not None
        self.world.serve()

    @property
    def device_mesh(self) -> Any:
        """Launched mode's DeviceMesh (as ``ModelParallelStrategy.device_mesh``; the LightningModule's
        ``self.device_mesh``): dims ``data_parallel`` x ``pipeline`` (x ``tensor_parallel`` with tensor parallel)."""
        if self.world is None:
            raise ConfigurationError(
                "PipeStrategy.device_mesh exists in launched mode (devices x num_nodes > 1), after the processes "
                "joined (from configure_model on)"
            )
        return self.world.device_mesh

    def rank_placement(self) -> str:
        """Which rank holds each stage (`lightning_pipe.schedule.placement`); `PipeStrategy` answers its schedule's."""
        return LOOP

    def resolve_devices(self) -> list[str]:
        """One device per stage: launched mode's processes (placed as the schedule says), or from ``devices``,
        the Trainer's devices or cpu."""
        return self.mode.stage_devices(self._given_devices, self.rank_placement())

    def _given_devices(self) -> list[str]:
        if self.config.stage_devices is not None:
            return self.config.stage_devices
        trainer_devices = [str(d) for d in (self.parallel_devices or [torch.device("cpu")])]
        if all(d == "cpu" for d in trainer_devices):
            return ["cpu"] * (self.config.stages or len(trainer_devices))
        stages = self.config.stages or len(trainer_devices)
        if stages > len(trainer_devices):
            raise ConfigurationError(
                f"stages={stages} but the Trainer has {len(trainer_devices)} devices ({', '.join(trainer_devices)}); "
                "pass devices=[...] with one device per stage (stages may share a device)"
            )
        return trainer_devices[:stages]

    # Lightning's collectives: among the coordinators in launched mode, nothing to agree on in one process
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.mode.sampler_kwargs

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector: a distributed sampler over the replicas in launched mode."""
        return self.mode.distributed

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """What Lightning's loop sees: 1 in launched mode (`LaunchedMode.world_size` says why)."""
        return self.mode.world_size(super().world_size)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return self.mode.reduce_boolean_decision(decision, all)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self.mode.reduce(tensor, group, reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        self.mode.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.mode.broadcast(obj, src)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return self.mode.all_gather(tensor, group, sync_grads)
