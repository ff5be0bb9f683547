"""``schedule="auto"``'s decision: every schedule that fits, simulated with the stages' measured costs.

Pure: measured costs in, a choice out, no model and no devices (`lightning_pipe.pipeline.schedule_chooser` measures)::

    costs = StepCosts([StageCost(forward=2e-3, backward_input=2e-3, backward_weight=1.5e-3, activation_bytes=...)],
                      microbatches=8)
    choice = choose(costs, registered_schedules(), ranks=2, virtual_stages=1, microbatches=[8])
    print(choice.table())            # every candidate's predicted step time; the chosen one marked

The cost model: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.base.units import size_text
from lightning_pipe.schedule.action import Action, Kind
from lightning_pipe.schedule.base import Schedule, makespan
from lightning_pipe.schedule.placement import LOOP, placement_of
from lightning_pipe.schedule.stash_walk import walk

ScheduleFactory = Callable[..., Schedule]


@dataclass(frozen=True)
class StageCost:
    """One stage, per microbatch of the measured step: seconds of each kind of action and the bytes it stashes."""

    forward: float  # compute seconds of F (with the loss, on the stage that computes it)
    backward_input: float  # I: the input gradient
    backward_weight: float  # W: the weight gradient (a whole backward B costs I + W)
    overhead: float = 0.0  # seconds per action outside compute: receiving, sending, bookkeeping, the hand-off
    activation_bytes: int = 0  # stashed from F until B (or W)
    split_bytes: int = 0  # more, from I until W

    def compute(self, kind: Kind) -> float:
        if kind is Kind.FORWARD:
            return self.forward
        if kind is Kind.BACKWARD_INPUT:
            return self.backward_input
        if kind is Kind.BACKWARD_WEIGHT:
            return self.backward_weight
        return self.backward_input + self.backward_weight


@dataclass(frozen=True)
class StepCosts:
    """Every stage's `StageCost`, measured in a step of ``microbatches`` microbatches, and the hand-off between ranks.

    ``latency``: seconds from an input made on one rank to the action waiting for it starting on another.
    """

    stages: Sequence[StageCost]
    microbatches: int
    latency: float = 0.0

    def durations(self, microbatches: int) -> Callable[[Action], float]:
        """Each action's predicted seconds in a step of ``microbatches`` microbatches (for `simulate`)."""
        scale = self.microbatches / microbatches

        def seconds(action: Action) -> float:
            stage = self.stages[action.stage]
            return stage.compute(action.kind) * scale + stage.overhead

        return seconds

    def peak_bytes(self, schedule: Schedule) -> int:
        """The most bytes of stashed activations any rank of ``schedule`` holds at once (the memory plan's walk)."""
        scale = self.microbatches / schedule.num_microbatches
        stash = {s: round(st.activation_bytes * scale) for s, st in enumerate(self.stages)}
        split = {s: round(st.split_bytes * scale) for s, st in enumerate(self.stages)}
        return max((walk(actions, stash, split)[0] for actions in schedule.actions() if actions), default=0)


@dataclass
class Candidate:
    """One (schedule, microbatches) considered: its predicted step, or why it was left out."""

    name: str
    microbatches: int
    placement: str = LOOP  # which rank holds each stage (`lightning_pipe.schedule.placement`)
    predicted: float | None = None  # seconds per step
    bubble: float | None = None  # idle share of ranks x predicted step
    peak_bytes: int | None = None  # the most stashed activation bytes of a rank
    reason: str = ""  # why it does not fit; empty when it does

    @property
    def fits(self) -> bool:
        return not self.reason


