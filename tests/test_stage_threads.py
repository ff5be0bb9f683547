"""Intra-op threads of stage workers: each CPU stage takes its share of the cores, the caller keeps its own."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.comm.local import stage_threads
from lightning_pipe.pipeline.pipeline import Pipeline


class ThreadProbe(nn.Module):
    """Identity that remembers how many intra-op threads the thread running it uses."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return x


def test_default_shares_the_cores_among_cpu_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert stage_threads(None, ["cpu", "cpu"]) == 4
    assert stage_threads(None, ["cpu"] * 3) == 2
    assert stage_threads(None, ["cpu"] * 16) == 1
    assert stage_threads(None, ["cuda", "cuda"]) is None
    assert stage_threads(None, ["cuda", "cpu"]) == 8
    assert stage_threads(3, ["cpu", "cpu"]) == 3
    assert stage_threads(3, ["cuda"]) is None


def test_stage_threads_use_their_count_and_the_caller_keeps_its_own() -> None:
    before = torch.get_num_threads()
    probes = [ThreadProbe(), ThreadProbe()]
    model = nn.Sequential(nn.Linear(4, 4), probes[0], nn.Linear(4, 4), probes[1])
    with Pipeline(model, stages=2, partition=[2, 2], threads=1, timeout=30) as pipe:
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss, microbatches=2)
    assert probes[0].seen and probes[1].seen
    assert set(probes[0].seen) == set(probes[1].seen) == {1}
    assert torch.get_num_threads() == before


def test_the_coordinator_shares_the_cores_during_a_step_and_restores_its_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    seen: list[int] = []

    def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())  # the loss runs on the coordinator's thread
        return F.mse_loss(output, target)

    try:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        with Pipeline(model, stages=2, partition=[1, 1], threads=1, timeout=30) as pipe:
            pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), criterion, microbatches=2)
            assert seen == [1, 1]
            assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
