"""`LocalMode`: one Lightning process; the stages are threads of it and share the LightningModule's parameters.

Lightning's loop runs alone (`OneProcess`: every collective is the identity); the optimizers step the module's own
parameters, as without a pipeline, and Lightning reads and writes the whole model in one file (`WholeFile`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_pipe.checkpoint.background import writes_for
from lightning_pipe.comm import Communicator
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.building import Destination
from lightning_pipe.strategy.layout import LOCAL, Layout
from lightning_pipe.strategy.modes.mode import Collectives, Mode, Write
from lightning_pipe.strategy.modes.mode_parts import ModeParts
from lightning_pipe.strategy.modes.one_process import OneProcess
from lightning_pipe.strategy.modes.whole_file import WholeFile
from lightning_pipe.strategy.patch import Patches
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.unread import folder_in_local_mode
from lightning_pipe.weights import on_meta


class LocalMode(Mode):
    """Stages are threads of this process on the Trainer's devices; they share the module's parameters.

    ``config``: the strategy's arguments; ``parts``: the strategy's parts this mode works with.
    """

    name = LOCAL

    def __init__(self, config: PipeConfig, parts: ModeParts) -> None:
        self.config = config
        self.host, self.state, self.builder = parts.host, parts.state, parts.builder
        self.optimization = parts.optimization
        self.alone = OneProcess(self.name, config)
        self.writes = writes_for(config.async_checkpoint)  # this process's checkpoint write in flight
        self.file = WholeFile(self.writes, parts.host)

    # the processes: this one
    @override
    def describe(self) -> str:
        return self.alone.describe("threads of this process")

    @override
    def unread(self, checkpoint_io: Any) -> list[str | None]:
        return [folder_in_local_mode(self.config)]  # Lightning writes one file

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
        return None

    @override
    def connect(self, environment: Any) -> None:
        """Nothing to join: the stages are threads of this process."""

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
        """The strategy's ``transport`` (a `Communicator` passed in), else threads of this process."""
        return self.config.transport or LOCAL

    @property
    @override
    def collectives(self) -> Collectives:
        return self.alone.collectives

    @override
    def hold(self) -> None:
        """Nothing held: no other process serves."""

    @override
    def release(self, error: BaseException | None = None) -> None:
        """Nothing to release."""

    # where the stages and the optimizers live: the LightningModule's own parameters
    @override
    def prepare_optimization(self, outside: Iterable[nn.Parameter]) -> None:
        """Lightning's optimizers step the module's parameters themselves."""
        self.optimization.setup(outside)

    @override
    def built(self, pipeline: Pipeline, device: torch.device) -> None:
        """The stages are the LightningModule's modules: parameters they made real replace their meta ones in the
        optimizers, each optimizer with its per-stage parts."""
        pipelined = self.builder.pipelined
        assert pipelined is not None
        optimizers = self.host.optimizers
        self.optimization.adopt_built(optimizers, pipelined)
        self.optimization.step_on_stages(pipeline, optimizers, device, by_name=False)

    @override
    def continue_from(self, destination: Destination) -> None:
        """Nothing: the module holds its trained values."""

    @override
    def install(self, patches: Patches) -> None:
        """Nothing: Lightning's hooks run as they do without a pipeline."""

    @override
    def keep_stages(self) -> None:
        """Nothing: the module holds its stages."""

    @override
    def fold_back(self) -> None:
        """The optimizers' per-stage parts fold back into Lightning's optimizers, where the module has values."""
        module = self.host.lightning_module
        self.optimization.fold(self.builder.pipeline, module is not None and not on_meta(module))

    # the training state: one process holds the model, Lightning reads and writes it
    @override
    def load_checkpoint(self, path: Any, weights_only: bool | None, lightning: Callable[..., Any]) -> dict[str, Any]:
        return self.state.load_checkpoint(path, weights_only, lightning)

    @override
    def load_optimizer_state(self, checkpoint: Any) -> None:
        self.state.load_optimizer_state_dict(checkpoint)

    @override
    def module_state(self, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return self.state.module_state(lightning)

    @override
    def optimizer_state(self, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return self.state.optimizer_state(optimizer, lightning)

    @override
    def random_state(self, stages: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        return stages()  # the stages, threads of this process, answer at once

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path, storage_options: Any, lightning: Write) -> None:
        self.file.save(checkpoint, path, storage_options, lightning)

    @override
    def remove_checkpoint(self, path: Path, lightning: Write) -> None:
        self.file.remove(path, lightning)

    @override
    def end_fit(self, error: BaseException | None = None) -> None:
        self.writes.finish(error)
