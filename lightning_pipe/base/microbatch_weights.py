"""Each microbatch's share of its batch's loss: its rows by default, or what the user's function counts.

A step's loss is the sum of the microbatches' losses, each times its share. With shares
proportional to what the loss averages over (rows for a per-row mean; valid tokens for a language
model whose padding labels are -100), the piped step equals the unsplit step. A microbatch of
weight 0 contributes nothing: its loss (a mean over nothing, NaN) is neither added nor backpropagated.
A step asks once for its batch cut and weighted (`Microbatches.of`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.base.microbatch import batch_size, split

MicrobatchWeight = Callable[..., Any]  # a microbatch -> its weight (a number or a 0-d tensor)

_EXAMPLE = "e.g. the count of labelled tokens, (labels != -100).sum()"


@dataclass(frozen=True)
class Microbatches:
    """A batch cut into microbatches along dimension 0, each with its share of the batch's loss."""

    pieces: list[Any]
    rows: int  # the batch's
    shares: list[float]  # each piece's, summing to 1

    @classmethod
    def of(
        cls, batch: Any, count: Callable[[int], int], function: MicrobatchWeight | None, argument: str
    ) -> Microbatches:
        """``batch`` cut into ``count(rows)`` pieces (`split`), each weighted by `shares` (``argument`` names the
        weight function in errors)."""
        rows = batch_size(batch)
        pieces = split(batch, count(rows))
        return cls(pieces, rows, shares(pieces, function, argument))


def check_weight_function(function: Any, argument: str) -> None:
    """``function`` is None (rows) or callable; raises `ConfigurationError` naming ``argument`` otherwise."""
    if function is not None and not callable(function):
        raise ConfigurationError(
            f"{argument} got {function!r}, which is not callable; pass a function of a microbatch returning its weight "
            f"({_EXAMPLE}), or None to weight each microbatch by its rows"
        )


def shares(pieces: Sequence[Any], function: MicrobatchWeight | None, argument: str) -> list[float]:
    """Each microbatch's share of the batch: ``function(piece)`` normalised over the batch, or its rows."""
    if function is None:
        return normalised_weights([batch_size(p) for p in pieces], "the rows of the microbatches")
    return normalised_weights([function(p) for p in pieces], argument)


def normalised_weights(raw: Sequence[Any], argument: str) -> list[float]:
    """The microbatches' shares of the batch: ``raw`` (what ``argument`` returned) divided by its sum.

    Every value must be a finite number >= 0 (or a 0-d tensor holding one), and one at least > 0.
    """
    values = [_as_number(value, i, argument) for i, value in enumerate(raw)]
    total = math.fsum(values)
    if total <= 0:
        raise ConfigurationError(
            f"{argument} returned 0 for every microbatch of the batch ({values}): the batch has nothing for "
            "its loss to average over; return what the loss averages over (rows, or labelled tokens) and feed "
            "batches that have some"
        )
    return [value / total for value in values]


def _as_number(value: Any, index: int, argument: str) -> float:
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        number = float(value.detach())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
        raise ConfigurationError(
            f"{argument} returned {type(value).__name__}{shape} for microbatch {index}; "
            f"return a number or a 0-d tensor ({_EXAMPLE})"
        )
    if not math.isfinite(number) or number < 0:
        raise ConfigurationError(
            f"{argument} returned {number} for microbatch {index}; a weight must be a finite number >= 0 ({_EXAMPLE})"
        )
    return number
