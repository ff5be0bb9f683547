"""Pipeline timelines: a step's per-rank records as a Chrome trace, a PNG Gantt chart and bubble numbers.

Stage workers time every action of a step and its parts (``idle``, ``recv``, ``loss``, ``compute``,
``send``); the coordinator returns them in ``StepResult.records``, and `StepTimeline` reads them::

    timeline = StepTimeline.from_result(pipe.train_step(x, y, loss_fn, microbatches=8), step=0)
    print(timeline.summary())          # measured bubble beside the schedule's theoretical one
    write_chrome_trace("pipeline_trace.json", [timeline])   # ui.perfetto.dev or chrome://tracing
    render_png("pipeline_trace.png", [timeline])            # needs matplotlib (extra ``plot``)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_pipe.schedule import Action, Kind, Schedule, simulate

Record = tuple[str, float, float]  # (text, start, end) as recorded by a stage worker
PARTS = ("idle", "recv", "loss", "compute", "send")

_COLORS = {
    "F": "#4C72B0",
    "B": "#55A868",
    "I": "#8CC08C",
    "W": "#2F6B3F",
    "recv": "#DD8452",
    "send": "#C44E52",
    "loss": "#8172B3",
}


@dataclass
class ActionTiming:
    """One action of one rank: its span (the work, from when its inputs were there) and its parts.

    ``idle`` (waiting for the inputs) precedes the span; ``recv``, ``loss``, ``compute`` and
    ``send`` lie inside it. Seconds of the workers' clock.
    """

    action: Action
    rank: int
    start: float
    end: float
    parts: dict[str, tuple[float, float]] = field(default_factory=dict)

    def part(self, name: str) -> float:
        """Seconds spent in ``name`` (one of `PARTS`); compute defaults to the whole span when unrecorded."""
        if name in self.parts:
            start, end = self.parts[name]
            return end - start
        if name == "compute":
            return self.end - self.start - self._idle_inside()
        return 0.0

    def _idle_inside(self) -> float:
        """Waiting recorded inside the span (workers that time the wait as part of the action)."""
        if "idle" not in self.parts:
            return 0.0
        start, end = self.parts["idle"]
        return max(0.0, min(end, self.end) - max(start, self.start))

    @property
    def compute_span(self) -> tuple[float, float]:
        if "compute" in self.parts:
            return self.parts["compute"]
        return (self.start + self._idle_inside(), self.end)

    @property
    def busy(self) -> float:
        """Seconds of the span not spent waiting."""
        return self.end - self.start - self._idle_inside()

    @property
    def overhead(self) -> float:
        """Seconds of this action outside compute (the stage's and the loss) and waiting: the engine's own cost."""
        return self.busy - self.part("compute") - self.part("loss")


@dataclass
class StepTimeline:
    """Every rank's actions of one step, with the schedule that produced them."""

    step: int
    ranks: list[list[ActionTiming]]
    schedule: Schedule | None = None
    predicted: float | None = None  # seconds ``schedule="auto"`` predicted for this step when it chose

    @classmethod
    def from_records(
        cls,
        records: Sequence[Sequence[Record]],
        schedule: Schedule | None = None,
        step: int = 0,
        parts_of_ranks: Sequence[Sequence[Record]] = (),
    ) -> StepTimeline:
        """From each rank's action records (``("1F0", start, end)``) and their parts (``("1F0 idle", ...)``)."""
        ranks: list[list[ActionTiming]] = []
        for rank, rank_records in enumerate(records):
            parts: dict[str, dict[str, tuple[float, float]]] = {}
            timings: list[ActionTiming] = []
            rank_parts = parts_of_ranks[rank] if rank < len(parts_of_ranks) else []
            for text, start, end in [*(rank_records or []), *(rank_parts or [])]:
                name, _, part = text.partition(" ")
                if part:
                    parts.setdefault(name, {})[part] = (start, end)
                else:
                    timings.append(ActionTiming(Action.parse(name), rank, start, end))
            for timing in timings:
                timing.parts = parts.get(str(timing.action), {})
            ranks.append(sorted(timings, key=lambda t: t.start))
        return cls(step, ranks, schedule)

    @classmethod
    def from_result(cls, result: Any, step: int = 0) -> StepTimeline:
        """From a `StepResult` (``Coordinator.last_result``, ``Pipeline.train_step``'s return value)."""
        timeline = cls.from_records(result.records, result.schedule, step, getattr(result, "parts", ()))
        timeline.predicted = getattr(result, "predicted", None)
        return timeline

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def start(self) -> float:
        """When the first rank began the step (its first action, or its first wait for inputs)."""
        return min(min(t.start, t.parts.get("idle", (t.start,))[0]) for rank in self.ranks for t in rank)

    @property
    def end(self) -> float:
        return max(t.end for rank in self.ranks for t in rank)

    @property
    def duration(self) -> float:
        """Seconds from the first action's start to the last action's end, over all ranks."""
        return self.end - self.start

    def num_microbatches(self) -> int:
        return 1 + max(t.action.microbatch for rank in self.ranks for t in rank)

    def compute(self, rank: int | None = None) -> float:
        """Seconds spent in forward and backward compute (one rank, or summed over all)."""
        ranks = self.ranks if rank is None else [self.ranks[rank]]
        return sum(t.part("compute") for timings in ranks for t in timings)

    def measured_bubble(self) -> float:
        """Fraction of the ranks' time in this step not spent computing: idle waits and engine overhead."""
        total = self.duration * self.num_ranks
        return 1.0 - self.compute() / total if total > 0 else 0.0

    def idle_fraction(self) -> float:
        """Fraction of the ranks' time spent waiting for inputs, before the first and after the last action."""
        total = self.duration * self.num_ranks
        busy = sum(t.busy for rank in self.ranks for t in rank)
        return 1.0 - busy / total if total > 0 else 0.0

    def overhead_per_microbatch(self) -> float:
        """Seconds per microbatch the engine spends outside compute and waiting (recv, send, bookkeeping)."""
        return sum(t.overhead for rank in self.ranks for t in rank) / self.num_microbatches()

    def theoretical_bubble(self) -> float | None:
        """The schedule's bubble with equal action times; ``(S-1)/(M+S-1)`` for gpipe and 1f1b."""
        return None if self.schedule is None else theoretical_bubble(self.schedule)

    def summary(self) -> str:
        """One line: step time, measured bubble beside the theoretical one, engine overhead."""
        theory = self.theoretical_bubble()
        name = getattr(self.schedule, "name", "?")
        m, s = self.num_microbatches(), self.num_ranks
        text = (
            f"step {self.step}: {self.duration * 1e3:.1f} ms, {s} ranks x {m} microbatches ({name}); "
            f"bubble measured {self.measured_bubble():.3f} (idle {self.idle_fraction():.3f})"
        )
        if theory is not None:
            text += f", theoretical {theory:.3f}"
        if self.predicted is not None:
            text += f"; predicted {self.predicted * 1e3:.1f} ms (schedule='auto')"
        overhead = self.overhead_per_microbatch()
        compute = self.compute() / m
        share = overhead / compute if compute > 0 else 0.0
        return text + f"; engine overhead {overhead * 1e3:.3f} ms per microbatch ({share:.1%} of compute)"


def theoretical_bubble(schedule: Schedule) -> float:
    """Idle fraction of ``schedule`` when every action takes the same time (its own grid).

    For gpipe and 1f1b this is ``(S-1)/(M+S-1)``; other schedules get the value of their own grid.
    """
    lists = schedule.actions()
    start = simulate(lists, schedule.num_stages)
    makespan = max(start.values()) + 1
    busy = sum(len(actions) for actions in lists)
    return 1.0 - busy / (makespan * len(lists))


# Chrome trace / Perfetto
def chrome_trace(timelines: Sequence[StepTimeline]) -> dict[str, Any]:
    """The Chrome trace event format: one process per step, one thread (track) per rank, ``X`` slices.

    Forward and backward slices are named by their action (``"1F0"``) with category ``forward`` or
    ``backward``; ``recv``, ``send`` and ``idle`` slices sit between them. Times are microseconds
    from the step's first action.
    """
    events: list[dict[str, Any]] = []
    for pid, timeline in enumerate(timelines):
        origin = timeline.start
        theory = timeline.theoretical_bubble()
        label = f"step {timeline.step}: bubble {timeline.measured_bubble():.3f}"
        if theory is not None:
            label += f" (theoretical {theory:.3f})"
        label += _prediction(timeline)
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for rank, timings in enumerate(timeline.ranks):
            name = _track_name(timings)
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": name}})
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": rank, "args": {"sort_index": rank}}
            )
            for timing in timings:
                events.extend(_slices(timing, pid, origin, timeline.step))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _track_name(timings: Sequence[ActionTiming]) -> str:
    stages = sorted({t.action.stage for t in timings})
    if len(stages) == 1:
        return f"stage {stages[0]}"
    return "stages " + ", ".join(map(str, stages))


