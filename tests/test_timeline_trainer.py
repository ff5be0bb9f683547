"""`PipeStrategy(trace=...)` and the `PipeTrace` callback write the timeline of chosen training steps."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import lightning as L
import pytest
from helpers import QUIET, Classifier, loader, mlp

from lightning_pipe import PipeStrategy, PipeTrace
from lightning_pipe.schedule import get_schedule
from lightning_pipe.strategy import timeline as trace_module


def _tracks(path: Path) -> dict[tuple[int, int], list[str]]:
    events = json.loads(path.read_text())["traceEvents"]
    tracks: dict[tuple[int, int], list[tuple[float, str]]] = {}
    for e in events:
        if e["ph"] == "X" and e["cat"] in ("forward", "backward"):
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["name"]))
    return {key: [name for _, name in sorted(slices)] for key, slices in tracks.items()}


def test_strategy_trace_writes_steps_one_to_three(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    printed: list[str] = []
    monkeypatch.setattr(trace_module, "rank_zero_info", printed.append)
    path = tmp_path / "pipeline_trace.json"
    strategy = PipeStrategy(stages=4, microbatches=4, schedule="1f1b", partition="uniform", trace=str(path))
    trainer = L.Trainer(strategy=strategy, max_steps=4, **QUIET)
    trainer.fit(Classifier(mlp(depth=4)), loader())
    expected = [[str(a) for a in actions] for actions in get_schedule("1f1b")(4, 4, 1).actions()]
    tracks = _tracks(path)
    assert sorted({pid for pid, _ in tracks}) == [0, 1, 2]  # steps 1, 2 and 3
    for (_, rank), names in tracks.items():
        assert names == expected[rank]
    process_names = [
        e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"] if e["name"] == "process_name"
    ]
    assert [name.split(":")[0] for name in process_names] == ["step 1", "step 2", "step 3"]
    assert all("theoretical 0.429" in name for name in process_names)
    steps = [m for m in printed if m.startswith("PipeTrace: step")]
    assert len(steps) == 3 and all("bubble measured" in m and "theoretical 0.429" in m for m in steps)


def test_pipe_trace_callback_with_chosen_steps_and_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = PipeTrace(tmp_path / "t.json", steps=[0, 2], png=tmp_path / "t.png")
    strategy = PipeStrategy(stages=2, microbatches=4, schedule="gpipe", partition="uniform")
    trainer = L.Trainer(strategy=strategy, max_steps=3, callbacks=[trace], **QUIET)
    trainer.fit(Classifier(mlp(depth=4)), loader())
    assert [t.step for t in trace.timelines] == [0, 2]
    assert len(_tracks(tmp_path / "t.json")) == 2 * 2
    data = (tmp_path / "t.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24])[0] == 1200
