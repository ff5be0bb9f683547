"""Pipeline timelines: Chrome trace JSON, bubble numbers and the PNG Gantt chart."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.pipeline.timeline import (
    StepTimeline,
    chrome_trace,
    render_png,
    theoretical_bubble,
    write_chrome_trace,
)
from lightning_pipe.schedule import get_schedule


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])


@pytest.fixture(scope="module", params=["1f1b", "gpipe"])
def timelines(request: pytest.FixtureRequest) -> list[StepTimeline]:
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    with Pipeline(_model(), stages=4, schedule=request.param, partition="uniform", timeout=30) as pipe:
        return [StepTimeline.from_result(pipe.train_step(x, y, F.mse_loss, microbatches=4), step) for step in range(2)]


def test_chrome_trace_has_one_track_per_stage_and_the_schedules_actions(
    timelines: list[StepTimeline], tmp_path: Path
) -> None:
    path = tmp_path / "trace.json"
    write_chrome_trace(path, timelines)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    for event in events:
        assert {"name", "ph", "pid", "tid"} <= event.keys()
        if event["ph"] == "X":
            assert event["ts"] >= 0 and event["dur"] >= 0
        else:
            assert event["ph"] == "M"
    schedule = timelines[0].schedule
    assert schedule is not None
    expected = [[str(a) for a in actions] for actions in schedule.actions()]
    for pid in range(len(timelines)):
        names = {e["tid"]: e["args"]["name"] for e in events if e["pid"] == pid and e["name"] == "thread_name"}
        assert names == {rank: f"stage {rank}" for rank in range(4)}
        for rank in range(4):
            slices = [
                e for e in events if e["pid"] == pid and e["tid"] == rank and e.get("cat") in ("forward", "backward")
            ]
            assert [e["name"] for e in sorted(slices, key=lambda e: e["ts"])] == expected[rank]
            parts = {e["cat"] for e in events if e["pid"] == pid and e["tid"] == rank and e["ph"] == "X"}
            assert {"idle", "recv", "send"} <= parts


def test_slices_of_a_rank_do_not_overlap(timelines: list[StepTimeline]) -> None:
    events = [e for e in chrome_trace(timelines[:1])["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == rank)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end - 1e-3


def test_bubble_numbers(timelines: list[StepTimeline]) -> None:
    timeline = timelines[-1]
    assert timeline.theoretical_bubble() == pytest.approx(3 / 7)  # (S-1)/(M+S-1)
    assert 0.0 < timeline.idle_fraction() <= timeline.measured_bubble() < 1.0
    assert timeline.overhead_per_microbatch() > 0.0
    summary = timeline.summary()
    assert "bubble measured" in summary and "theoretical 0.429" in summary


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 8), (4, 8), (3, 5)])
def test_theoretical_bubble_matches_the_formula(stages: int, microbatches: int) -> None:
    for name in ("gpipe", "1f1b"):
        schedule = get_schedule(name)(stages, microbatches, 1)
        assert theoretical_bubble(schedule) == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_png_renders_at_the_requested_size(timelines: list[StepTimeline], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    render_png(path, timelines, width=900, height=500)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (900, 500)
    assert len(data) > 5000


def test_png_without_matplotlib_says_how_to_install_it(
    timelines: list[StepTimeline], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.patches"):
        monkeypatch.setitem(__import__("sys").modules, name, None)
    with pytest.raises(ImportError, match=r"lightning_pipe\[plot\]"):
        render_png(tmp_path / "x.png", timelines)
