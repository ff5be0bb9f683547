"""`RpcMode`: one Lightning process; the stages are worker processes of a private RPC world.

Each worker owns its stage's parameters and that stage's optimizer state; the script's process holds the
LightningModule's tensors outside the pipeline. Lightning's loop runs in the script's process alone, so every
collective is the identity. A checkpoint is written where the state lives, by the workers
(`lightning_pipe.strategy.modes.rpc_checkpoints`), never gathered; after a fit of a model built eagerly the script's
process holds the trained values again and Lightning writes them as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.background import CheckpointWrites
from lightning_pipe.comm import Communicator
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.building import Destination
from lightning_pipe.strategy.layout import RPC, Layout
from lightning_pipe.strategy.modes.mode import Collectives, Mode, Write
from lightning_pipe.strategy.modes.mode_parts import ModeParts
from lightning_pipe.strategy.modes.one_process import OneProcess
from lightning_pipe.strategy.modes.rpc_checkpoints import RpcCheckpoints, trained_folder
from lightning_pipe.strategy.modes.whole_file import WholeFile
from lightning_pipe.strategy.patch import Patches
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.unread import checkpoint_io_unused, synchronous_in_rpc_mode
from lightning_pipe.weights import StageInit, on_meta


class RpcMode(Mode):
    """Stages are worker processes of a private RPC world; each owns its stage's parameters and optimizer.

    ``config``: the strategy's arguments; ``parts``: the strategy's parts this mode works with.
    """

    name = RPC

    def __init__(self, config: PipeConfig, parts: ModeParts) -> None:
        self.config = config
        self.host, self.state, self.builder = parts.host, parts.state, parts.builder
        self.optimization = parts.optimization
        self.alone = OneProcess(self.name, config)
        self.checkpoints = RpcCheckpoints()  # the checkpoints the workers write, and what a fit left for them
        self.writes = CheckpointWrites()  # the workers write synchronously (`save_checkpoint`)
        self.file = WholeFile(self.writes, parts.host)  # no stage worker holds a fit's stages: Lightning writes

    # the processes: this one, and the workers it starts for each fit
    @override
    def describe(self) -> str:
        return self.alone.describe("rpc worker processes")

    @override
    def unread(self, checkpoint_io: Any) -> list[str | None]:
        writers = "the stage workers write their own stages during and after a fit (a folder, or one file made of it)"
        return [checkpoint_io_unused(self.name, writers, checkpoint_io), synchronous_in_rpc_mode(self.config)]

    @override
    def fsdp_warning(self) -> str | None:
        return self.alone.fsdp_warning()

    @property
    @override
    def layout(self) -> Layout | None:
        return None

    @override
    def set_ranks(self, environment: Any) -> None:
        self.alone.set_ranks(environment)

    @override
    def launcher(self, environment: Any, devices: int, num_nodes: int, serve: Callable[[Any], None]) -> Any:
        """None: the pipeline starts its worker processes itself, in each fit."""
        return None

    @override
    def connect(self, environment: Any) -> None:
        """Nothing to join: the pipeline opens its private RPC world when it is built."""

    @property
    @override
    def device_mesh(self) -> Any:
        return None

    @override
    def world_size(self, lightning: int) -> int:
        return lightning

    @property
    @override
    def sampler_kwargs(self) -> dict[str, Any]:
        return self.alone.sampler_kwargs

    @property
    @override
    def distributed(self) -> bool:
        return False

    @override
    def root_device(self, placed: Callable[[], torch.device]) -> torch.device:
        return placed()

    @override
    def stage_devices(self, trainer_devices: Sequence[torch.device] | None = None, placement: str = LOOP) -> list[str]:
        return self.alone.stage_devices(trainer_devices)

    @override
    def transport(self) -> str | Communicator:
        """The strategy's ``transport``: ``"rpc"``."""
        return self.config.transport or RPC

    @property
    @override
    def collectives(self) -> Collectives:
        return self.alone.collectives

    @override
    def hold(self) -> None:
        """Nothing held: the workers start with the pipeline."""

    @override
    def release(self, error: BaseException | None = None) -> None:
        """Nothing to release: the workers stop with the pipeline."""

    # where the stages and the optimizers live: each worker its own stage's
    @override
    def prepare_optimization(self, outside: Iterable[nn.Parameter]) -> None:
        """Lightning's optimizers step the workers' parameters, on the stages."""
        self.optimization.setup(outside)
        self.optimization.step_stages()

    @override
    def built(self, pipeline: Pipeline, device: torch.device) -> None:
        """Each optimizer steps the stages' parameters with its per-stage parts."""
        self.optimization.step_on_stages(pipeline, self.host.optimizers, device, by_name=False)

    @override
    def install(self, patches: Patches) -> None:
        """Nothing: Lightning's hooks run as they do without a pipeline."""

    @override
    def keep_stages(self) -> None:
        """At the end of a fit of a model built on meta: the workers write their trained stages for the checkpoints
        written after it (before they stop; `RpcCheckpoints.keep`)."""
        pipeline, module = self.builder.pipeline, self.host.lightning_module
        stage_params = self.optimization.stage_params
        trained = stage_params is not None and bool(stage_params.views)  # a fit (validate etc. keep the last fit's)
        if not trained or pipeline is None or module is None:
            return
        self.checkpoints.forget()  # the last fit's
        if on_meta(module):
            prefix = self.state.prefix()
            under = Path(module.trainer.default_root_dir)
            self.checkpoints.keep(module, pipeline, prefix, self.state.coordinator_part(prefix), under)

    @override
    def fold_back(self) -> None:
        """The stages' trained values and optimizer state fold back into the LightningModule and its optimizers,
        where the module has values to take them (one built on meta keeps none)."""
        module = self.host.lightning_module
        self.optimization.fold(self.builder.pipeline, module is not None and not on_meta(module))

    @override
    def continue_from(self, destination: Destination) -> None:
        """A module built on meta that an earlier rpc fit here trained holds none of its stages' values (its workers
        wrote them to a folder as they stopped, `RpcCheckpoints.keep`): a later run without a checkpoint or weights
        starts its stages from that folder, as a module built eagerly starts from the values it holds."""
        module, init = self.state.module, destination.init
        kept = trained_folder(module)
        if kept is None or init is None or init.path is not None or not on_meta(self.builder.split_module):
            return
        destination.init = StageInit(path=str(kept), checkpoint=True, prefix=self.state.prefix(), seed=init.seed,
                                   overwrite=False, strict=True)  # fmt: skip

    # the training state: each worker reads and writes its own stage, this process the rest
    @override
    def load_checkpoint(self, path: Any, weights_only: bool | None, lightning: Callable[..., Any]) -> dict[str, Any]:
        """Opened part by part: each worker reads its own stage."""
        return self.state.open_checkpoint(path, weights_only)

    @override
    def load_optimizer_state(self, checkpoint: Any) -> None:
        self.state.load_stage_optimizer_states(checkpoint)

    @override
    def module_state(self, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if self._workers_write(check_meta=False):
            return self.state.shapes()  # each worker writes its own stage (`save_checkpoint`): the hooks see shapes
        return self.state.module_state(lightning)

    @override
    def optimizer_state(self, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        if self._workers_write(check_meta=False):
            return {}  # as above: the stages write their own
        return self.state.optimizer_state(optimizer, lightning)

    @override
    def random_state(self, stages: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        return stages()  # in Lightning's state: the workers write their tensors step by step (rpc_checkpoints)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path, storage_options: Any, lightning: Write) -> None:
        """The workers write their stages and this process the rest, into one folder (or one file of it), while a
        fit runs or from what the last fit of a model built on meta left; else Lightning writes the whole model."""
        if self.host.lightning_module is None or not self._workers_write(check_meta=True):
            self.file.save(checkpoint, path, storage_options, lightning)
            return
        state = self.state
        prefix = state.prefix()
        single_file = self.config.save_distributed_checkpoint is False  # None (the default) or True: a folder
        edits = state.save_edits(checkpoint)
        part = state.coordinator_part(prefix, edits)
        self.checkpoints.save(checkpoint, path, prefix, part, self.builder.pipeline, single_file, edits)

    @override
    def remove_checkpoint(self, path: Path, lightning: Write) -> None:
        self.writes.then(lambda: self.state.remove(path, lightning))

    @override
    def end_fit(self, error: BaseException | None = None) -> None:
        self.writes.finish(error)

    def _workers_write(self, check_meta: bool) -> bool:
        """Whether the stage workers write this checkpoint (`RpcCheckpoints`); ``check_meta``: a model built on meta
        has nothing to write before its stages exist."""
        if self.checkpoints.writes(self.builder.pipeline):
            return True
        module = self.host.lightning_module
        if check_meta and module is not None and on_meta(module):
            raise ConfigurationError(
                "PipeStrategy(transport='rpc'): the model was built on the meta device and no stage made its "
                "tensors yet; save a checkpoint during or after a fit"
            )
        return False
