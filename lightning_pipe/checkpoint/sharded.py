"""Writing a sharded checkpoint: every process writes its own part of one torch.distributed.checkpoint folder.

All processes of a run call `save_sharded` at once (DCP's save is a collective over ``group``); each gives
its own tensors (its stage; with FSDP, its shard of it) under the LightningModule's keys, and its part of
each optimizer's state under the same keys. One process (``extra`` given) also writes Lightning's loop
and callback state, ``meta.pt``, as Lightning's ModelParallelStrategy does. The folder holds no trace of
the layout it was written in: any (replicas, stages, tensor ranks), DDP or FSDP, or one process reads it back by key
(`lightning_pipe.checkpoint.reader`), and `consolidate` makes one file of it. The keys are those of Lightning's
``ModelParallelStrategy`` (``state_dict.<key>``, ``optimizer_<i>.state.<key>.<name>``,
``optimizer_<i>.param_groups.<group>.<name>`` with ``params`` the group's keys, ``meta.pt``): each reads the
other's folders.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
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


def save_sharded_in_background(
    path: PathLike,
    model: dict[str, Any],
    optimizers: list[OptimizerPart],
    extra: dict[str, Any] | None,
    group: Any,
    stager: Any = None,
) -> Future[Any]:
    """`save_sharded` in the background (DCP's ``async_save``): the tensors are copied to CPU memory before it
    returns (by ``stager``, a DCP ``AsyncStager`` that stages synchronously; None: a new ``DefaultStager`` each
    time), then written in a thread; the future completes when this process's part is written (on ``group``'s
    rank 0: every process's, the folder's metadata too). ``group``: a gloo group that nothing else uses while the
    write runs (its collectives run in that thread)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path)
    if extra is not None:
        torch.save(extra, folder / META_FILE)
    state = sharded_state(model, optimizers)
    written = dcp.async_save(state, checkpoint_id=folder, process_group=group, async_stager=stager)
    assert isinstance(written, Future), "async_save with a stager that stages before it returns gives one future"
    return written


def sharded_state(model: dict[str, Any], optimizers: list[OptimizerPart]) -> dict[str, Any]:
    """What a process gives DCP of its part: its tensors under `MODEL`, each optimizer's part under its key."""
    state: dict[str, Any] = {MODEL: model}
    for index, part in enumerate(optimizers):
        entry: dict[str, Any] = {"state": part.state}
        groups = part.groups or [{} for _ in part.layout or ()]
        layout: list[list[str] | None] = [list(keys) for keys in part.layout] if part.layout else [None] * len(groups)
        if len(groups) != len(layout):
            raise ValueError(f"optimizer {index}: {len(groups)} parameter groups but a layout of {len(layout)}")
        if groups:  # as torch's `get_optimizer_state_dict` gives them (Lightning's ModelParallelStrategy reads them):
            # each group's hyperparameters and its parameters' keys in order, under param_groups.<group>.<name>
            entry["param_groups"] = [
                {**g, **({} if k is None else {"params": k})} for g, k in zip(groups, layout, strict=True)
            ]
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
