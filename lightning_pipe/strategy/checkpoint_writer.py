"""Writing a checkpoint in launched mode without any process holding the whole state.

- `write_sharded` (the default, ``PipeStrategy(save_distributed_checkpoint=True)``): one folder written with
  torch.distributed.checkpoint, every process its own stage (with FSDP, its shard), under the LightningModule's
  keys; the coordinators add the tensors outside the pipeline, the optimizers' groups and parameter order, and
  global rank 0 Lightning's loop and callback state (``meta.pt``). Each coordinator asks its pipeline's
  processes to write (a control call all of them serve at once: DCP's save is a collective over the world).
- `write_single_file` (``save_distributed_checkpoint=False``): one ``torch.save``-compatible file: the folder
  first, then global rank 0 makes one file of it a tensor at a time (`lightning_pipe.checkpoint.consolidate`): no
  process holds the whole model or optimizer state.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.checkpoint.sharded import prepare_folder
from lightning_pipe.checkpoint.stage_part import CoordinatorPart
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.pipeline import Pipeline
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


def write_single_file(save: Callable[[Path], None], path: Path, first: bool) -> None:
    """The checkpoint as one file at ``path``: written as a sharded folder next to it (``save(folder)``, every
    process its part), then made one file by global rank 0 (``first``) a tensor at a time, the folder removed."""
    folder = path.with_name(path.name + ".shards")
    save(folder)
    if first:
        if path.exists():
            path.unlink()
        consolidate(folder, path)
        shutil.rmtree(folder)
