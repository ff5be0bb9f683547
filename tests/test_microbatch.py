"""Splitting batches into microbatches and gathering results."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lightning_pipe import ConfigurationError
from lightning_pipe.base.microbatch import batch_size, gather, split
from lightning_pipe.base.microbatch_weights import Microbatches
from lightning_pipe.partition import balance_by_cost


def test_split_uneven_spreads_the_remainder() -> None:
    pieces = split(torch.arange(10), 4)
    assert [len(p) for p in pieces] == [3, 3, 2, 2]
    assert torch.equal(gather(pieces), torch.arange(10))


def test_split_nested_batches() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {"x": torch.ones(6, 2), "names": list("abcdef"), "scale": 2.0, "pair": Pair(torch.zeros(6), torch.ones(6))}
    pieces = split(batch, 3)
    assert pieces[1]["names"] == ["c", "d"] and pieces[1]["scale"] == 2.0
    assert pieces[2]["pair"].y.shape == (2,) and isinstance(pieces[2]["pair"], Pair)
    assert batch_size(batch) == 6


def test_split_errors() -> None:
    with pytest.raises(ConfigurationError, match=r"microbatches=5 is larger than the batch \(4 rows\)"):
        split(torch.ones(4), 5)
    with pytest.raises(ConfigurationError, match="found no tensor"):
        split(["a", "b"], 1)


def test_a_batch_is_cut_and_weighted_in_one_call() -> None:
    batch = {"x": torch.arange(10), "y": torch.tensor([1, 1, 1, -100, -100, 1, 1, 1, 1, 1])}
    asked: list[int] = []
    rows = Microbatches.of(batch, lambda n: asked.append(n) or 4, None, "microbatch_weight")
    assert asked == [10] and rows.rows == 10
    assert [len(p["x"]) for p in rows.pieces] == [3, 3, 2, 2]  # as `split` cuts it
    assert rows.shares == [0.3, 0.3, 0.2, 0.2]
    tokens = Microbatches.of(batch, lambda n: 2, lambda p: (p["y"] != -100).sum(), "microbatch_weight")
    assert tokens.shares == [3 / 8, 5 / 8]
    with pytest.raises(ConfigurationError, match="microbatch_weight returned 0 for every microbatch"):
        Microbatches.of(batch, lambda n: 2, lambda p: 0, "microbatch_weight")


def test_gather_containers() -> None:
    assert gather([(torch.ones(1), [1]), (torch.zeros(2), [2])])[1] == [1, 2]
    assert gather([{"a": torch.ones(2)}, {"a": torch.ones(1)}])["a"].shape == (3,)


def test_balance_by_cost() -> None:
    assert balance_by_cost([1] * 8, 3) == [2, 3, 3]
    assert balance_by_cost([10, 1, 1, 1, 1, 10, 1, 1], 2) == [4, 4]
    assert balance_by_cost([100, 1, 1, 1], 2) == [1, 3]
    assert sum(balance_by_cost([3, 1, 4, 1, 5, 9, 2, 6], 4)) == 8