@dataclass
class AutoChoice:
    """What ``schedule="auto"`` chose, with every candidate's prediction and the costs it decided on."""

    chosen: Candidate
    candidates: list[Candidate]
    costs: StepCosts
    budget: int | None = None
    notes: list[str] = field(default_factory=list)  # how the costs were measured (estimates named)

    def predicted(self, name: str, microbatches: int) -> float | None:
        """The predicted seconds of a step of schedule ``name`` with ``microbatches`` microbatches."""
        for c in self.candidates:
            if c.name == name and c.microbatches == microbatches:
                return c.predicted
        return None

    def table(self) -> str:
        """The decision as a table: the measured stages, then every candidate (the chosen one marked ``*``)."""
        budget = f", memory budget {_size(self.budget)} per rank" if self.budget is not None else ""
        lines = [
            f"schedule='auto' chose {self.chosen.name!r} (placement {self.chosen.placement!r}) with "
            f"{self.chosen.microbatches} microbatches: predicted "
            f"{_ms(self.chosen.predicted)} per step (measured in a step of {self.costs.microbatches} "
            f"microbatches{budget})",
            f"{'stage':>5} {'F ms':>8} {'I ms':>8} {'W ms':>8} {'other ms':>8} {'act/mb':>10}",
        ]
        for s, st in enumerate(self.costs.stages):
            lines.append(
                f"{s:>5} {st.forward * 1e3:>8.3f} {st.backward_input * 1e3:>8.3f} {st.backward_weight * 1e3:>8.3f} "
                f"{st.overhead * 1e3:>8.3f} {_size(st.activation_bytes):>10}"
            )
        lines.extend(self.notes)
        lines.append(f"  {'candidate':<26} {'place':>5} {'mb':>4} {'predicted':>10} {'bubble':>7} {'peak act':>10}")
        skipped: dict[tuple[str, str], list[int]] = {}
        for c in sorted(self.candidates, key=_order):
            if not c.fits and c.predicted is None:
                skipped.setdefault((c.name, c.reason), []).append(c.microbatches)
                continue
            mark = "*" if c is self.chosen else " "
            bubble = "-" if c.bubble is None else f"{c.bubble:.1%}"
            line = (
                f"{mark} {c.name:<26} {c.placement:>5} {c.microbatches:>4} {_ms(c.predicted):>10} {bubble:>7} "
                f"{_size(c.peak_bytes):>10}"
            )
            lines.append(line + (f" skipped: {c.reason}" if c.reason else ""))
        for (name, reason), counts in skipped.items():
            lines.append(f"  {name:<26} {'':>5} {','.join(map(str, sorted(counts))):>4} skipped: {reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def choose(
    costs: StepCosts,
    factories: Mapping[str, ScheduleFactory],
    ranks: int,
    virtual_stages: int,
    microbatches: Sequence[int],
    budget: int | None = None,
    split_backward: bool = True,
    placements: Sequence[Sequence[int]] | None = None,
) -> AutoChoice:
    """The fastest predicted (schedule, microbatches) among ``factories`` x ``microbatches`` that fits.

    A schedule fits when it builds for (``ranks``, M, ``virtual_stages``) (its ``check()`` does not raise), is not
    asynchronous, places stage ``s`` on rank ``p[s]`` for one ``p`` of ``placements`` (the placements the pipeline
    can run: its built one, and others where it can move its stages; None: any), splits its backward only where
    ``split_backward`` allows (FSDP does not), and keeps every rank's stashed activations within ``budget`` bytes
    (None: no limit). A schedule left out for its placement still gets its prediction (the table shows what the
    other placement would have given). Ties go to the smaller peak, then the name.
    """
    found = [
        _candidate(costs, name, factory, ranks, virtual_stages, m, budget, split_backward, placements)
        for name, factory in sorted(factories.items())
        for m in sorted(set(microbatches))
    ]
    fitting = [c for c in found if c.fits]
    if not fitting:
        sized = [c for c in found if c.peak_bytes is not None]
        hint = ""
        if sized:
            least = min(sized, key=lambda c: c.peak_bytes or 0)
            hint = f"; the smallest peak is {_size(least.peak_bytes)} ({least.name}, {least.microbatches} microbatches)"
        reasons = "; ".join(f"{c.name} ({c.microbatches}): {c.reason}" for c in found)
        raise ScheduleError(
            f"schedule='auto' found no schedule that fits{hint}: {reasons}. Raise memory_budget, recompute "
            "activations (checkpoint='always') or name a schedule"
        )
    best = min(fitting, key=lambda c: (c.predicted, c.peak_bytes, c.name, c.microbatches))
    return AutoChoice(best, found, costs, budget)


#: the hand-off between ranks that `initial_placement` assumes, in forwards (before anything is measured)
PRIOR_LATENCY = 0.5


def initial_placement(
    factories: Mapping[str, ScheduleFactory],
    ranks: int,
    virtual_stages: int,
    microbatches: int,
    split_backward: bool = True,
) -> str:
    """Where to build a pipeline before its stages are measured: the placement of the schedule predicted fastest with
    the zero-bubble paper's costs (every stage alike, ``F = I = W``) and a hand-off between ranks of
    `PRIOR_LATENCY` forwards; ``loop`` where nothing fits.

    With two stages per rank and ``M >= 2 x ranks`` that is the V (ZB-V: no bubble, and the middle and the ends
    of the pipeline share a rank, so fewer hand-offs); with ``M = ranks`` the loop (interleaved zero bubble).
    """
    stages = ranks * virtual_stages
    costs = StepCosts([StageCost(1.0, 1.0, 1.0)] * stages, microbatches, PRIOR_LATENCY)
    try:
        return choose(costs, factories, ranks, virtual_stages, [microbatches], None, split_backward).chosen.placement
    except ScheduleError:
        return LOOP


def _candidate(
    costs: StepCosts,
    name: str,
    factory: ScheduleFactory,
    ranks: int,
    virtual_stages: int,
    microbatches: int,
    budget: int | None,
    split_backward: bool,
    placements: Sequence[Sequence[int]] | None,
) -> Candidate:
    candidate = Candidate(name, microbatches)
    try:
        candidate.placement = placement_of(factory)
        schedule = factory(ranks, microbatches, virtual_stages)
        lists = schedule.actions()
    except Exception as exc:  # noqa: BLE001 - a schedule that does not fit says why in its own words
        candidate.reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return candidate
    if schedule.asynchronous:
        candidate.reason = "asynchronous (no flush between steps: not the same step)"
        return candidate
    stages = schedule.num_stages
    if len(costs.stages) != stages:
        candidate.reason = f"{stages} stages, but {len(costs.stages)} were measured"
        return candidate
    if not split_backward and any(a.kind is Kind.BACKWARD_INPUT for actions in lists for a in actions):
        candidate.reason = "splits the backward, which FSDP refuses"
        return candidate
    candidate.peak_bytes = costs.peak_bytes(schedule)
    if budget is not None and candidate.peak_bytes > budget:
        candidate.reason = f"peak {_size(candidate.peak_bytes)} of activations exceeds the budget"
        return candidate
    durations = costs.durations(microbatches)
    candidate.predicted = makespan(lists, stages, durations, costs.latency)
    busy = sum(durations(a) for actions in lists for a in actions)
    total = candidate.predicted * len(lists)
    candidate.bubble = 1.0 - busy / total if total > 0 else 0.0
    ranks_of_stages = [schedule.rank_of(s) for s in range(stages)]
    if placements is not None and not any(ranks_of_stages == list(p) for p in placements):
        candidate.reason = f"placement {candidate.placement!r}, in which the built pipeline cannot run"
    return candidate


def _order(c: Candidate) -> tuple[bool, float, str, int]:
    return (not c.fits, c.predicted if c.predicted is not None else 0.0, c.name, c.microbatches)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _size(nbytes: int | None) -> str:
    return "-" if nbytes is None else size_text(nbytes)
