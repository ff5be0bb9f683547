"""PipeStrategy(...).plan(model, sample_batch): the memory plan per stage, before training."""

from __future__ import annotations

import torch
from helpers import Classifier, mlp

from lightning_pipe import PipeStrategy


def test_plan_of_a_lightning_module_prints_per_stage(capsys) -> None:  # type: ignore[no-untyped-def]
    module = Classifier(mlp(depth=6, width=32))
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    gpipe = PipeStrategy(stages=4, microbatches=8, schedule="gpipe", checkpoint="never").plan(module, batch)
    table = capsys.readouterr().out
    assert "memory plan: schedule=gpipe, microbatches=8" in table
    assert len(gpipe.stages) == 4 and all(f"rank {r}: peak" in table for r in range(4))
    assert gpipe.rank_peak_activations == [8, 8, 8, 8]
    one_f_one_b = PipeStrategy(stages=4, microbatches=8, checkpoint="never").plan(module, batch, verbose=False)
    assert one_f_one_b.rank_peak_activations == [4, 3, 2, 1]
    assert one_f_one_b.rank_peak_bytes[0] < gpipe.rank_peak_bytes[0]
    # the module is untouched afterwards
    assert "forward" not in module.model.__dict__ and "log" not in module.__dict__


def test_plan_of_the_pipelined_module_and_its_input() -> None:
    plan = PipeStrategy(stages=2, microbatches=4).plan(mlp(), torch.randn(8, 8), verbose=False)
    assert len(plan.stages) == 2 and plan.rank_peak_activations == [2, 1]
