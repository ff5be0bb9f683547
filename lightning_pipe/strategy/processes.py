"""`Processes`: the processes of a run, as Lightning's connector and launcher ask the strategy about them.

Lightning's connector sets the world's ranks (`Processes.set_ranks`): the mode is chosen then, from the devices,
the nodes and the cluster environment (`lightning_pipe.strategy.modes.mode_choice`); its launcher starts the processes
(`launcher`); each fit sets up the environment (`start`: the accelerator's device, then the mode joins the
processes), and a process that serves a stage binds its model before it serves (`prepare_to_serve`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.strategy.building import PipelineBuilder
from lightning_pipe.strategy.model_state import ModelState
from lightning_pipe.strategy.modes.mode import Mode
from lightning_pipe.strategy.modes.mode_choice import mode_of, process_count
from lightning_pipe.strategy.modes.mode_parts import ModeParts
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.process_stage import ProcessStage


class StrategyView(Protocol):
    """What the processes read of the strategy: Lightning's view of the world, set by its connector."""

    @property
    def parallel_devices(self) -> list[torch.device] | None: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def cluster_environment(self) -> Any: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def accelerator(self) -> Any: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def lightning_module(self) -> Any: ...

    @property
    def precision_plugin(self) -> Any: ...

    @property
    def checkpoint_io(self) -> Any: ...

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]: ...

    def setup_environment(self) -> None: ...

    def resolve_devices(self) -> list[str]: ...


class Processes:
    """The mode of this run's processes (chosen when Lightning sets the ranks), its launcher, and what each fit
    sets up in every process. ``host``: the strategy; ``builder``, ``stage``, ``state``: its parts that a process
    needs to place and serve its stages."""

    def __init__(
        self, host: StrategyView, config: PipeConfig, builder: PipelineBuilder, stage: ProcessStage, state: ModelState
    ) -> None:
        self.host = host
        self.config = config
        self.builder = builder
        self.stage = stage
        self.state = state
        #: what a mode holds of the strategy (given to each mode made)
        self.parts = ModeParts(host, state, builder, state.optimization, stage)
        self._mode: Mode | None = None  # chosen when Lightning sets the ranks (`set_ranks`)
        self._described: Mode | None = None  # the mode whose line saying what runs was logged

    @property
    def mode(self) -> Mode:
        if self._mode is None:
            self._mode = self._choose()
        return self._mode

    def _choose(self) -> Mode:
        host = self.host
        devices, placement = host.parallel_devices, self.builder.selection.rank_placement
        processes = process_count(devices, host.num_nodes, host.cluster_environment)  # devices x nodes, or WORLD_SIZE
        global_rank = host.node_rank * len(devices or []) + host.local_rank
        return mode_of(self.config, processes, devices, global_rank, placement, self.parts, self._mode)

    def set_ranks(self) -> None:
        """Lightning's connector sets the ranks: the mode is chosen (again) and sets them."""
        self._mode = self._choose()
        self._mode.set_ranks(self.host.cluster_environment)

    def launcher(self) -> Any:
        """The mode's launcher: a serving process prepares (`prepare_to_serve`) and serves its stage."""
        host = self.host
        assert host.cluster_environment is not None
        devices = len(host.parallel_devices or [None])
        return self.mode.launcher(host.cluster_environment, devices, host.num_nodes, self.prepare_to_serve)

    def start(self) -> None:
        """Each fit's environment: the accelerator sets up the coordinator's device, the mode joins the processes
        (launched: the device mesh for ``configure_model``, the serving ranks held)."""
        host = self.host
        assert host.accelerator is not None  # Lightning's: the accelerator sets up the root device (or its own kind's)
        root, trainer_devices = host.root_device, host.parallel_devices
        host.accelerator.setup_device(self.builder.accelerator_device(root, trainer_devices, host.resolve_devices()))
        self._start(host.cluster_environment, host.lightning_module, host.checkpoint_io)

    def _start(self, environment: Any, lightning_module: Any, checkpoint_io: Any) -> None:
        """The mode joins the processes (`Mode.connect`), the LightningModule gets their `device_mesh` for
        ``configure_model`` (as Lightning's ``ModelParallelStrategy`` does), the serving ranks are held for this fit
        (whatever fails before setup), and what runs and which arguments it does not read is said once per mode
        (`lightning_pipe.strategy.unread`; ``checkpoint_io``: the strategy's)."""
        mode = self.mode
        mode.connect(environment)
        mesh = mode.device_mesh
        if mesh is not None and lightning_module is not None:
            lightning_module._device_mesh = mesh
        mode.hold()
        if self._described is not mode:
            self._described = mode
            rank_zero_info(mode.describe())
            for said in [mode.fsdp_warning(), *mode.unread(checkpoint_io)]:
                if said is not None:
                    rank_zero_warn(said)

    def joined_mesh(self) -> Any:
        """The mode's `device_mesh`, or an error naming when it exists."""
        mesh = self.mode.device_mesh
        if mesh is None:
            raise ConfigurationError(
                "PipeStrategy.device_mesh exists in launched mode (devices x num_nodes > 1), after the processes "
                "joined (from configure_model on)"
            )
        return mesh

    def prepare_to_serve(self, trainer: Any = None) -> None:
        """A process that serves a stage instead of running the Trainer's loop: processes joined (the device mesh
        exists when configure_model runs, as in the coordinator's fit), its model bound."""
        self.host.setup_environment()
        self.state.bind_to_serve(trainer, self.host.precision_plugin.convert_module)
