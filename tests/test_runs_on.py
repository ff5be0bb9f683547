"""The device check of the cuda tests (`helpers.RunsOn`), shown on CPU: it starts each stage, passes where the
stage runs on the named device type and fails the step where it does not (a silent fallback)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import RunsOn, checked_mlp

from lightning_pipe import Pipeline
from lightning_pipe.base.errors import PipeError


def test_each_stage_starts_with_a_check_and_a_stage_elsewhere_fails_the_step() -> None:
    x, y = torch.randn(8, 8), torch.zeros(8, dtype=torch.long)
    model, partition = checked_mlp("cpu")
    with Pipeline(model, stages=2, partition=partition) as pipe:
        assert all(isinstance(model[int(shard.layers[0])], RunsOn) for shard in pipe.shards)
        assert pipe.balance == partition
        pipe.train_step(x, y, F.cross_entropy, microbatches=2)  # on cpu: passes
    model, partition = checked_mlp("cuda")
    with pytest.raises((PipeError, RuntimeError), match="this stage ran on cpu, not on cuda"):
        with Pipeline(model, stages=2, partition=partition) as pipe:
            pipe.train_step(x, y, F.cross_entropy, microbatches=2)
