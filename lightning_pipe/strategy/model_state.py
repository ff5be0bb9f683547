"""`ModelState`: a fit's training state as Lightning's checkpoint hooks read and write it.

Lightning asks the strategy how a checkpoint is read (``load_checkpoint``, ``load_model_state_dict``,
``load_optimizer_state_dict``) and written (``lightning_module_state_dict``, ``optimizer_state``,
``save_checkpoint``, ``remove_checkpoint``). What is the same in every mode is here: the strict loading, the
stages' generator states, a checkpoint opened part by part where the stages own their parameters. Where the
state is written from is the mode's (`lightning_pipe.strategy.modes.mode.Mode.save_checkpoint`): one process holds
the model (local mode: Lightning writes it), the stage workers write their stages (rpc), every process its
own (launched). The modes read what they need through this part.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.stage_part import CoordinatorPart
from lightning_pipe.strategy.building import Destination, PipelineBuilder, prefix_of
from lightning_pipe.strategy.checkpoints import Checkpoints
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.process_stage import ProcessStage
from lightning_pipe.weights.edited import StateEdits
from lightning_pipe.weights.keys import visible


class Host(Protocol):
    """What the model state reads of the strategy: Lightning's objects of the running fit."""

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]: ...

    @property
    def checkpoint_io(self) -> CheckpointIO: ...


