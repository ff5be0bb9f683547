"""The memory plan: predicted stash peaks per rank against what the stage workers measure."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe import Pipeline
from lightning_pipe.pipeline.memory_plan import plan
from lightning_pipe.schedule import get_schedule


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(64), nn.Linear(64, 32))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block() for _ in range(8)], nn.Linear(32, 3))


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_predicted_peak_matches_the_measured_stash(schedule: str, checkpoint: str) -> None:
    """4 stages x 8 microbatches: every rank's measured peak within 10% of the prediction."""
    x, y = torch.randn(64, 32), torch.randint(0, 3, (64,))
    net = model()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    predicted = plan(net, x, stages=4, microbatches=8, schedule=schedule, checkpoint=checkpoint, partition="uniform")
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items()), "planning changed the model"
    with Pipeline(net, stages=4, schedule=schedule, checkpoint=checkpoint, partition="uniform") as pipe:
        pipe.train_step(x, y, F.cross_entropy, microbatches=8)
        measured = pipe.stash_peaks()
    assert len(measured) == len(predicted.rank_peak_bytes) == 4
    for got, want in zip(measured, predicted.rank_peak_bytes, strict=True):
        assert abs(got - want) <= 0.1 * want, (measured, predicted.rank_peak_bytes)
    assert predicted.rank_peak_activations == get_schedule(schedule)(4, 8, 1).peak_activations()


def test_peaks_follow_the_schedule() -> None:
    """GPipe holds all 8 microbatches everywhere; 1F1B's first rank 4 of them; checkpointing stores inputs only."""
    x = torch.randn(64, 32)
    gpipe = plan(model(), x, stages=4, microbatches=8, schedule="gpipe", checkpoint="never", partition="uniform")
    onefoneb = plan(model(), x, stages=4, microbatches=8, schedule="1f1b", checkpoint="never", partition="uniform")
    ckpt = plan(model(), x, stages=4, microbatches=8, schedule="1f1b", checkpoint="always", partition="uniform")
    per_mb = gpipe.stages[0].activation_bytes
    assert gpipe.rank_peak_bytes[0] == 8 * per_mb
    assert onefoneb.rank_peak_bytes[0] == 4 * per_mb
    assert ckpt.stages[0].activation_bytes == 8 * 32 * 4  # one microbatch of input: 8 rows x 32 floats
    assert all(c < o for c, o in zip(ckpt.rank_peak_bytes, onefoneb.rank_peak_bytes, strict=True))
    assert [st.peak_held for st in gpipe.stages] == [8, 8, 8, 8]


def test_plan_table_and_virtual_stages(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan(
        model(),
        torch.randn(16, 32),
        stages=4,
        microbatches=4,
        schedule="interleaved-1f1b",
        virtual_stages=2,
        partition="uniform",
        verbose=True,
    )
    printed = capsys.readouterr().out
    assert printed.strip() == result.table().strip()
    assert "schedule=interleaved-1f1b" in printed and "rank 1: peak" in printed
    assert [st.rank for st in result.stages] == [0, 1, 0, 1]
    assert len(result.rank_peak_bytes) == 2
