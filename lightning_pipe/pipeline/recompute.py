"""Activation recomputation per stage: the ``checkpoint=`` modes, and what ``checkpoint="auto"`` decides.

``"always"``, ``"except_last"`` and ``"never"`` fix which stages recompute their forward in the backward.
``"auto"`` (the default) recomputes only where a device's memory needs it: never on a device that reports no
memory (cpu); elsewhere the first training step runs as ``"except_last"`` and measures each stage's stash with
and without recomputation, and before the second the coordinator makes stages recompute, largest saving first,
until the planned peak fits `HEADROOM` of the free memory (docs/internals.md: why measure rather than plan).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.base.units import size_text
from lightning_pipe.engine.runners import worker_lists
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.engine.stash import StageBytes
from lightning_pipe.runtime import DeviceMemory
from lightning_pipe.schedule import Action, Kind
from lightning_pipe.schedule.stash_walk import walk

if TYPE_CHECKING:
    from lightning_pipe.engine import Coordinator

CHECKPOINT_MODES = ("auto", "always", "except_last", "never")
HEADROOM = 0.9  # share of the free memory the stash may plan for; the rest is for the backward's temporaries


def checkpoint_flags(mode: str, num_stages: int) -> list[bool | None]:
    """Which stages recompute their forward in the backward; None: decided by ``checkpoint="auto"``."""
    if mode not in CHECKPOINT_MODES:
        raise ConfigurationError(f"unknown checkpoint={mode!r}; available: {', '.join(CHECKPOINT_MODES)}")
    if mode == "auto":
        return [None] * num_stages
    if mode == "except_last":
        return [s < num_stages - 1 for s in range(num_stages)]
    return [mode == "always" for _ in range(num_stages)]


@dataclass
class StageDecision:
    """One stage's line of the plan."""

    stage: int
    device: str
    bytes: StageBytes
    held: int  # its microbatches held at its device's planned peak (without recomputation)
    planned: int  # its part of that peak: held * full
    free: int | None  # its device's free memory; None: no limit
    recompute: bool


