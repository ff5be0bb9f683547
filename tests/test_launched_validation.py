"""Launched mode: Lightning frees the gradients before validation only after the stages ran the optimizer step
posted to them (`launched_validation.py`: an optimizer step that reads the gradients twice, 0.3 s apart).
Before the fix the coordinator's process freed them meanwhile: the step failed, or the process crashed
(SIGSEGV), in a few of every dozen runs of the digits example and in every run of this one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launching import ROOT, lightning_launch

pytestmark = pytest.mark.slow


def test_validation_after_a_launched_epoch_waits_for_the_stages_optimizer_step(tmp_path: Path) -> None:
    run = lightning_launch(str(ROOT / "tests" / "launched_validation.py"), ["--out", str(tmp_path)], timeout=180)
    assert run.ok, run.output[-4000:]
    assert "were freed during the optimizer step" not in run.output
    stages = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert sorted(stages[0]) == ["model.2.bias", "model.2.weight"]  # the coordinator's process: the last stage
    assert sorted(stages[1]) == ["model.0.bias", "model.0.weight"]
    assert all(bool(t.isfinite().all()) for stage in stages for t in stage.values())
