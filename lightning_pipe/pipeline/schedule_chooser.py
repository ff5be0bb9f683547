"""``schedule="auto"`` over a pipeline's life: the first training step measures the stages, the second decides.

The pipeline is built where `schedule.auto.initial_placement` predicts best; the first step runs a probe (a
registered schedule of that placement that fits, splitting the backward where one can); the workers time every
action and measure what a microbatch stashes. Before the second step those records become each stage's costs and
`lightning_pipe.schedule.auto.choose` picks the schedule run from then on, in any placement the pipeline can move
its stages to (`lightning_pipe.pipeline.stage_moves`), logged once as a table. How the costs are made:
docs/internals.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_pipe.base.errors import ConfigurationError, ScheduleError
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.pipeline.recompute import HEADROOM
from lightning_pipe.pipeline.timeline import StepTimeline
from lightning_pipe.runtime import DeviceMemory
from lightning_pipe.schedule import (
    LOOP,
    AutoChoice,
    Kind,
    Schedule,
    StageCost,
    StepCosts,
    choose,
    initial_placement,
    placement_of,
    registered_schedules,
    stage_ranks,
)
from lightning_pipe.schedule.base import dependencies

if TYPE_CHECKING:
    from lightning_pipe.engine import Coordinator, StepResult

AUTO = "auto"


@dataclass(frozen=True)
class AutoSchedule:
    """``schedule="auto"`` with its options (``schedule=AutoSchedule(...)`` passes them; ``"auto"`` takes the defaults).

    Args:
        microbatches: choose the microbatch count too (``PipeStrategy(microbatches="auto")``), among
            ``ranks x {1, 2, 4, 8}`` up to the batch's rows.
        budget: most bytes of stashed activations a rank may hold; None: ``HEADROOM`` of its device's free
            memory (no limit where the device reports none: cpu).
        split_backward: whether the stages may split their backward into ``I`` and ``W`` (FSDP may not).
        agree: makes the pipeline replicas' choices one (launched mode: the first coordinator's, broadcast).
        placement: where to build the pipeline (`lightning_pipe.schedule.placement`); None: where
            `initial_placement` predicts best.
    """

    microbatches: bool = False
    budget: int | None = None
    split_backward: bool = True
    placement: str | None = None
    agree: Callable[[AutoChoice], AutoChoice] | None = field(default=None, compare=False)


def is_auto(schedule: Any) -> bool:
    return isinstance(schedule, AutoSchedule) or (isinstance(schedule, str) and schedule.lower() == AUTO)


def first_microbatches(rows: int, ranks: int) -> int:
    """``microbatches="auto"``'s count in the measured first step: two per rank, at most the rows."""
    return max(1, min(rows, 2 * ranks))


def microbatch_options(rows: int, ranks: int, measured: int) -> list[int]:
    """``microbatches="auto"``'s candidates: ``ranks x {1, 2, 4, 8}`` and the measured count, at most ``rows``."""
    return sorted({m for m in (ranks, 2 * ranks, 4 * ranks, 8 * ranks, measured) if 1 <= m <= rows} or {rows})


@dataclass(frozen=True)
class StageMoves:
    """Where a built pipeline can move its stages before the chosen schedule's first step, and how.

    ``placements``: the placements it can move them to; ``move(placement)`` moves them (keeping every state);
    ``why_not``: why the other placements are out of reach (shown with the choice).
    """

    placements: Sequence[str]
    move: Callable[[str], None]
    why_not: str = ""