def _slices(timing: ActionTiming, pid: int, origin: float, step: int) -> list[dict[str, Any]]:
    action = timing.action
    args = {"step": step, "stage": action.stage, "microbatch": action.microbatch}
    category = "forward" if action.kind is Kind.FORWARD else "backward"
    spans = [(str(action), category, *timing.compute_span)]
    for part in ("idle", "recv", "loss", "send"):
        if part in timing.parts:
            spans.append((f"{part} {action}" if part != "idle" else "idle", part, *timing.parts[part]))
    return [
        {
            "name": name,
            "cat": cat,
            "ph": "X",
            "pid": pid,
            "tid": timing.rank,
            "ts": round((start - origin) * 1e6, 3),
            "dur": round((end - start) * 1e6, 3),
            "args": args,
        }
        for name, cat, start, end in spans
    ]


def write_chrome_trace(path: str | os.PathLike[str], timelines: Sequence[StepTimeline]) -> None:
    """Write `chrome_trace` as JSON (open it in ui.perfetto.dev or chrome://tracing)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(timelines), f)


# PNG Gantt chart
def render_png(
    path: str | os.PathLike[str],
    timelines: Sequence[StepTimeline],
    width: int = 1200,
    height: int | None = None,
    dpi: int = 100,
) -> None:
    """Draw each step as a Gantt chart (one row per rank) into a ``width`` x ``height`` pixel PNG.

    Needs matplotlib (``pip install 'lightning_pipe[plot]'``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "rendering a pipeline timeline as PNG needs matplotlib: pip install 'lightning_pipe[plot]' "
            "(or pip install matplotlib); the Chrome trace JSON needs nothing extra"
        ) from exc
    if not timelines:
        raise ValueError("render_png needs at least one step timeline")
    rows = sum(t.num_ranks for t in timelines)
    height = height or int(dpi * (1.2 + 0.45 * rows + 0.6 * len(timelines)))
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(timelines), 1, squeeze=False)[:, 0]
    for ax, timeline in zip(axes, timelines, strict=True):
        _draw(ax, timeline, width)
    legend = [Patch(color=_COLORS[k], label=label) for k, label in (("F", "forward"), ("B", "backward"))]
    legend += [Patch(color=_COLORS[k], label=k) for k in ("loss", "recv", "send")]
    figure.legend(handles=legend, loc="lower center", ncol=len(legend), frameon=False, fontsize=8)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=dpi)


