"""The new schedules and runners through a real Trainer: same gradients and parameters as without the strategy."""

from __future__ import annotations

import pytest
import torch
from helpers import Classifier, max_param_diff, mlp
from test_transparency import fit

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError, ScheduleError


@pytest.mark.parametrize(
    "schedule,virtual,runner",
    [
        ("interleaved-1f1b", 2, "parallel"),
        ("zero-bubble", 1, "parallel"),
        ("zero-bubble", 1, "dataflow"),
        ("interleaved-1f1b", 2, "linear"),
        ("1f1b", 1, "dataflow"),
    ],
)
def test_trainer_equals_unsplit(schedule: str, virtual: int, runner: str) -> None:
    piped, plain = Classifier(mlp(depth=6)), Classifier(mlp(depth=6))
    strategy = PipeStrategy(
        stages=4,
        microbatches=4,
        schedule=schedule,
        virtual_stages=virtual,
        runner=runner,
        checkpoint="except_last",
        partition="uniform",
    )
    got, want = fit(piped, strategy), fit(plain, None)
    assert len(got.grads) == len(want.grads) == 3
    for g, w in zip(got.grads[0], want.grads[0], strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert max_param_diff(piped, plain) < 1e-5


def test_strategy_rejects_bad_schedule_settings_early() -> None:
    with pytest.raises(ConfigurationError, match="unknown runner"):
        PipeStrategy(stages=2, runner="fast")
    with pytest.raises(ConfigurationError, match="not a multiple of virtual_stages=2"):
        PipeStrategy(stages=3, virtual_stages=2, schedule="interleaved-1f1b")
    with pytest.raises(ScheduleError, match="unknown schedule"):
        PipeStrategy(stages=2, schedule="zero_bubble")
    with pytest.raises(ConfigurationError, match="train_async"):
        PipeStrategy(stages=2, schedule="async", transport="rpc")
