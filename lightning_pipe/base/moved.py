"""Modules that moved in 0.3 (folders by layer, docs/architecture.md): their old import paths work for one release.

`install` puts `MovedModules` on ``sys.meta_path`` (``import lightning_pipe`` does): importing an old path warns
once with a ``DeprecationWarning`` naming the new one and gives the module at its new path (the same module
object, so ``isinstance`` and patching agree). ``lightning_pipe.memory`` was a package of its own; its modules are
listed one by one and the package itself is an empty namespace for them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence

#: old import path -> new one (CHANGELOG.md, 0.3: "Moved")
MOVED: dict[str, str] = {
    "lightning_pipe.errors": "lightning_pipe.base.errors",
    "lightning_pipe.tree": "lightning_pipe.base.tree",
    "lightning_pipe.units": "lightning_pipe.base.units",
    "lightning_pipe.microbatch": "lightning_pipe.base.microbatch",
    "lightning_pipe.microbatch_weights": "lightning_pipe.base.microbatch_weights",
    "lightning_pipe.weights.dtensor_shards": "lightning_pipe.base.dtensor_shards",
    "lightning_pipe.memory.allocator": "lightning_pipe.base.allocator",
    "lightning_pipe.memory.pages": "lightning_pipe.base.pages",
    "lightning_pipe.memory.walk": "lightning_pipe.schedule.stash_walk",
    "lightning_pipe.transports": "lightning_pipe.comm.transports",
    "lightning_pipe.comm.placement": "lightning_pipe.comm.process_device",
    "lightning_pipe.worker": "lightning_pipe.comm.worker_command",
    "lightning_pipe.executors": "lightning_pipe.engine.executors",
    "lightning_pipe.loss": "lightning_pipe.engine.loss",
    "lightning_pipe.grads": "lightning_pipe.engine.grads",
    "lightning_pipe.memory.stash": "lightning_pipe.engine.stash",
    "lightning_pipe.memory.stage": "lightning_pipe.engine.stage_memory",
    "lightning_pipe.engine.stage_state": "lightning_pipe.engine.state_calls",
    "lightning_pipe.engine.plan": "lightning_pipe.engine.messages",
    "lightning_pipe.engine.stage": "lightning_pipe.engine.stage_worker",
    "lightning_pipe.pipeline_inputs": "lightning_pipe.pipeline.inputs",
    "lightning_pipe.pipeline_choices": "lightning_pipe.pipeline.choices",
    "lightning_pipe.auto_schedule": "lightning_pipe.pipeline.schedule_chooser",
    "lightning_pipe.stage_moves": "lightning_pipe.pipeline.stage_moves",
    "lightning_pipe.stage_state": "lightning_pipe.pipeline.stage_state",
    "lightning_pipe.stage_layout": "lightning_pipe.pipeline.stage_layout",
    "lightning_pipe.optim": "lightning_pipe.pipeline.optimizers",
    "lightning_pipe.timeline": "lightning_pipe.pipeline.timeline",
    "lightning_pipe.memory.plan": "lightning_pipe.pipeline.memory_plan",
    "lightning_pipe.memory.recompute": "lightning_pipe.pipeline.recompute",
    "lightning_pipe.strategy.timeline": "lightning_pipe.strategy.trace_callback",
    "lightning_pipe.strategy.stage_placement": "lightning_pipe.strategy.process_stage",
    "lightning_pipe.strategy.asynchronous": "lightning_pipe.strategy.async_training",
    "lightning_pipe.strategy.config": "lightning_pipe.strategy.pipe_config",
    "lightning_pipe.strategy.mode": "lightning_pipe.strategy.modes.mode",
    "lightning_pipe.strategy.rpc_mode": "lightning_pipe.strategy.modes.rpc_mode",
    "lightning_pipe.strategy.launched": "lightning_pipe.strategy.modes.launched_mode",
    "lightning_pipe.strategy.rpc_checkpoints": "lightning_pipe.strategy.modes.rpc_checkpoints",
    "lightning_pipe.strategy.checkpoint_writer": "lightning_pipe.strategy.modes.launched_checkpoints",
    "lightning_pipe.strategy.remote": "lightning_pipe.strategy.modes.rpc_optimizers",
    "lightning_pipe.strategy.mode_choice": "lightning_pipe.strategy.modes.mode_choice",
    "lightning_pipe.partition.tied": "lightning_pipe.partition.tied_parameters",
    "lightning_pipe.rng.stage": "lightning_pipe.rng.stage_random",
}
#: old packages that no longer exist: importing their moved modules still works
GONE_PACKAGES = ("lightning_pipe.memory",)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old import path and loads it as the module at its new path, with a deprecation warning."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname in GONE_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in GONE_PACKAGES:
            module = types.ModuleType(spec.name, f"moved: its modules are in {', '.join(_new_homes(spec.name))}")
            module.__path__ = []
            return module
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new} (docs/architecture.md); the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """The module is the one at its new path, already executed."""


def _new_homes(package: str) -> list[str]:
    return sorted({MOVED[old].rsplit(".", 1)[0] for old in MOVED if old.startswith(package + ".")})


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