def _draw(ax: Any, timeline: StepTimeline, width: int) -> None:
    origin = timeline.start
    pixels_per_second = 0.8 * width / max(timeline.duration, 1e-9)
    for rank, timings in enumerate(timeline.ranks):
        for timing in timings:
            start, end = timing.compute_span
            kind = timing.action.kind.value
            ax.barh(rank, (end - start) * 1e3, left=(start - origin) * 1e3, height=0.8, color=_COLORS[kind])
            label = f"{kind}{timing.action.microbatch}"
            if (end - start) * pixels_per_second > 8 * len(label):  # only where the label fits
                middle = (start + end - 2 * origin) / 2 * 1e3
                ax.text(middle, rank, label, ha="center", va="center", fontsize=7, color="w")
            for part in ("recv", "loss", "send"):
                if part in timing.parts:
                    p0, p1 = timing.parts[part]
                    ax.barh(rank, (p1 - p0) * 1e3, left=(p0 - origin) * 1e3, height=0.8, color=_COLORS[part])
    ax.set_yticks(range(timeline.num_ranks))
    ax.set_yticklabels([_track_name(timings) for timings in timeline.ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.duration * 1e3)
    ax.set_xlabel("ms")
    theory = timeline.theoretical_bubble()
    title = f"step {timeline.step} ({getattr(timeline.schedule, 'name', '?')}): bubble {timeline.measured_bubble():.3f}"
    if theory is not None:
        title += f", theoretical {theory:.3f}"
    ax.set_title(title + _prediction(timeline), fontsize=9)


def _prediction(timeline: StepTimeline) -> str:
    """The measured step time beside ``schedule="auto"``'s prediction, where there is one."""
    if timeline.predicted is None:
        return ""
    return f"; {timeline.duration * 1e3:.1f} ms, predicted {timeline.predicted * 1e3:.1f} ms"
