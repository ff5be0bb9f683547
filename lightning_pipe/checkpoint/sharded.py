"""Writing a sharded checkpoint: every process writes its own part of one torch.distributed.checkpoint folder.

All processes of a run call `save_sharded` at once (DCP's save is a collective over ``group``); each gives
its own tensors (its stage; with FSDP, its shard of it) under the LightningModule's keys, its part of
each optimizer's state under the same keys, and its stages' generator states (`RANDOM_STATES`). One process
(``extra`` given) also writes Lightning's loop and callback state, ``meta.pt``, as Lightning's ModelParallelStrategy
does. The folder holds no trace of the layout it was written in: any (replicas, stages, tensor ranks), DDP or FSDP,
or one process reads it back by key (`lightning_pipe.checkpoint.reader`), and `consolidate` makes one file of it. The
keys are those of ``ModelParallelStrategy`` (``state_dict.<key>``, ``optimizer_<i>.state.<key>.<name>``,
``optimizer_<i>.param_groups.<group>.<name>``, ``meta.pt``): each reads the other's folders.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.checkpoint.reader import META_FILE, RANDOM_STATES, OptimizerLayout, optimizer_key
from lightning_pipe.weights.sources import MODEL, PathLike, is_distributed_checkpoint


@dataclass
class OptimizerPart:
    """A process's part of one optimizer: ``{key: {state name: tensor}}``; ``groups`` (the groups'
    hyperparameters) and ``layout`` (each group's parameter keys, in order) from a process that knows them."""

    state: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]] | None = None
    layout: OptimizerLayout | None = None


RandomStates = dict[int, dict[str, torch.Tensor]]  # per stage index, each generator's state by its key


def save_sharded(
    path: PathLike,
    model: dict[str, Any],
    optimizers: list[OptimizerPart],
    extra: dict[str, Any] | None = None,
    group: Any = None,
    random: RandomStates | None = None,
) -> None:
    """This process's part of the checkpoint folder ``path`` (a collective: every process of ``group`` calls it);
    ``random``: its stages' generator states."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path)
    dcp.save(sharded_state(model, optimizers, random), checkpoint_id=folder, process_group=group)
    if extra is not None:
        torch.save(extra, folder / META_FILE)


def save_sharded_in_background(
    path: PathLike,
    model: dict[str, Any],
    optimizers: list[OptimizerPart],
    extra: dict[str, Any] | None,
    group: Any,
    stager: Any = None,
    random: RandomStates | None = None,
) -> tuple[Future[Any], Future[Any] | None]:
    """`save_sharded` in the background (DCP's ``async_save``): the tensors are copied to CPU memory (by
    ``stager``, a DCP ``AsyncStager``; None: a new ``DefaultStager`` each time), then written in a thread.
    Returns (written, staged): ``written`` completes when this process's part is written (on ``group``'s rank 0:
    every process's, the folder's metadata too); ``staged`` when the copy is made, None where it was made before
    this returned (a stager that stages synchronously). ``group``: a gloo group that nothing else uses while the
    write runs (its collectives run in that thread)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path)
    if extra is not None:
        torch.save(extra, folder / META_FILE)
    state = sharded_state(model, optimizers, random)
    response = dcp.async_save(state, checkpoint_id=folder, process_group=group, async_stager=stager)
    if isinstance(response, Future):
        return response, None
    return response.upload_completion, response.staging_completion  # a stager that stages in its own thread


def sharded_state(
    model: dict[str, Any], optimizers: list[OptimizerPart], random: RandomStates | None = None
) -> dict[str, Any]:
    """What a process gives DCP of its part: its tensors under `MODEL`, each optimizer's part under its key, its
    stages' generator states (``random``) under `RANDOM_STATES`."""
    state: dict[str, Any] = {MODEL: model}
    if random:
        outer, inner, stages = RANDOM_STATES.split(".")
        state[outer] = {inner: {stages: {str(index): dict(states) for index, states in random.items()}}}
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
