"""`PipeTrace`: a callback that records the pipeline timeline of chosen training steps.

``PipeStrategy(trace="pipeline_trace.json")`` adds one; or pass it yourself::

    trainer = L.Trainer(strategy=PipeStrategy(stages=4), callbacks=[PipeTrace("trace.json", steps=[5, 6], png="t.png")])

The file is a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing): one row per
stage, a slice per forward and backward with the idle, receive and send time around it. For each
recorded step the measured bubble is logged beside the schedule's theoretical one.

In launched mode each coordinator writes its own file, named by its global rank where there are several
(docs/internals.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_pipe.pipeline.timeline import StepTimeline, render_png, write_chrome_trace


def own_path(path: str | os.PathLike[str], global_rank: int) -> Path:
    """``path`` for the coordinator of global rank ``global_rank``: ``trace.json`` -> ``trace-rank3.json``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-rank{global_rank}{path.suffix}")


class PipeTrace(pl.Callback):
    """Record the timeline of training steps ``steps`` (counted from 0 within each ``fit``).

    Args:
        path: where the Chrome trace JSON goes; written when the last chosen step is recorded (or
            when training ends earlier). In launched mode with several coordinators each writes its own
            file, its global rank in the name (`own_path`).
        steps: which training steps to record; the first step includes warm-up, so the default
            records steps 1, 2 and 3.
        png: also draw the steps as a Gantt chart into this PNG (needs matplotlib, extra ``plot``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] = "pipeline_trace.json",
        steps: Iterable[int] = (1, 2, 3),
        png: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = path
        self.steps = sorted(set(steps))
        self.png = png
        self.timelines: list[StepTimeline] = []
        self._step = 0
        self._written = False
        self._rank: int | None = None  # launched mode with several coordinators: this one's global rank

    @classmethod
    def of(cls, trace: PipeTrace | str | os.PathLike[str] | None) -> PipeTrace | None:
        """``PipeStrategy(trace=...)`` as a callback: a path records steps 1-3 there; None records nothing."""
        return trace if isinstance(trace, PipeTrace) or trace is None else cls(trace)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step, self.timelines, self._written = 0, [], False
        layout = getattr(trainer.strategy, "layout", None)  # launched mode's processes (None in one process)
        several = layout is not None and len(layout.coordinator_ranks) > 1  # each writes a file of its own
        self._rank = layout.global_rank if several and layout is not None else None

    def paths(self) -> tuple[str | os.PathLike[str], str | os.PathLike[str] | None]:
        """Where this process writes the trace and the PNG (`own_path` where several coordinators write)."""
        if self._rank is None:
            return self.path, self.png
        return own_path(self.path, self._rank), None if self.png is None else own_path(self.png, self._rank)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, self._step = self._step, self._step + 1
        if step not in self.steps or self._written:
            return
        result = getattr(trainer.strategy, "last_step", None)
        if result is None or not result.records:
            return
        timeline = StepTimeline.from_result(result, step)
        self.timelines.append(timeline)
        rank_zero_info(f"PipeTrace: {timeline.summary()}")
        if step == self.steps[-1]:
            self.write()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write()

    def write(self) -> None:
        """Write the recorded steps (once per fit)."""
        if self._written or not self.timelines:
            return
        self._written = True
        path, png = self.paths()
        write_chrome_trace(path, self.timelines)
        message = f"PipeTrace: wrote {len(self.timelines)} step(s) to {os.fspath(path)}"
        if png is not None:
            render_png(png, self.timelines)
            message += f" and {os.fspath(png)}"
        if self._rank is not None:
            message += " (each coordinator writes its pipeline's, its global rank in the name)"
        rank_zero_info(message)
