"""Tied weights: a ``Parameter`` that several shards use, and how its copies stay one weight.

Tied weights (an embedding and an output head sharing one ``Parameter``) stay one object in every
shard that uses them. With the local transport all stages are threads of one process, so autograd
sums both stages' contributions into the one ``.grad`` and the optimizer updates it once; the
LightningModule's ``state_dict`` is untouched and holds it under the original keys (the local
transport refuses stages that share a tensor but sit on different devices). With a transport that
gives every stage its own copy (RPC workers unpickle each shard separately), `tied_parameters` (a
`TracedPartitioner`'s ``tied``) lists, per shared weight, the shards and local names that hold it, and
the design is:

- after ``apply_grads`` the coordinator fetches each holder's gradient of the weight, sums them and
  sends the sum back to every holder, before the optimizer step;
- every holder's optimizer then applies the same update to its copy from the same state, so the
  copies stay equal (the equality is cheap to assert after a step);
- gradient clipping counts a tied weight once (the first holder's copy) when it computes the norm;
- a checkpoint takes the weight from the first holder; each shard's ``state_dict`` already uses the
  model's own keys, so the merged dictionary is the unsplit model's.
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
