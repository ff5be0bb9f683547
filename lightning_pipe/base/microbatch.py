"""Splitting a batch into microbatches and gathering the results back (``scatter`` / ``gather``)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError


def batch_size(batch: Any) -> int:
    """Rows of the first tensor found in ``batch`` (dimension 0)."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ConfigurationError("cannot split a 0-dimensional tensor into microbatches")
        return batch.shape[0]
    if isinstance(batch, Mapping):
        values: Sequence[Any] = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = batch
    else:
        values = []
    for value in values:
        try:
            return batch_size(value)
        except ConfigurationError:
            continue
    raise ConfigurationError(
        f"found no tensor with a batch dimension in a {type(batch).__name__}; "
        "PipeStrategy splits batches along dimension 0 of their tensors"
    )


def split(batch: Any, microbatches: int) -> list[Any]:
    """Split ``batch`` into ``microbatches`` pieces along dimension 0.

    Tensors are cut with ``torch.tensor_split``: when the rows don't divide evenly the first
    microbatches get one row more. Lists as long as the batch are cut the same way; anything else
    (numbers, strings, other lists) is repeated in every microbatch.
    """
    rows = batch_size(batch)
    if microbatches > rows:
        raise ConfigurationError(
            f"microbatches={microbatches} is larger than the batch ({rows} rows); "
            f"use microbatches <= {rows} or a larger batch_size"
        )
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, microbatches))  # the cut below, in one call
    base, extra = divmod(rows, microbatches)
    lengths = [base + 1] * extra + [base] * (microbatches - extra)
    starts = [0, *itertools.accumulate(lengths)]
    return [_take(batch, rows, start, length) for start, length in zip(starts[:-1], lengths, strict=True)]


def _take(batch: Any, rows: int, start: int, length: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.narrow(0, start, length) if batch.dim() > 0 and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return (
            type(batch)(**{k: _take(v, rows, start, length) for k, v in batch.items()})
            if _is_plain(batch)
            else {k: _take(v, rows, start, length) for k, v in batch.items()}
        )
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(v, rows, start, length) for v in batch))
    if isinstance(batch, (tuple, list)):
        if len(batch) == rows and not any(isinstance(v, (torch.Tensor, Mapping, tuple, list)) for v in batch):
            return batch[start : start + length]
        return type(batch)(_take(v, rows, start, length) for v in batch)
    return batch


def _is_plain(mapping: Mapping[str, Any]) -> bool:
    return type(mapping) is not dict and all(isinstance(k, str) for k in mapping)


def gather(pieces: Sequence[Any]) -> Any:
    """Concatenate per-microbatch results along dimension 0 (tensors), recursively for containers."""
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(pieces))
        return torch.cat(list(pieces))
    if isinstance(first, Mapping):
        return (
            type(first)({k: gather([p[k] for p in pieces]) for k in first})
            if type(first) is dict
            else {k: gather([p[k] for p in pieces]) for k in first}
        )
    if isinstance(first, tuple):
        items = [gather([p[i] for p in pieces]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else tuple(items)
    if isinstance(first, list):
        return [item for p in pieces for item in p]
    if first is None:
        return None
    return list(pieces)
