"""`RpcCheckpoints`: checkpoints under ``transport="rpc"``, written by the stage workers, never gathered.

As in launched mode, every worker writes its stage and optimizer state and the script's process the rest into
one torch.distributed.checkpoint folder (the coordinator carries DCP's plans: `checkpoint.sharded_steps`);
``save_distributed_checkpoint=False`` makes one file of it a tensor at a time. Either is written under a temporary
name and published once every part is written (`lightning_pipe.checkpoint.publish`), synchronously. A model built on
meta keeps its trained stages in a private folder at the end of fit, for a checkpoint written after it (`keep`,
`write_kept`). Every path the workers write must be one they reach (docs/internals.md).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.background import CheckpointWrites
from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.checkpoint.publish import prepare, publish
from lightning_pipe.checkpoint.reader import META_FILE
from lightning_pipe.checkpoint.sharded import OptimizerPart, prepare_folder, sharded_state
from lightning_pipe.checkpoint.sharded_steps import FolderPart
from lightning_pipe.checkpoint.stage_part import CoordinatorPart
from lightning_pipe.engine import StageProtocol
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.strategy.modes.launched_checkpoints import write_single_file
from lightning_pipe.weights.edited import StateEdits


def lightning_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What a folder keeps in ``meta.pt``: Lightning's checkpoint without the tensors the stages write."""
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}


def write_folder(folder: Path, prefix: str, meta: dict[str, Any] | None, part: CoordinatorPart,
                 pipeline: Pipeline, optimizer: bool = True, edits: StateEdits | None = None) -> None:  # fmt: skip
    """The sharded folder ``folder``: each rank of ``pipeline`` writes its stage (keys after ``prefix``), this
    process ``part`` and ``meta`` (Lightning's state; None: none); the optimizers' state too unless ``optimizer``
    is False (``trainer.save_checkpoint(weights_only=True)``); each rank under the keys the ``on_save_checkpoint``
    hooks left (``edits``; ``part`` has them already)."""
    prepare_folder(folder)
    with_state = optimizer and part.layout is not None
    optimizers = [OptimizerPart(part.optimizer_state, part.groups, part.layout)] if with_state else []
    own = FolderPart(folder, sharded_state(part.model, optimizers), 0)
    mine = own.plan()
    coordinator = pipeline.coordinator
    names = edits.only(()) if edits is not None else None  # the values the hooks gave are in ``part``
    each = [(r + 1, names) for r in range(coordinator.num_ranks)]
    theirs = coordinator.stages.call_each(StageProtocol.plan_part, each, str(folder), prefix, optimizer)
    plans, metadata = own.global_plan([mine, *theirs])
    written = coordinator.stages.call_each(StageProtocol.write_part, [(plan,) for plan in plans[1:]])
    own.finish(metadata, [own.write(plans[0]), *written])
    if meta is not None:
        torch.save(meta, folder / META_FILE)


#: the folder of each LightningModule built on meta whose last rpc fit in this process kept its trained stages
#: (`RpcCheckpoints.keep`): what a later run of the same module, under this strategy or another, starts from
#: (`trained_folder`); an entry lives as long as its module, its folder until the module's next fit here
KEPT: weakref.WeakKeyDictionary[Any, tuple[Path, weakref.finalize]] = weakref.WeakKeyDictionary()


def trained_folder(module: Any) -> Path | None:
    """The folder where the last rpc fit of ``module`` (built on meta) left its trained stages; None: none."""
    entry = KEPT.get(module)
    return entry[0] if entry is not None and entry[0].exists() else None


class RpcCheckpoints:
    """Writes rpc mode's checkpoints (see the module's docstring); holds the folder a meta-built model's fit left."""

    def __init__(self) -> None:
        self.kept: Path | None = None  # the trained stages of the last fit of a model built on meta
        self._cleanup: weakref.finalize | None = None

    def writes(self, pipeline: Pipeline | None) -> bool:
        """Whether a checkpoint now comes from the workers (a fit runs) or the folder they left (it ended)."""
        return pipeline is not None or self.kept is not None

    def save(self, checkpoint: dict[str, Any], path: Path, prefix: str, part: CoordinatorPart,
             pipeline: Pipeline | None, single_file: bool, edits: StateEdits | None = None) -> None:  # fmt: skip
        """``checkpoint`` (Lightning's state; its tensors are the stages') at ``path``: a folder, or one file, under
        the keys the ``on_save_checkpoint`` hooks left (``edits``)."""
        meta = lightning_state(checkpoint)
        optimizer = "optimizer_states" in checkpoint  # Lightning leaves them out for weights_only=True
        if pipeline is None:
            if edits is not None:
                raise ConfigurationError(
                    f"on_save_checkpoint changed the state_dict ({edits.describe()}) of a checkpoint written after an "
                    "rpc fit of a model built on meta: that checkpoint is the folder the workers left as they stopped, "
                    "written before the hook ran. Save it during the fit (ModelCheckpoint, or trainer.save_checkpoint "
                    "in a callback), where the hook's edits are written, or edit it when loading (on_load_checkpoint)"
                )
            self.write_kept(path, meta, single_file)
            return

        def save(folder: Path) -> None:
            write_folder(folder, prefix, meta, part, pipeline, optimizer, edits)

        if single_file:
            write_single_file(save, path, True, CheckpointWrites())  # synchronous: the file is made at once
        else:
            temporary = prepare(path)
            save(temporary)
            publish(temporary, path)  # every worker's part written: the leader finished the folder

    def keep(self, module: Any, pipeline: Pipeline, prefix: str, part: CoordinatorPart, under: Path) -> None:
        """At the end of a fit of ``module`` (built on meta): the workers write their trained stages (before they
        stop) into a private folder under ``under`` (the Trainer's ``default_root_dir``, where its checkpoints go: a
        folder that workers on other machines share), removed at the module's next fit here, when the module is
        gone, or when this process exits; a later run of the module starts from it (`KEPT`)."""
        self.forget()
        earlier = KEPT.pop(module, None)
        if earlier is not None:  # the module's last fit under another strategy
            earlier[1]()
        under.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=".lightning_pipe-trained-", dir=under))
        self._cleanup = weakref.finalize(module, shutil.rmtree, root, True)
        self.kept = root / "trained"
        write_folder(self.kept, prefix, None, part, pipeline)
        KEPT[module] = (self.kept, self._cleanup)

    def write_kept(self, path: Path, meta: dict[str, Any], single_file: bool) -> None:
        """A checkpoint after the fit: the kept folder with Lightning's state ``meta``, copied or made one file."""
        assert self.kept is not None
        torch.save(meta, self.kept / META_FILE)
        temporary = prepare(path)
        if single_file:
            consolidate(self.kept, temporary)
        else:
            shutil.copytree(self.kept, temporary)
        publish(temporary, path)

    def forget(self) -> None:
        """A new fit: the last fit's folder goes."""
        if self._cleanup is not None:
            self._cleanup()
        self.kept, self._cleanup = None, None