class ModelState:
    """Reads and writes a fit's state: the LightningModule's, the stages', the optimizers' (see the module).

    Holds the parts where that state lives: ``checkpoints`` (what a checkpoint holds), ``builder`` (the pipeline),
    ``optimization`` (where the optimizers step), ``stage`` (launched mode: this process's part of the model).
    """

    def __init__(
        self,
        host: Host,
        checkpoints: Checkpoints,
        builder: PipelineBuilder,
        optimization: StageOptimization,
        stage: ProcessStage,
    ) -> None:
        self.host = host
        self.checkpoints = checkpoints
        self.builder = builder
        self.optimization = optimization
        self.stage = stage
        self._shapes: dict[str, Any] = {}  # the last `shapes` the save hooks were handed

    def prepare(self, destination: Destination, seed: int) -> nn.Module:
        """At setup: the pipelined module found and placed, how its stages make their tensors (the opened checkpoint,
        the weights or ``seed``), and the LightningModule's tensors outside it loaded (before they move)."""
        module = self.module
        pipelined = self.builder.setup(module, destination)
        prefix, strict = self.builder.prefix(module), module.strict_loading
        destination.init = self.checkpoints.stage_init(prefix, seed, pipelined, strict)
        self.stage.bind(module, pipelined)
        self.checkpoints.load_outside(module, pipelined, destination.coordinator_device, seed)
        return pipelined

    def bind_to_serve(self, trainer: pl.Trainer | None, convert: Callable[[nn.Module], Any]) -> None:
        """A process that serves a stage instead of running the Trainer's loop: its model as its coordinator's (built
        by ``configure_model`` on meta where the LightningModule builds it there; ``convert``: the precision plugin's
        ``convert_module``, which a ``"*-true"`` precision needs before the stage is built), bound to its stages."""
        module = self.host.lightning_module
        if trainer is not None and module is not None:
            from lightning.pytorch.trainer import call

            call._call_configure_model(trainer)  # the coordinator's Trainer runs it in its fit
            convert(module)  # the coordinator's setup converts its module too
            self.stage.bind(module, self.builder.find(module), serving=True)

    @property
    def module(self) -> pl.LightningModule:
        lightning_module = self.host.lightning_module
        assert lightning_module is not None
        return lightning_module

    def prefix(self) -> str:
        """The pipelined module's path in the LightningModule, with a dot: its keys in a Lightning checkpoint."""
        module = self.module
        return prefix_of(module, self.stage.pipelined or self.builder.find(module))

    # reading
    def load_checkpoint(self, path: Any, weights_only: bool | None, lightning: Callable[..., Any]) -> dict[str, Any]:
        """Where one process holds the model: ``lightning`` (Lightning's reading) loads ``path`` whole, unless it is a
        folder or the model is on meta (`open_checkpoint`)."""
        visible(path, "ckpt_path")  # every process reads it itself: here, or it names this host
        if self.checkpoints.opens_itself(path, self.host.lightning_module):
            return self.checkpoints.open(path, weights_only, len(self.host.optimizers) or 1)
        checkpoint: dict[str, Any] = lightning(path, weights_only=weights_only)
        self.checkpoints.loaded(checkpoint)
        return checkpoint

    def open_checkpoint(self, path: Any, weights_only: bool | None) -> dict[str, Any]:
        """Open ``path`` and read it part by part: each stage reads its own tensors where it lives."""
        visible(path, "ckpt_path")  # every process reads it itself: here, or it names this host
        return self.checkpoints.open(path, weights_only, len(self.host.optimizers) or 1)

    def load_model_state_dict(self, checkpoint: Any, strict: bool, lightning: Callable[..., None]) -> None:
        """Lightning's strict loading in every mode; the tensors: ``lightning`` loads them, or (an opened checkpoint)
        each stage reads its own when it is built, the coordinator the rest at setup."""
        self.checkpoints.hooks_ran(checkpoint)
        self.checkpoints.check_keys(self.module, checkpoint, strict)
        if self.checkpoints.resume is None:
            lightning(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Where one process holds the model: the optimizers' whole states."""
        self.checkpoints.load_optimizers(self.host.optimizers, checkpoint["optimizer_states"], self.module)

    def load_stage_optimizer_states(self, checkpoint: Any) -> None:
        """Where the stages own their parameters: each stage reads its own optimizer state."""
        self.checkpoints.load_stage_optimizers(self.host.optimizers, checkpoint["optimizer_states"], self.module)

    # writing, where one process holds the model
    def module_state(self, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The LightningModule's state as ``lightning`` reads it, after it took the stages' current values."""
        self.checkpoints.before_module_state()
        return lightning()

    def optimizer_state(self, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """``optimizer``'s state where the stages hold it, else as ``lightning`` reads it."""
        state = self.checkpoints.optimizer_state(optimizer)
        return state if state is not None else lightning(optimizer)

    # writing, where the stages write their own
    def shapes(self) -> dict[str, Any]:
        """The LightningModule's state as shapes (meta tensors): what Lightning's ``on_save_checkpoint`` hooks see
        where each stage writes its own tensors in its own process; `save_edits` reads what they did to it."""
        state = self.module.state_dict()
        self._shapes = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
        return dict(self._shapes)

    def save_edits(self, checkpoint: dict[str, Any]) -> StateEdits | None:
        """What the ``on_save_checkpoint`` hooks did to the `shapes` in ``checkpoint``: what every process writing its
        part of it applies (renamed and dropped keys; values the hooks added, written by the coordinator)."""
        shapes, self._shapes = self._shapes, {}
        edits = StateEdits.between(shapes, checkpoint.get("state_dict", {}))
        if edits is None:
            return None
        changed = [k for k, v in edits.given.items() if not isinstance(v, torch.Tensor) or v.is_meta]
        if changed:
            raise ConfigurationError(
                f"on_save_checkpoint changed the values of {', '.join(map(repr, changed[:5]))}: where each stage "
                "writes its own part of a checkpoint (launched and rpc mode) the state_dict the hook sees holds the "
                "tensors' shapes only (meta tensors), their values are in the stages' processes. A hook may rename "
                "and drop keys and add tensors with values here; convert values in on_load_checkpoint instead, or "
                "after consolidating the checkpoint into one file (lightning-pipe consolidate)"
            )
        return edits

    def coordinator_part(self, prefix: str, edits: StateEdits | None = None) -> CoordinatorPart:
        """What this coordinator's process adds to a sharded checkpoint: the tensors outside the pipelined module,
        their optimizer state, and each optimizer's groups and parameter order; with the save hooks' ``edits``
        (the values they added too)."""
        outside = {k: v for k, v in self.module.state_dict().items() if not k.startswith(prefix) and not v.is_meta}
        part = CoordinatorPart(model=outside)
        optimizers, layouts = self.host.optimizers, self.optimization.layouts
        if optimizers and layouts:
            template = optimizers[0]
            saved = template.state_dict()
            flat = [k for group in layouts[0] for k in group]
            part.optimizer_state = {flat[i]: s for i, s in saved["state"].items() if not flat[i].startswith(prefix)}
            part.groups = [{k: v for k, v in g.items() if k != "params"} for g in template.param_groups]
            part.layout = layouts[0]
        return part if edits is None else part.edited(edits)

    def remove(self, path: Path, lightning: Callable[[Path], None]) -> None:
        """A checkpoint goes: a sharded folder here, a file as ``lightning`` (Lightning's removal) removes it."""
        if path.is_dir():
            shutil.rmtree(path)
        else:
            lightning(path)
