"""`RpcMode`: one Lightning process; the stages are worker processes of a private RPC world.

Each worker owns its stage's parameters and that stage's optimizer state; the script's process holds the
LightningModule's tensors outside the pipeline. Lightning's loop runs in the script's process alone, so every
collective is the identity. A checkpoint is written where the state lives, by the workers
(`lightning_pipe.strategy.modes.rpc_checkpoints`), never gathered; after a fit of a model built eagerly the script's
process holds the trained values again and Lightning writes them as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from typing_extensions import override

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.background import CheckpointWrites
from lightning_pipe.strategy.building import Destination
from lightning_pipe.strategy.layout import RPC
from lightning_pipe.strategy.model_state import ModelState
from lightning_pipe.strategy.modes.mode import Mode, Write
from lightning_pipe.strategy.modes.rpc_checkpoints import RpcCheckpoints, trained_folder
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.unread import checkpoint_io_unused, synchronous_in_rpc_mode
from lightning_pipe.weights import StageInit, on_meta


class RpcMode(Mode):
    """Stages are worker processes of a private RPC world; each owns its stage's parameters and optimizer."""

    name = RPC

    def __init__(self, config: PipeConfig) -> None:
        super().__init__(config)
        self.checkpoints = RpcCheckpoints()  # the checkpoints the workers write, and what a fit left for them
        self.writes = CheckpointWrites()  # the workers write synchronously (`save_checkpoint`)

    @override
    def describe(self) -> str:
        return f"{super().describe()}, stages in rpc worker processes"

    @override
    def unread(self, checkpoint_io: Any) -> list[str | None]:
        writers = "the stage workers write their own stages during and after a fit (a folder, or one file made of it)"
        return [checkpoint_io_unused(self.name, writers, checkpoint_io), synchronous_in_rpc_mode(self.config)]

    @override
    def keep_stages(self, state: ModelState) -> None:
        """At the end of a fit of a model built on meta: the workers write their trained stages for the checkpoints
        written after it (before they stop; `RpcCheckpoints.keep`)."""
        pipeline, module = state.builder.pipeline, state.host.lightning_module
        stage_params = state.optimization.stage_params
        trained = stage_params is not None and bool(stage_params.views)  # a fit (validate etc. keep the last fit's)
        if not trained or pipeline is None or module is None:
            return
        self.checkpoints.forget()  # the last fit's
        if on_meta(module):
            prefix = state.prefix()
            under = Path(module.trainer.default_root_dir)
            self.checkpoints.keep(module, pipeline, prefix, state.coordinator_part(prefix), under)

    @override
    def continue_from(self, state: ModelState, destination: Destination) -> None:
        """A module built on meta that an earlier rpc fit here trained holds none of its stages' values (its workers
        wrote them to a folder as they stopped, `RpcCheckpoints.keep`): a later run without a checkpoint or weights
        starts its stages from that folder, as a module built eagerly starts from the values it holds."""
        module, init = state.module, destination.init
        kept = trained_folder(module)
        if kept is None or init is None or init.path is not None or not on_meta(state.builder.split_module):
            return
        destination.init = StageInit(path=str(kept), checkpoint=True, prefix=state.prefix(), seed=init.seed,
                                   overwrite=False, strict=True)  # fmt: skip

    @override
    def module_state(self, state: ModelState, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if self._workers_write(state, check_meta=False):
            return state.shapes()  # each worker writes its own stage (`save_checkpoint`): the hooks see shapes
        return super().module_state(state, lightning)

    @override
    def optimizer_state(
        self, state: ModelState, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]
    ) -> dict[str, Any]:
        if self._workers_write(state, check_meta=False):
            return {}  # as above: the stages write their own
        return super().optimizer_state(state, optimizer, lightning)

    @override
    def save_checkpoint(
        self, state: ModelState, checkpoint: dict[str, Any], path: Path, storage_options: Any, lightning: Write
    ) -> None:
        """The workers write their stages and this process the rest, into one folder (or one file of it), while a
        fit runs or from what the last fit of a model built on meta left; else Lightning writes the whole model."""
        if state.host.lightning_module is None or not self._workers_write(state, check_meta=True):
            super().save_checkpoint(state, checkpoint, path, storage_options, lightning)
            return
        prefix = state.prefix()
        single_file = self.config.save_distributed_checkpoint is False  # None (the default) or True: a folder
        pipeline, edits = state.builder.pipeline, state.save_edits(checkpoint)
        part = state.coordinator_part(prefix, edits)
        self.checkpoints.save(checkpoint, path, prefix, part, pipeline, single_file, edits)

    @override
    def remove_checkpoint(self, state: ModelState, path: Path, lightning: Write) -> None:
        self.writes.then(lambda: state.remove(path, lightning))

    def _workers_write(self, state: ModelState, check_meta: bool) -> bool:
        """Whether the stage workers write this checkpoint (`RpcCheckpoints`); ``check_meta``: a model built on meta
        has nothing to write before its stages exist."""
        if self.checkpoints.writes(state.builder.pipeline):
            return True
        module = state.host.lightning_module
        if check_meta and module is not None and on_meta(module):
            raise ConfigurationError(
                "PipeStrategy(transport='rpc'): the model was built on the meta device and no stage made its "
                "tensors yet; save a checkpoint during or after a fit"
            )
        return False
