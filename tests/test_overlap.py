"""Stages run concurrently: a 4-stage 1F1B step on CPU shows two stages computing at the same time,
each rank runs exactly its schedule's action list, and the printed grid is the schedule's."""

from __future__ import annotations

import lightning as L
import torch
from helpers import QUIET, Classifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.schedule import OneFOneB


def wide_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)], nn.Linear(256, 3))


def test_four_stage_1f1b_overlaps_and_follows_the_schedule(capsys) -> None:  # type: ignore[no-untyped-def]
    strategy = PipeStrategy(stages=4, microbatches=8, schedule="1f1b", partition=[2, 2, 2, 3])
    data = DataLoader(TensorDataset(torch.randn(512, 256), torch.randint(0, 3, (512,))), batch_size=256)
    L.Trainer(**QUIET, max_steps=2, strategy=strategy).fit(Classifier(wide_model()), data)
    # the pipeline is gone after fit, but the coordinator kept the last step's records
    result = strategy.last_step
    assert result is not None and result.schedule is not None
    expected = OneFOneB(4, 8).actions()
    for rank, records in enumerate(result.records):
        assert [name for name, _, _ in records] == [str(a) for a in expected[rank]]
    intervals = [(rank, start, end) for rank, records in enumerate(result.records) for _, start, end in records]
    overlaps = [
        (a, b)
        for i, a in enumerate(intervals)
        for b in intervals[i + 1 :]
        if a[0] != b[0] and a[1] < b[2] and b[1] < a[2]
    ]
    assert overlaps, "no two stages ever computed at the same time"
    busy = sum(end - start for _, start, end in intervals)
    span = max(e for _, _, e in intervals) - min(s for _, s, _ in intervals)
    assert busy / span > 1.0  # on average more than one stage is computing
    print(result.schedule.grid())
    grid = capsys.readouterr().out
    assert grid.splitlines()[0].startswith("rank 0 | 0F0 0F1 0F2 0F3")
    assert grid == OneFOneB(4, 8).grid() + "\n"
