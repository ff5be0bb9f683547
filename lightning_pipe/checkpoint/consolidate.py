"""One file from a sharded checkpoint folder: what a plain Trainer (or ``torch.load``) reads.

The file is written a tensor at a time (`lightning_pipe.checkpoint.single_file`): each tensor is read from the
folder just before its bytes are written and dropped after, so this holds one tensor in memory, never the
whole model or optimizer state. The optimizers' states are put back by position in each optimizer's
parameter list (the layout the folder keeps), and Lightning's loop and callback state (``meta.pt``) is
merged in. ``python -m lightning_pipe consolidate FOLDER OUT.ckpt`` runs it; launched mode's
``PipeStrategy(save_distributed_checkpoint=False)`` writes its single files this way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.reader import ShardedCheckpoint, optimizer_key
from lightning_pipe.checkpoint.single_file import Fetch, Pending, save_in_parts
from lightning_pipe.weights.sources import MODEL, PathLike, is_distributed_checkpoint


def consolidate(folder: PathLike, output: PathLike) -> Path:
    """Write the single file ``output`` from the sharded checkpoint ``folder``; returns its path."""
    out = Path(output)
    if out.exists():
        raise ConfigurationError(f"{out} exists already; pass a new file name")
    if not is_distributed_checkpoint(folder):
        raise ConfigurationError(f"{folder} is not a sharded checkpoint folder (it has no .metadata)")
    reader = ShardedCheckpoint(folder)
    parts: list[tuple[int, Fetch]] = []

    def pending(flat_key: str, shape: Any, dtype: torch.dtype) -> Pending:
        index = len(parts)
        parts.append((index, _reading(reader, flat_key)))
        return Pending(index, flat_key, tuple(shape), dtype)

    checkpoint = reader.lightning_state()
    checkpoint[MODEL] = {
        key[len(MODEL) + 1 :]: pending(key, meta.size, meta.properties.dtype)  # type: ignore[union-attr]
        for key, meta in sorted(reader.folder.metadata.items())
        if key.startswith(f"{MODEL}.")
    }
    states = []
    index = 0
    while any(k.startswith(f"{optimizer_key(index)}.") for k in reader.folder.metadata):
        states.append(_optimizer(reader, index, pending))
        index += 1
    checkpoint["optimizer_states"] = states
    save_in_parts(checkpoint, out, parts)
    return out


def _reading(reader: ShardedCheckpoint, flat_key: str) -> Fetch:
    return lambda: {flat_key: reader.folder.read([flat_key])[flat_key]}


def _optimizer(reader: ShardedCheckpoint, index: int, pending: Callable[..., Pending]) -> dict[str, Any]:
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
            saved: dict[str, Any] = {}
            shapes = reader.state_shapes(index, key)
            for name in reader.state_names(index, key):
                flat = f"{optimizer_key(index)}.state.{key}.{name}"
                if name not in shapes:  # a value that is not a tensor
                    saved[name] = reader.folder.objects(flat)[flat]
                elif len(shapes[name][0]) == 0:  # a scalar tensor (Adam's step): read now, it is tiny
                    saved[name] = reader.folder.read([flat])[flat]
                else:
                    saved[name] = pending(flat, *shapes[name])
            if saved:
                state[position] = saved
            ids.append(position)
            position += 1
        param_groups.append({**hparams, "params": ids})
    return {"state": state, "param_groups": param_groups}
