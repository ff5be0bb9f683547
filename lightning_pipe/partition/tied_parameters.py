"""Tied weights: a ``Parameter`` that several shards use, and how its copies stay one weight.

With the local transport a tied weight stays one object in every shard (autograd sums into its one ``.grad``).
Where every stage has its own copy (rpc workers), `tied_parameters` lists the shards and local names holding
each shared weight: the coordinator sums the holders' gradients and sends the sum back before the optimizer
step, so every copy takes the same update (docs/internals.md: clipping and checkpoints).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def tied_parameters(shards: Sequence[nn.Module]) -> list[list[tuple[int, str]]]:
    """Parameters held by more than one shard: for each, the (shard index, local name) holding it."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for index, shard in enumerate(shards):
        for name, p in shard.named_parameters():
            holders.setdefault(id(p), []).append((index, name))
    return [places for places in holders.values() if len({i for i, _ in places}) > 1]