@dataclass
class RecomputePlan:
    """What ``checkpoint="auto"`` decided, per stage, with the numbers it decided on."""

    schedule: str
    microbatches: int
    stages: list[StageDecision]
    #: per limited device: (planned peak without recomputation, planned peak as decided, free memory)
    devices: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def flags(self) -> list[bool]:
        return [d.recompute for d in self.stages]

    def table(self) -> str:
        lines = [
            f"checkpoint='auto' ({self.schedule}, {self.microbatches} microbatches): a stage recomputes its forward "
            f"where its device's planned activation peak exceeds {HEADROOM:.0%} of the free memory",
            f"{'stage':>5}  {'device':<20} {'act/mb':>10} {'held':>4} {'planned peak':>12} {'free':>10}  recompute",
        ]
        for d in self.stages:
            limit = size_text(d.free) if d.free is not None else "no limit"
            lines.append(
                f"{d.stage:>5}  {d.device:<20} {size_text(d.bytes.full):>10} {d.held:>4} {size_text(d.planned):>12} "
                f"{limit:>10}  {'yes' if d.recompute else 'no'}"
            )
        for device, (without, decided, free) in self.devices.items():
            lines.append(
                f"{device}: planned peak {size_text(without)} without recomputation, {size_text(decided)} as decided, "
                f"{size_text(free)} free"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def plan_recompute(
    lists: Sequence[Sequence[Action]],
    sizes: Mapping[int, StageBytes],
    memory: Mapping[int, DeviceMemory | None],
    devices: Sequence[str],
    schedule: str = "",
    microbatches: int = 0,
    headroom: float = HEADROOM,
) -> RecomputePlan:
    """Decide per stage from each worker's action list, the measured bytes and each stage's device memory.

    ``devices`` names each stage's device where its memory reports none (no limit, grouped by this name).
    """
    split_backward = any(a.kind is Kind.BACKWARD_INPUT for actions in lists for a in actions)
    groups: dict[str, list[int]] = {}
    for s in range(len(devices)):
        info = memory.get(s)
        groups.setdefault(info.device if info is not None else devices[s], []).append(s)
    decisions: dict[int, StageDecision] = {}
    plan = RecomputePlan(schedule, microbatches, [])
    for name, stages in groups.items():
        frees = [info.free for info in (memory.get(s) for s in stages) if info is not None]
        free = min(frees) if frees else None  # the workers read it at slightly different times
        without, held = _device_peak(lists, stages, sizes, set(), split_backward)
        chosen: set[int] = set()
        decided = without
        if free is not None:
            savings = {s: held.get(s, 0) * (sizes[s].full - sizes[s].inputs) for s in stages}
            for s in sorted(stages, key=lambda s: (-savings[s], s)):
                if decided <= free * headroom:
                    break
                chosen.add(s)
                decided, _ = _device_peak(lists, stages, sizes, chosen, split_backward)
            plan.devices[name] = (without, decided, free)
        for s in stages:
            planned = held.get(s, 0) * sizes[s].full
            decisions[s] = StageDecision(s, name, sizes[s], held.get(s, 0), planned, free, s in chosen)
    plan.stages = [decisions[s] for s in sorted(decisions)]
    return plan


def _device_peak(
    lists: Sequence[Sequence[Action]],
    stages: Sequence[int],
    sizes: Mapping[int, StageBytes],
    recompute: set[int],
    split_backward: bool,
) -> tuple[int, dict[int, int]]:
    """Planned peak of the stages of one device (summed over the workers holding them) and the held counts."""
    mine = set(stages)
    stash = {s: sizes[s].inputs if s in recompute else sizes[s].full for s in mine}
    # split backward: a recomputed graph stays from I until W; a full backward rebuilds one microbatch at a time
    split = {s: sizes[s].split + (sizes[s].full - sizes[s].inputs if s in recompute else 0) for s in mine}
    total, held = 0, {}
    for actions in lists:
        own = [a for a in actions if a.stage in mine]
        if not own:
            continue
        peak, _, counts = walk(own, stash, split if split_backward else None)
        rebuilt = [sizes[a.stage].full for a in own if a.stage in recompute] if not split_backward else []
        total += peak + max(rebuilt, default=0)
        held.update(counts)
    return total, held


class AutoCheckpoint:
    """``checkpoint="auto"`` over a pipeline's life: its first training step measures, the second decides."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(devices)
        self.steps = 0
        self.plan: RecomputePlan | None = None
        self._sizes: dict[int, StageBytes] = {}  # the measured step's stash sizes, where its workers are gone

    def remember(self, coordinator: Coordinator) -> None:
        """Keep the stash sizes the workers measured (before they are replaced:
        `lightning_pipe.pipeline.stage_moves`)."""
        if self.plan is None:
            self._sizes = _merged(coordinator.stages.call(StageProtocol.stash_sizes))

    def before_step(self, coordinator: Coordinator, microbatches: int) -> RecomputePlan | None:
        """Call before each training step; returns the plan once, before the step it first applies to."""
        self.steps += 1
        if self.plan is not None or self.steps < 2:
            return None
        sizes: dict[int, StageBytes] = self._sizes or _merged(coordinator.stages.call(StageProtocol.stash_sizes))
        if len(sizes) < coordinator.num_stages:  # the first step did not get through: measure in the next
            return None
        memory: dict[int, DeviceMemory | None] = _merged(coordinator.stages.call(StageProtocol.device_memory))
        schedule = coordinator.schedule(microbatches)
        lists = worker_lists(schedule.actions(), coordinator.num_stages, coordinator.rank_of_stage)
        name = str(getattr(schedule, "name", type(schedule).__name__))
        self.plan = plan_recompute(lists, sizes, memory, self.devices, name, microbatches)
        coordinator.stages.call(StageProtocol.set_recompute, dict(enumerate(self.plan.flags)))
        return self.plan


def _merged(per_rank: Iterable[Mapping[int, Any]]) -> dict[int, Any]:
    return {stage: value for rank in per_rank for stage, value in rank.items()}
