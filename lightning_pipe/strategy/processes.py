"""`ProcessStrategy`: the processes of a pipelined run as Lightning sees them.

Lightning asks a strategy about its processes through methods of the strategy itself: the ranks
(``set_world_ranks``), the launcher, the environment, the data sampler, ``world_size`` and the collectives
(``reduce``, ``barrier``, ``broadcast``, ``all_gather``, ``reduce_boolean_decision``). `ProcessStrategy`
answers them from the mode rule (`lightning_pipe.strategy.layout`) and, in launched mode, from the
`LaunchedWorld` it holds; `PipeStrategy` extends it with the pipeline. It owns everything it reads.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.arguments import check_launched
from lightning_pipe.strategy.launched import LaunchedWorld, PipeLauncher
from lightning_pipe.strategy.layout import LAUNCHED, LOCAL, Layout, choose_mode
from lightning_pipe.strategy.stage_placement import ProcessStage


class ProcessStrategy(ParallelStrategy):
    """A ParallelStrategy whose Lightning loop runs in one process, or on each pipeline replica's coordinator.

    Args: see `PipeStrategy` (``stages``, ``devices`` as ``stage_devices``, ``transport``, ``virtual_stages``,
    ``runner``, ``timeout``); ``asynchronous``: whether the schedule is ``"async"`` (not in launched mode).
    """

    def __init__(
        self,
        stages: int | None,
        stage_devices: list[str] | None,
        transport: str | None,
        virtual_stages: int,
        runner: str,
        timeout: float,
        asynchronous: bool,
        stage: ProcessStage,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.stages = stages
        self.stage_devices = stage_devices
        self.transport = transport
        self.virtual_stages = virtual_stages
        self.runner = runner
        self.timeout = timeout
        self.num_nodes = 1  # set by Lightning's connector from Trainer(num_nodes=...)
        #: launched mode: this process's place among the processes, made when Lightning sets the ranks
        self.world: LaunchedWorld | None = None
        self.stage = stage  # launched mode: this process's part of the model
        self._asynchronous = asynchronous
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
    def mode(self) -> str:
        """``"local"``, ``"rpc"`` or ``"launched"`` (see `lightning_pipe.strategy.layout`)."""
        return choose_mode(self.transport, self.processes)

    @property
    def launched(self) -> bool:
        return self.mode == LAUNCHED

    @property
    def layout(self) -> Layout | None:
        """Launched mode: the processes, replicas and pipeline ranks (None in one process)."""
        return self.world.layout if self.world is not None else None

    def set_world_ranks(self) -> None:  # called by Lightning's connector (as on DDPStrategy)
        environment = self.cluster_environment
        if not self.launched:
            if environment is not None:
                environment.set_global_rank(0)
                environment.set_world_size(1)
            return
        check_launched(self.processes, self.stage_devices, self.runner, self._asynchronous)
        assert self.parallel_devices is not None and environment is not None
        devices = self.parallel_devices
        global_rank = self.node_rank * len(devices) + self.local_rank
        stages = self.stages or len(devices)
        layout = Layout.of(
            self.processes, global_rank, stages, self.virtual_stages, len(devices), self.rank_placement()
        )
        if self.world is None or (self.world.layout, self.world.devices) != (layout, devices):
            self.world = LaunchedWorld(layout, devices, self.timeout, self.runner, self.virtual_stages, self.stage)
        environment.set_global_rank(global_rank)
        environment.set_world_size(self.processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = global_rank  # type: ignore[attr-defined]

    @override
    def _configure_launcher(self) -> None:
        if self.world is not None:
            assert self.cluster_environment is not None
            serve = None if self.world.layout.coordinates else self.serve_stages
            devices = len(self.parallel_devices or [None])
            self._launcher = PipeLauncher(self.cluster_environment, devices, self.num_nodes, serve)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.world is not None:
            self.world.connect(self.cluster_environment)
        if not self._mode_logged:
            self._mode_logged = True
            where = "threads of this process" if self.mode == LOCAL else "rpc worker processes"
            local = f"PipeStrategy: {self.mode} mode, one Lightning process, stages in {where}"
            rank_zero_info(self.world.describe() if self.world is not None else local)

    def serve_stages(self, trainer: Any = None) -> None:
        """What a process that does not coordinate runs instead of the Trainer's loop."""
        assert self.world is not None
        self.setup_environment()
        self.world.serve()

    def rank_placement(self) -> str:
        """Which rank holds each stage (`lightning_pipe.schedule.placement`); `PipeStrategy` answers its schedule's."""
        return LOOP

    def resolve_devices(self) -> list[str]:
        """One device per stage, from ``devices``, the Trainer's devices or cpu."""
        if self.stage_devices is not None:
            return self.stage_devices
        if self.world is not None:  # launched mode: a stage per process of this replica's pipeline
            return self.world.stage_devices(self.rank_placement())
        trainer_devices = [str(d) for d in (self.parallel_devices or [torch.device("cpu")])]
        if all(d == "cpu" for d in trainer_devices):
            return ["cpu"] * (self.stages or len(trainer_devices))
        stages = self.stages or len(trainer_devices)
        if stages > len(trainer_devices):
            raise ConfigurationError(
                f"stages={stages} but the Trainer has {len(trainer_devices)} devices ({', '.join(trainer_devices)}); "
                "pass devices=[...] with one device per stage (stages may share a device)"
            )
        return trainer_devices[:stages]

    # Lightning's collectives: among the coordinators in launched mode, nothing to agree on in one process
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Each replica reads its own shard of the data; the ranks of one pipeline read none (they serve)."""
        if self.layout is None:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.layout.replicas, "rank": self.layout.replica}

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector: a distributed sampler over the replicas in launched mode."""
        return self.world is not None

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """1 in launched mode, as Lightning's loop must see it.

        Lightning's training loop broadcasts a SIGTERM flag over the whole torch.distributed world
        before every batch when ``world_size > 1``; the processes that serve a stage do not run that
        loop and cannot join it. The strategy's own collectives (``reduce``, ``barrier``, ``broadcast``,
        ``all_gather``, ``reduce_boolean_decision``) span the coordinators, one per replica; ``layout``
        holds the real numbers (``layout.world_size`` processes, ``layout.replicas`` replicas).
        """
        if self.world is not None:
            return 1
        return super().world_size

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return self.world.reduce_boolean_decision(decision, all) if self.world is not None else decision

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self.world.reduce(tensor, group, reduce_op) if self.world is not None else tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if self.world is not None:
            self.world.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.world.broadcast(obj, src) if self.world is not None else obj

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return self.world.all_gather(tensor, group, sync_grads) if self.world is not None else tensor
