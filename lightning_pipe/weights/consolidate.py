"""One file from a sharded checkpoint folder: what a plain Trainer (or ``torch.load``) reads.

The folder's tensors are read whole (the output holds the whole model: run this where it fits), the
optimizers' states are put back by position in each optimizer's parameter list (the layout the folder
keeps), and Lightning's loop and callback state (``meta.pt``) is merged in. ``python -m lightning_pipe
consolidate FOLDER OUT.ckpt`` runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.weights.checkpoint import MODEL, ShardedCheckpoint, optimizer_key
from lightning_pipe.weights.sources import PathLike, is_distributed_checkpoint


def consolidated(path: PathLike) -> dict[str, Any]:
    """The checkpoint of folder ``path`` as one dict, as a single-file Lightning checkpoint holds it."""
    if not is_distributed_checkpoint(path):
        raise ConfigurationError(f"{path} is not a sharded checkpoint folder (it has no .metadata)")
    reader = ShardedCheckpoint(path)
    keys = sorted(k[len(MODEL) + 1 :] for k in reader.folder.metadata if k.startswith(f"{MODEL}."))
    model = reader.model()
    checkpoint = reader.lightning_state()
    checkpoint[MODEL] = model.read(keys)
    states = []
    index = 0
    while any(k.startswith(f"{optimizer_key(index)}.") for k in reader.folder.metadata):
        states.append(_optimizer(reader, index))
        index += 1
    checkpoint["optimizer_states"] = states
    return checkpoint


def _optimizer(reader: ShardedCheckpoint, index: int) -> dict[str, Any]:
    layout, groups = reader.layout(index), reader.optimizer_groups(index)
    if len(layout) != len(groups):
        raise ConfigurationError(
            f"{reader.path}: optimizer {index} has {len(groups)} parameter groups but a layout of {len(layout)}"
        )
    state: dict[int, Any] = {}
    param_groups, position = [], 0
    for keys, hparams in zip(layout, groups, strict=True):
        ids = []
        for key in keys:
            saved = reader.optimizer_state(index, key)
            if saved:
                state[position] = saved
            ids.append(position)
            position += 1
        param_groups.append({**hparams, "params": ids})
    return {"state": state, "param_groups": param_groups}


def consolidate(folder: PathLike, output: PathLike) -> Path:
    """Write the single file ``output`` from the sharded checkpoint ``folder``; returns its path."""
    out = Path(output)
    if out.exists():
        raise ConfigurationError(f"{out} exists already; pass a new file name")
    torch.save(consolidated(folder), out)
    return out
