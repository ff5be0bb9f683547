"""`ModelStateStrategy`: Lightning's hooks about the model's tensors: where they are made, read and written.

Lightning asks the strategy itself where a model's tensors are created (``tensor_init_context``,
``model_sharded_context``), how a checkpoint is read and written (``load_checkpoint``,
``load_model_state_dict``, ``load_optimizer_state_dict``, ``lightning_module_state_dict``,
``optimizer_state``, ``save_checkpoint``) and moves the module at ``teardown``. These methods live here and
hand the work to `Checkpoints`; `PipeStrategy` extends this with the pipeline.

Memory follows the stage: under ``trainer.init_module(empty_init=True)`` and in ``configure_model`` the
model is built on the meta device (shapes only), and each stage makes its own tensors real where it runs.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from torch import nn
from typing_extensions import override

from lightning_pipe.checkpoint.stage_part import CoordinatorPart
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.strategy.building import PipelineBuilder, prefix_of
from lightning_pipe.strategy.checkpoint_writer import write_sharded, write_single_file
from lightning_pipe.strategy.checkpoints import Checkpoints
from lightning_pipe.strategy.layout import LOCAL, RPC
from lightning_pipe.strategy.patch import patch
from lightning_pipe.strategy.processes import ProcessStrategy
from lightning_pipe.strategy.rpc_checkpoints import RpcCheckpoints
from lightning_pipe.weights import on_meta
from lightning_pipe.weights.keys import visible


class ModelStateStrategy(ProcessStrategy):
    """A `ProcessStrategy` whose model's tensors live with the stages (see the module's docstring).

    Args: ``checkpoints`` and ``builder``, the parts it hands the work to; the rest go to `ProcessStrategy`
    (``config.save_distributed_checkpoint``: launched mode writes a sharded folder, or one file a stage at a time).
    """

    def __init__(
        self,
        *args: Any,
        checkpoints: Checkpoints,
        builder: PipelineBuilder,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoints = checkpoints
        self.builder = builder
        self.rpc_checkpoints = RpcCheckpoints()  # rpc mode: checkpoints the workers write

    # where a model's tensors are made
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device: each stage makes its tensors later."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device (as FSDP's deferred initialisation does)."""
        with torch.device("meta"):
            yield

    @override
    def serve_stages(self, trainer: Any = None) -> None:
        """A serving process's model as its coordinator's: built by ``configure_model`` (on meta) where the
        LightningModule builds it there, and bound to the stages this process serves."""
        lightning_module = self.lightning_module
        if trainer is not None and lightning_module is not None:
            from lightning.pytorch.trainer import call

            call._call_configure_model(trainer)  # the coordinator's Trainer runs it in its fit
            self.stage.bind(lightning_module, self.builder.find(lightning_module))
        super().serve_stages(trainer)

    # reading
    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        visible(checkpoint_path, "ckpt_path")  # every process reads it itself: here, or it names this host
        if self.checkpoints.opens_itself(checkpoint_path, self.mode.stages_own_parameters, self.lightning_module):
            return self.checkpoints.open(checkpoint_path, weights_only, len(self.optimizers) or 1)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.checkpoints.loaded(checkpoint)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Lightning's strict loading in every mode (Lightning calls this before it restores its loops)."""
        lightning_module = self.lightning_module
        assert lightning_module is not None
        self.checkpoints.check_keys(lightning_module, checkpoint, strict)
        if self.checkpoints.resume is None:
            super().load_model_state_dict(checkpoint, strict=strict)
        # else: each stage reads its tensors when it is built, the coordinator the rest at setup

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        lightning_module = self.lightning_module
        assert lightning_module is not None
        states = checkpoint["optimizer_states"]
        self.checkpoints.load_optimizers(self.optimizers, states, lightning_module, self.mode.name != LOCAL)

    # writing
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.world is not None or self._workers_write():
            return {}  # each process writes its own stage (`save_checkpoint`); nothing is gathered here
        self.checkpoints.before_module_state()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.world is not None or self._workers_write():
            return {}  # as above: the stages write their own
        state = self.checkpoints.optimizer_state(optimizer)
        return state if state is not None else super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        checkpoint = self.checkpoints.saving(checkpoint)
        world, lightning_module = self.world, self.lightning_module
        if self.mode.name == RPC and lightning_module is not None and self._workers_write(lightning_module):
            prefix = prefix_of(lightning_module, self.builder.find(lightning_module))
            part = self._coordinator_part(lightning_module, prefix)
            single_file = not self.config.save_distributed_checkpoint
            self.rpc_checkpoints.save(checkpoint, Path(filepath), prefix, part, self.builder.pipeline, single_file)
            return
        if world is None or lightning_module is None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        first = world.layout.global_rank == 0
        pipelined = self.stage.pipelined or self.builder.find(lightning_module)
        prefix = prefix_of(lightning_module, pipelined)
        part = self._coordinator_part(lightning_module, prefix) if world.layout.coordinates else CoordinatorPart()
        pipeline, here, worker = self.builder.pipeline, world.layout.coordinator, self.stage.worker

        def save(folder: Path) -> None:
            write_sharded(folder, prefix, checkpoint, part, first, pipeline, here, worker)

        if self.config.save_distributed_checkpoint:
            save(path)
        else:
            write_single_file(save, path, first)
        self.barrier("PipeStrategy.save_checkpoint")

    def _workers_write(self, lightning_module: nn.Module | None = None) -> bool:
        """rpc mode: whether the stage workers write this checkpoint (`RpcCheckpoints`); a model built on meta
        has nothing to write before its stages exist."""
        if self.mode.name != RPC:
            return False
        if self.rpc_checkpoints.writes(self.builder.pipeline):
            return True
        if lightning_module is not None and on_meta(lightning_module):
            raise ConfigurationError(
                "PipeStrategy(transport='rpc'): the model was built on the meta device and no stage made its "
                "tensors yet; save a checkpoint during or after a fit"
            )
        return False

    def keep_stages(self) -> None:
        """rpc mode, at the end of a fit of a model built on meta: the workers write their trained stages for the
        checkpoints written after it (before they stop; `RpcCheckpoints.keep`)."""
        pipeline, lightning_module = self.builder.pipeline, self.lightning_module
        stage_params = self.checkpoints.optimization.stage_params
        trained = stage_params is not None and bool(stage_params.views)  # a fit (validate etc. keep the last fit's)
        if self.mode.name != RPC or not trained or pipeline is None or lightning_module is None:
            return
        self.rpc_checkpoints.forget()  # the last fit's
        if on_meta(lightning_module):
            prefix = prefix_of(lightning_module, self.builder.find(lightning_module))
            under = Path(lightning_module.trainer.default_root_dir)
            self.rpc_checkpoints.keep(pipeline, prefix, self._coordinator_part(lightning_module, prefix), under)

    def _coordinator_part(self, lightning_module: nn.Module, prefix: str) -> CoordinatorPart:
        """What this coordinator's process adds to a checkpoint: the tensors outside the pipelined module, their
        optimizer state, and each optimizer's groups and parameter order."""
        outside = {k: v for k, v in lightning_module.state_dict().items() if not k.startswith(prefix) and not v.is_meta}
        part = CoordinatorPart(model=outside)
        if self.optimizers and self.checkpoints.optimization.layouts:
            layout = self.checkpoints.optimization.layouts[0]
            template = self.optimizers[0]
            saved = template.state_dict()
            flat = [k for group in layout for k in group]
            part.optimizer_state = {flat[i]: s for i, s in saved["state"].items() if not flat[i].startswith(prefix)}
            part.groups = [{k: v for k, v in g.items() if k != "params"} for g in template.param_groups]
            part.layout = layout
        return part

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        import shutil

        first = self.mode.name == RPC or (self.world is not None and self.world.layout.global_rank == 0)
        if first and Path(filepath).is_dir():
            shutil.rmtree(filepath)
            return
        super().remove_checkpoint(filepath)

    # teardown
    @override
    def teardown(self) -> None:
        """Lightning's teardown moves the module to the CPU with ``module.cpu()``, which cannot copy the meta
        tensors of the stages this process does not hold: for that call, the module moves what it has."""
        lightning_module = self.lightning_module
        if lightning_module is None:
            super().teardown()
            return
        restore = patch(lightning_module, "cpu", lambda: _own_to_cpu(lightning_module))
        try:
            super().teardown()
        finally:
            restore()


def _own_to_cpu(module: nn.Module) -> nn.Module:
    """``module.cpu()`` for the tensors that have values (meta ones stay; FSDP's shards stay where they are)."""
    for owner in module.modules():
        for param in owner._parameters.values():
            if param is not None and param.device.type not in ("cpu", "meta") and type(param) is nn.Parameter:
                param.data = param.data.cpu()
        for name, buffer in owner._buffers.items():
            if buffer is not None and buffer.device.type not in ("cpu", "meta"):
                owner._buffers[name] = buffer.cpu()
    return module