class ScheduleChooser:
    """The state of ``schedule="auto"`` for one pipeline: the probe, the first step's record and the choice.

    It is the factory of the measured steps' schedules (the probe, `probe`), placed by ``placement``: where the
    pipeline is built (`initial_placement` for ``ranks`` ranks and ``microbatches`` microbatches; None: 4 per rank).
    """

    def __init__(
        self,
        options: AutoSchedule,
        virtual_stages: int,
        runner: str,
        ranks: int | None = None,
        microbatches: int | str | None = None,
    ) -> None:
        if runner == "linear":
            raise ConfigurationError(
                "schedule='auto' compares schedules by how they overlap the stages, but runner='linear' runs one "
                "stage at a time; name a schedule, or use runner='parallel'"
            )
        self.options = options
        self.virtual_stages = virtual_stages
        self.choice: AutoChoice | None = None
        self.steps = 0  # training steps begun
        self._first: StepResult | None = None  # the first training step's result: the measurement
        self._factories = registered_schedules()
        #: where the pipeline is built (a schedule's `placement`); unknown ranks: the loop
        self.placement = options.placement or LOOP
        if ranks is not None and options.placement is None:
            counted = microbatches if isinstance(microbatches, int) else 4 * ranks
            self.placement = initial_placement(self._factories, ranks, virtual_stages, counted, options.split_backward)

    def __call__(self, ranks: int, microbatches: int, virtual_stages: int) -> Schedule:
        return self.probe(ranks, microbatches, virtual_stages)

    # the probe: the first step's schedule
    def probe(self, ranks: int, microbatches: int, virtual_stages: int) -> Schedule:
        """The schedule of the measured steps: a registered one that fits (ranks, microbatches, virtual_stages)
        in ``placement``, not asynchronous; one that splits the backward where allowed, the smallest activation
        peak, then by name."""
        where = stage_ranks(self.placement, ranks * virtual_stages, ranks)
        found = []
        for name, factory in sorted(self._factories.items()):
            try:
                schedule = factory(ranks, microbatches, virtual_stages)
                lists = schedule.actions()
            except Exception:  # noqa: BLE001, S112 - a schedule that does not fit is not a probe
                continue
            if schedule.asynchronous or [schedule.rank_of(s) for s in range(schedule.num_stages)] != where:
                continue
            splits = any(a.kind is Kind.BACKWARD_INPUT for actions in lists for a in actions)
            if splits and not self.options.split_backward:
                continue
            found.append((not splits, max(schedule.peak_activations()), name, schedule))
        if not found:
            raise ScheduleError(
                f"schedule='auto' found no registered schedule for {ranks} ranks x {virtual_stages} stages each and "
                f"{microbatches} microbatches in placement {self.placement!r}; name a schedule"
            )
        return min(found, key=lambda f: f[:3])[3]

    # over the steps
    def before_step(
        self,
        coordinator: Coordinator,
        microbatches: int | str,
        rows: int,
        report: Callable[[str], Any],
        moves: StageMoves | None = None,
    ) -> int:
        """Call before each training step, before its batch is split: the microbatch count it runs with.

        Before the second step (or the first after a measured one) it decides, moves the stages where the choice
        is placed otherwise (``moves``; None: they stay), switches the coordinator's schedule and reports the choice.
        """
        self.steps += 1
        ranks = coordinator.num_stages // self.virtual_stages
        if self.choice is None and self._first is not None:
            self.choice = self._decide(coordinator, microbatches, rows, ranks, moves)
            if self.choice is not None:
                factory = self._factories[self.choice.chosen.name]
                built = list(coordinator.rank_of_stage)
                if stage_ranks(self.choice.chosen.placement, coordinator.num_stages, ranks) != built:
                    assert moves is not None, "a placement the pipeline cannot move to is not a candidate"
                    moves.move(self.choice.chosen.placement)
                    self.choice.notes.append(
                        f"(the stages moved from placement {self.placement!r} to {self.choice.chosen.placement!r} "
                        "before this step, their parameters, buffers, optimizer and generator states kept)"
                    )
                    self.placement = self.choice.chosen.placement
                coordinator.use_schedule(factory)
                report(f"lightning_pipe: {self.choice.table()}")
        if microbatches != AUTO:
            return int(microbatches)
        if self.choice is not None:
            return min(self.choice.chosen.microbatches, rows)
        return first_microbatches(rows, ranks)

    def after_step(self, result: StepResult) -> None:
        """Call after each training step: the first one is the measurement; later ones get their prediction."""
        if self.choice is None:
            if self._first is None:
                self._first = result
            return
        chosen = self.choice.chosen
        if len(result.losses) == chosen.microbatches:
            result.predicted = chosen.predicted

    def _decide(
        self, coordinator: Coordinator, microbatches: int | str, rows: int, ranks: int, moves: StageMoves | None
    ) -> AutoChoice | None:
        first, self._first = self._first, None
        assert first is not None
        held = {s: v for rank in coordinator.stages.call(StageProtocol.stash_held) for s, v in rank.items()}
        measured = measured_costs(first, coordinator.num_stages, held)
        if measured is None:  # the step did not get through every stage: measure the next one
            return None
        costs, notes = measured
        counts = microbatch_options(rows, ranks, costs.microbatches) if microbatches == AUTO else [int(microbatches)]
        budget = self.options.budget
        if budget is None:
            budget = _free_budget(coordinator.stages.call(StageProtocol.device_memory))
        reachable = [list(coordinator.rank_of_stage)]
        reachable += [stage_ranks(p, coordinator.num_stages, ranks) for p in (moves.placements if moves else ())]
        choice = choose(
            costs, self._factories, ranks, self.virtual_stages, counts, budget, self.options.split_backward, reachable
        )
        choice.notes.extend(notes)
        placed = {placement_of(f) for f in self._factories.values()}
        out = sorted(p for p in placed if stage_ranks(p, coordinator.num_stages, ranks) not in reachable)
        if out:
            why = moves.why_not if moves is not None and moves.why_not else "this pipeline cannot move its stages"
            choice.notes.append(
                f"(built in placement {self.placement!r}; schedules placed {', '.join(map(repr, out))} are predicted, "
                f"not candidates: {why})"
            )
        return self.options.agree(choice) if self.options.agree is not None else choice


