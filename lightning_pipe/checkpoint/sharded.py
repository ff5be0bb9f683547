"""Writing a sharded checkpoint: every process writes its own part of one torch.distributed.checkpoint folder.

All processes of a run call `save_sharded` at once (DCP's save is a collective over ``group``); each gives
its own tensors (its stage; with FSDP, its shard of it) under the LightningModule's keys, and its part of
each optimizer's state under the same keys. One process (``extra`` given) also writes Lightning's loop
and callback state, ``meta.pt``, as Lightning's ModelParallelStrategy does. The folder holds no trace of
the layout it was written in: any (replicas, stages), DDP or FSDP, or one process reads it back by key
(`lightning_pipe.checkpoint.reader`), and `consolidate` makes one file of it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.reader import META_FILE, OptimizerLayout, optimizer_key
from lightning_pipe.weights.sources import MODEL, PathLike, is_distributed_checkpoint


@dataclass
class OptimizerPart:
    """A process's part of one optimizer: ``{key: {state name: tensor}}``; ``groups`` (the groups'
    hyperparameters) and ``layout`` (each group's parameter keys, in order) from a process that knows them."""

    state: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]] | None = None
    layout: OptimizerLayout | None = None


def save_sharded(
    path: PathLike,
    model: dict[str, Any],
    optimizers: list[OptimizerPart],
    extra: dict[str, Any] | None = None,
    group: Any = None,
) -> None:
    """This process's part of the checkpoint folder ``path`` (a collective: every process of ``group`` calls it)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path)
    dcp.save(sharded_state(model, optimizers), checkpoint_id=folder, process_group=group)
    if extra is not None:
        torch.save(extra, folder / META_FILE)


def sharded_state(model: dict[str, Any], optimizers: list[OptimizerPart]) -> dict[str, Any]:
    """What a process gives DCP of its part: its tensors under `MODEL`, each optimizer's part under its key."""
    state: dict[str, Any] = {MODEL: model}
    for index, part in enumerate(optimizers):
        entry: dict[str, Any] = {"state": part.state}
        if part.groups is not None:
            entry["param_groups"] = tuple(part.groups)  # a tuple: DCP keeps it as one value, not one per number
        if part.layout is not None:
            entry["layout"] = [list(keys) for keys in part.layout]
        state[optimizer_key(index)] = entry
    return state


def prepare_folder(path: PathLike) -> Path:
    """Make ``path`` a folder for a new sharded checkpoint (a file or an older folder there is replaced)."""
    folder = Path(path)
    if folder.is_file():
        folder.unlink()
    elif folder.is_dir() and is_distributed_checkpoint(folder):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
