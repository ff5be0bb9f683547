"""Writing a checkpoint in launched mode without any process holding the whole state.

- `write_sharded` (the default, ``PipeStrategy(save_distributed_checkpoint=True)``): one folder written with
  torch.distributed.checkpoint, every process its own stage (with FSDP, its shard), under the LightningModule's
  keys; the coordinators add the tensors outside the pipeline, the optimizers' groups and parameter order, and
  global rank 0 Lightning's loop and callback state (``meta.pt``). Each coordinator asks its pipeline's
  processes to write (a control call all of them serve at once: DCP's save is a collective over the world).
- `write_single_file` (``save_distributed_checkpoint=False``): one ``torch.save``-compatible file: the folder
  first, then global rank 0 makes one file of it a tensor at a time (`lightning_pipe.checkpoint.consolidate`): no
  process holds the whole model or optimizer state.
- `write_file`: one file written by Lightning's ``checkpoint_io`` (local mode, rpc mode after a fit). Each is
  published once complete (`lightning_pipe.checkpoint.publish`; ``async_checkpoint``: written in the background).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.background import CheckpointWrites
from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.checkpoint.publish import is_local, prepare, publish
from lightning_pipe.checkpoint.sharded import prepare_folder
from lightning_pipe.checkpoint.stage_part import CoordinatorPart
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.weights.edited import StateEdits


def write_sharded(
    path: Path,
    prefix: str,
    checkpoint: dict[str, Any],
    coordinator: CoordinatorPart,
    first: bool,
    pipeline: Pipeline | None,
    here: int,
    worker: Any,
    edits: StateEdits | None = None,
) -> None:
    """This process's part of the folder ``path``: in a fit, the coordinator asks its pipeline's processes to
    write theirs (``here``: the pipeline rank in this process, which adds ``coordinator``'s part); after a fit
    every process writes its own (each calls ``trainer.save_checkpoint``, as with DDP) from its last stage
    ``worker``. ``first`` (global rank 0) prepares the folder and writes Lightning's state: what
    ``checkpoint`` holds besides tensors. ``edits``: what the ``on_save_checkpoint`` hooks did to the state_dict
    (``coordinator`` has them applied already; every process applies them to its own part).
    """
    if first:
        prepare_folder(path)  # before any process writes: each waits for all in DCP's planning
        coordinator.meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    if pipeline is not None:
        names = edits.only(()) if edits is not None else None  # the values the hooks gave: the coordinator's part
        each = [(coordinator if rank == here else None, names) for rank in range(pipeline.coordinator.num_ranks)]
        pipeline.coordinator.stages.call_each(StageProtocol.save_sharded, each, str(path), prefix)
        return
    if worker is None:
        raise ConfigurationError(
            "trainer.save_checkpoint(...) in launched mode writes each process's stage, and no stage was built in "
            "this process yet: save during or after a fit"
        )
    worker.checkpoints.call_save_sharded(str(path), prefix, coordinator, edits)


def write_single_file(save: Callable[[Path], None], path: Path, first: bool, writes: CheckpointWrites) -> None:
    """The checkpoint as one file at ``path``: written as a sharded folder next to it (``save(folder)``, every
    process its part), then made one file by global rank 0 (``first``) a tensor at a time and published, the folder
    removed; with ``writes`` asynchronous, after the folder's write completes, in the background."""
    folder = path.with_name(f".{path.name}.shards")
    save(folder)
    if first:

        def make_file() -> None:
            temporary = prepare(path)
            consolidate(folder, temporary)
            shutil.rmtree(folder)
            publish(temporary, path)

        writes.then(make_file)


def publishes(checkpoint_io: CheckpointIO, path: Path) -> bool:
    """Whether a file that ``checkpoint_io`` writes at ``path`` can be written under a temporary name and renamed:
    Lightning's own ``TorchCheckpointIO`` on this machine's file system (another plugin, such as Lightning's
    ``AsyncCheckpointIO``, writes where and when it chooses)."""
    return isinstance(checkpoint_io, TorchCheckpointIO) and is_local(path)


def write_file(
    writes: CheckpointWrites,
    lightning: Callable[..., None],
    checkpoint: dict[str, Any],
    path: Path,
    storage_options: Any,
    checkpoint_io: CheckpointIO,
) -> None:
    """``checkpoint`` as one file at ``path``, written by Lightning (``lightning``: the strategy's base class's
    ``save_checkpoint``, through ``checkpoint_io``) under a temporary name and published; with ``writes``
    asynchronous, from a copy of its tensors in CPU memory, in ``writes``' thread."""
    if not publishes(checkpoint_io, path):
        lightning(checkpoint, path, storage_options=storage_options)
        return
    temporary = prepare(path)
    checkpoint = writes.stage(checkpoint)
    writes.run(lambda: lightning(checkpoint, temporary, storage_options=storage_options), path)
    writes.then(lambda: publish(temporary, path))


def in_fit(module: Any) -> bool:
    """Whether the Trainer of ``module`` (the LightningModule) runs: a save during a fit may run in the background
    (its end waits for it); one after it completes before ``save_checkpoint`` returns."""
    trainer = getattr(module, "_trainer", None)
    return trainer is not None and trainer.state.status == TrainerStatus.RUNNING