def measured_costs(
    result: StepResult, num_stages: int, held: dict[int, tuple[int, int]]
) -> tuple[StepCosts, list[str]] | None:
    """Each stage's `StageCost` from a training step's records and the bytes it stashes; None where a stage
    has no record (the step did not run through)."""
    timeline = StepTimeline.from_result(result)
    compute: dict[tuple[int, Kind], list[float]] = {}
    overhead: dict[int, list[float]] = {}
    for rank in timeline.ranks:
        for t in rank:
            key = (t.action.stage, t.action.kind)
            compute.setdefault(key, []).append(t.part("compute") + t.part("loss"))
            overhead.setdefault(t.action.stage, []).append(max(0.0, t.overhead))
    latency = handoff_latency(timeline, num_stages)
    stages, estimated = [], []
    for s in range(num_stages):
        forward = compute.get((s, Kind.FORWARD))
        if not forward or s not in held:
            return None
        i, w = compute.get((s, Kind.BACKWARD_INPUT)), compute.get((s, Kind.BACKWARD_WEIGHT))
        if i and w:
            back_i, back_w = statistics.median(i), statistics.median(w)
        else:
            whole = compute.get((s, Kind.BACKWARD))
            if not whole:
                return None
            back_i = back_w = statistics.median(whole) / 2
            estimated.append(s)
        nbytes, split = held[s]
        other = statistics.median(overhead[s])  # each action's own time outside compute
        stages.append(StageCost(statistics.median(forward), back_i, back_w, other, nbytes, split))
    notes = [
        f"(other: each action's time outside compute; an input from another rank arrives the median hand-off, "
        f"{latency * 1e3:.3f} ms, after it was made)"
    ]
    if estimated:
        notes.append(
            f"(stages {', '.join(map(str, estimated))}: I and W estimated as half of the measured backward each; "
            "the measured step did not split it)"
        )
    return StepCosts(stages, timeline.num_microbatches(), latency), notes


def handoff_latency(timeline: StepTimeline, num_stages: int) -> float:
    """Median seconds from an input computed on another rank to the action that waited for it starting: the hand-off
    (sending it, the queue, pipe or wire). 0 without such waits."""
    where = {t.action: (r, t) for r, rank in enumerate(timeline.ranks) for t in rank}
    waits = []
    for r, rank in enumerate(timeline.ranks):
        previous = None
        for t in rank:
            inputs = [where[d][1] for d in dependencies(t.action, num_stages, where) if d in where and where[d][0] != r]
            if inputs:
                ready = max(d.compute_span[1] for d in inputs)  # the input made; sending it is part of the hand-off
                if previous is None or ready >= previous.end:  # the rank waited for it
                    waits.append(max(0.0, t.start - ready))
            previous = t
    return statistics.median(waits) if waits else 0.0


def _free_budget(per_rank: Sequence[dict[int, DeviceMemory | None]]) -> int | None:
    """``HEADROOM`` of the least free memory of the stages' devices; None where no device reports any (cpu)."""
    free = [info.free for rank in per_rank for info in rank.values() if info is not None]
    return int(min(free) * HEADROOM) if free else None
