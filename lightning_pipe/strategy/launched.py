"""Launched mode: R pipeline replicas x P ranks in the processes that Lightning's launchers start.

Lightning starts the processes as it does for DDP: its own subprocess launcher (``python train.py``
with ``devices=K``), or none when ``torchrun`` or SLURM started them (the cluster environments it
detects). `PipeLauncher` is that launcher with one change: the processes that do not coordinate a
pipeline (all but the first of each replica's block) serve their stage instead of running the
Trainer's loop, and return from ``fit`` / ``validate`` / ``test`` / ``predict`` when their coordinator
ends it. The coordinators (the first process of each replica, holding its last stage) run the loop,
the user's step and that stage; Lightning's collectives (logging with ``sync_dist``, checkpoint
decisions, barriers) span the coordinators only.

Process groups (torch's `DeviceMesh`, dims ``("replica", "pipeline")``): a pipeline's P ranks carry its
activations and gradients point to point (`lightning_pipe.comm.p2p`); the R ranks of one stage average
its gradients (`lightning_pipe.engine.replicas`, DDP); the coordinators get a group of their own, so that
Lightning's collectives never interleave with a stage's on one group.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import init_device_mesh
from typing_extensions import override

from lightning_pipe.comm import P2PCommunicator, serve_stages
from lightning_pipe.comm.p2p_wire import close_open_wires
from lightning_pipe.engine.runners import worker_of_stages
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.strategy.layout import LAUNCHED, LOCAL, Layout, choose_mode

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy as _Strategy
else:
    _Strategy = object

PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)  # Lightning's default: serving ranks wait this long between fits


class ProcessGroups:
    """The groups of one layout, made once per process (every process makes them, in the same order).

    They serve every fit of the process, and Lightning's collectives between fits (a ``save_checkpoint``
    after ``fit``) run on the coordinators' group, so they live until the interpreter exits: then
    `destroy_all` (an ``atexit`` hook) closes the p2p links still open, destroys the groups and the default
    group if the strategy initialised it, as Lightning does for the NCCL group it initialises. Left to the
    interpreter's own teardown, gloo's threads and pending waits end in whatever order it finalizes.
    """

    _made: dict[tuple[int, int], ProcessGroups] = {}
    _default_made = False  # whether the strategy initialised the default group (then it destroys it)

    def __init__(self, layout: Layout, device_type: str) -> None:
        mesh = init_device_mesh(
            device_type, (layout.replicas, layout.ranks_per_pipeline), mesh_dim_names=("replica", "pipeline")
        )
        self.mesh = mesh
        self.pipeline = mesh.get_group("pipeline")
        self.replicas = mesh.get_group("replica")
        self.coordinators = dist.new_group(layout.coordinator_ranks)

    @classmethod
    def of(cls, layout: Layout, device_type: str) -> ProcessGroups:
        key = (layout.world_size, layout.ranks_per_pipeline)
        if key not in cls._made:
            if not cls._made:
                atexit.register(cls.destroy_all)
            cls._made[key] = cls(layout, device_type)
        return cls._made[key]

    @classmethod
    def made_default_group(cls) -> None:
        """Called right after the strategy initialised the default group."""
        cls._default_made = True

    def destroy(self) -> None:
        """Destroy this layout's groups (a dimension that spans the world is the default group: kept; a process
        outside the coordinators' group holds no such group)."""
        default = dist.distributed_c10d._get_default_group()
        for group in {id(g): g for g in (self.pipeline, self.replicas, self.coordinators)}.values():
            if isinstance(group, dist.ProcessGroup) and group is not default:
                dist.destroy_process_group(group)

    @classmethod
    def destroy_all(cls) -> None:
        """At exit: the p2p links closed (their threads joined), then every group made here destroyed."""
        close_open_wires()
        if not dist.is_initialized():
            return
        made, cls._made = list(cls._made.values()), {}
        for groups in made:
            groups.destroy()
        if cls._default_made:
            cls._default_made = False
            dist.destroy_process_group()


class PipeLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher (a no-op spawn under torchrun or SLURM); serving ranks serve their stage."""

    def __init__(self, strategy: LaunchedMode, cluster_environment: Any, num_processes: int, num_nodes: int) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        layout = self.strategy.layout
        if layout is not None and not layout.coordinates:
            return super().launch(self.strategy.serve_stages)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class LaunchedMode(_Strategy):
    """Mixed into `PipeStrategy`: the mode rule, launched mode's ranks, launcher, process groups and collectives."""

    transport: str | None
    stages: int | None
    virtual_stages: int
    runner: str
    timeout: float
    stage_devices: list[str] | None
    layout: Layout | None = None  # launched mode only
    _groups: ProcessGroups | None = None
    _p2p: P2PCommunicator | None = None
    _mode_logged = False

    _num_nodes = 1

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:  # set by Lightning's connector from Trainer(num_nodes=...)
        self._num_nodes = num_nodes

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

    def set_world_ranks(self) -> None:  # called by Lightning's connector (as on DDPStrategy)
        if not self.launched:
            if self.cluster_environment is not None:
                self.cluster_environment.set_global_rank(0)
                self.cluster_environment.set_world_size(1)
            return
        self._check_launched()
        devices_per_node = len(self.parallel_devices or [None])
        global_rank = self.node_rank * devices_per_node + self.local_rank
        self.layout = Layout.of(
            self.processes, global_rank, self.stages or devices_per_node, self.virtual_stages, devices_per_node
        )
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(global_rank)
            self.cluster_environment.set_world_size(self.processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = global_rank  # type: ignore[attr-defined]

    def _check_launched(self) -> None:
        """What launched mode cannot do fails when the Trainer is built, before any process starts."""
        if self.stage_devices is not None:
            raise ConfigurationError(
                "PipeStrategy(devices=[...]) places the stages of one process; in launched mode "
                f"({self.processes} processes) each process holds its stage on its own device: leave devices out, "
                "or pass transport='local' to run every stage in this process"
            )
        if self.runner == "linear":
            raise ConfigurationError(
                "runner='linear' walks every stage from one thread; in launched mode each process runs its own "
                "stage: use runner='parallel' or 'dataflow', or transport='local'"
            )
        if getattr(self, "_async", None) is not None:
            raise ConfigurationError(
                "PipeStrategy(schedule='async') runs with transport='local' in one process; in launched mode "
                "pick a synchronous schedule such as '1f1b'"
            )

    @override
    def _configure_launcher(self) -> None:
        if self.launched:
            assert self.cluster_environment is not None
            devices = len(self.parallel_devices or [None])
            self._launcher = PipeLauncher(self, self.cluster_environment, devices, self.num_nodes)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Each replica reads its own shard of the data; the ranks of one pipeline read none (they serve)."""
        if self.layout is None:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.layout.replicas, "rank": self.layout.replica}

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector: a distributed sampler over the replicas in launched mode."""
        return self.layout is not None

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """1 in launched mode, as Lightning's loop must see it.

        Lightning's training loop broadcasts a SIGTERM flag over the whole torch.distributed world
        before every batch when ``world_size > 1``; the processes that serve a stage do not run that
        loop and cannot join it. The strategy's own collectives (``reduce``, ``barrier``, ``broadcast``,
        ``all_gather``, ``reduce_boolean_decision``) span the coordinators, one per replica; ``layout``
        holds the real numbers (``layout.world_size`` processes, ``layout.replicas`` replicas).
        """
        if self.layout is not None:
            return 1
        return super().world_size

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        coordinators = self._coordinator_group()
        if coordinators is None:
            return decision
        assert self.layout is not None
        votes = self.reduce(torch.tensor(int(decision), device=self.launched_root_device), reduce_op="sum")
        return bool(votes == self.layout.replicas) if all else bool(votes)

    @property
    def launched_root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    def launched_stage_devices(self, stages: int) -> list[str]:
        """The device of each stage: that of the process holding it in this replica."""
        assert self.layout is not None and self.parallel_devices is not None
        holder = worker_of_stages(self.runner, stages, self.virtual_stages)
        ranks = self.layout.pipeline_ranks()
        return [str(self.parallel_devices[self.layout.local_index(ranks[holder[s]])]) for s in range(stages)]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.layout is None:
            if not self._mode_logged:
                self._mode_logged = True
                where = "threads of this process" if self.mode == LOCAL else "rpc worker processes"
                rank_zero_info(f"PipeStrategy: {self.mode} mode, one Lightning process, stages in {where}")
            return
        device = self.launched_root_device
        if not dist.is_initialized():
            backend = _get_default_process_group_backend_for_device(device)
            assert self.cluster_environment is not None
            _init_dist_connection(self.cluster_environment, backend, timeout=PROCESS_GROUP_TIMEOUT)
            ProcessGroups.made_default_group()
        self._groups = ProcessGroups.of(self.layout, device.type)
        if not self._mode_logged:
            self._mode_logged = True
            layout = self.layout
            rank_zero_info(
                f"PipeStrategy: launched mode, {layout.world_size} processes = {layout.replicas} replica(s) x "
                f"{layout.ranks_per_pipeline} pipeline rank(s); {layout.picture()}"
            )

    def launched_communicator(self) -> P2PCommunicator:
        """The point-to-point transport of this replica's pipeline (one per strategy, reused by every fit)."""
        if self._p2p is None:
            self._p2p = P2PCommunicator(**self._pipeline())
        return self._p2p

    def serve_stages(self) -> None:
        """What a process that does not coordinate runs instead of the Trainer's loop."""
        self.setup_environment()
        serve_stages(**self._pipeline())

    def _pipeline(self) -> dict[str, Any]:
        """This process's pipeline as both sides of the p2p transport take it: group, ranks, names, DDP hook."""
        assert self.layout is not None and self._groups is not None
        on_build = None
        if self.layout.replicas > 1:
            replicas = self._groups.replicas
            on_build = lambda worker: worker.replicate(replicas)  # noqa: E731 - a closure over this group
        return {
            "group": self._groups.pipeline,
            "ranks": self.layout.pipeline_ranks(),
            "describe": self.layout.describe,
            "on_build": on_build,
            "timeout": self.timeout,
            "coordinator": self.layout.coordinator,
        }

    def release_stages(self, error: BaseException | None = None) -> None:
        """End the serving ranks' ``fit`` (with the coordinator's error, if it failed)."""
        if self._p2p is None or self.layout is None:
            return
        text = None
        if error is not None:
            who = self.layout.describe(self.layout.global_rank)
            text = f"its coordinator, {who}, failed: {type(error).__name__}: {error}"
        self._p2p.release(text)

    # Lightning's collectives: among the coordinators (the processes that run Lightning's loop)
    def _coordinator_group(self) -> Any:
        """The coordinators' group; None where there is nothing to agree on (one replica, or a serving rank)."""
        layout = self.layout
        if layout is None or layout.replicas == 1 or self._groups is None or not layout.coordinates:
            return None
        return self._groups.coordinators

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        coordinators = self._coordinator_group()
        if coordinators is None or not isinstance(tensor, torch.Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group or coordinators, reduce_op=reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        coordinators = self._coordinator_group()
        if coordinators is None:
            return
        device = self.launched_root_device
        if device.type == "cuda":
            dist.barrier(group=coordinators, device_ids=[device.index or 0])
        else:
            dist.barrier(group=coordinators)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        coordinators = self._coordinator_group()
        if coordinators is None:
            return obj
        assert self.layout is not None
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
