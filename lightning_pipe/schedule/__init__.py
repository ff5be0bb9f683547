"""Schedules as data: per-rank action lists, printable and testable without a model."""

from __future__ import annotations

from typing import Any

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import Action, Kind
from lightning_pipe.schedule.asynchronous import AsyncOneFOneB
from lightning_pipe.schedule.auto import AutoChoice, Candidate, StageCost, StepCosts, choose, initial_placement
from lightning_pipe.schedule.base import (
    COSTS,
    UNIT,
    ActionLists,
    Schedule,
    bubble_fraction,
    format_grid,
    makespan,
    peak_activations,
    simulate,
    validate,
)
from lightning_pipe.schedule.custom import ListSchedule, ScheduleFactory, resolve
from lightning_pipe.schedule.dualpipev import DualPipeV
from lightning_pipe.schedule.interleaved import Interleaved1F1B
from lightning_pipe.schedule.interleaved_zero_bubble import InterleavedZeroBubble
from lightning_pipe.schedule.looped_bfs import LoopedBFS
from lightning_pipe.schedule.placement import LOOP, PLACEMENTS, V, placement_of, stage_ranks
from lightning_pipe.schedule.schedules import GPipe, OneFOneB
from lightning_pipe.schedule.zbv import ZeroBubbleV
from lightning_pipe.schedule.zero_bubble import ZeroBubbleH1

_SCHEDULES: dict[str, ScheduleFactory] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved-1f1b": Interleaved1F1B,
    "zero-bubble": ZeroBubbleH1,
    "async": AsyncOneFOneB,
    "looped-bfs": LoopedBFS,
    "interleaved-zero-bubble": InterleavedZeroBubble,
    "zbv": ZeroBubbleV,
    "dualpipev": DualPipeV,
}


def register_schedule(name: str, factory: ScheduleFactory) -> None:
    """Make ``factory(num_ranks, num_microbatches, virtual_stages)`` available as ``schedule=name``."""
    _SCHEDULES[name.lower()] = factory


def available_schedules() -> list[str]:
    return sorted(_SCHEDULES)


def registered_schedules() -> dict[str, ScheduleFactory]:
    """Every registered schedule by name (a copy): ``schedule="auto"``'s candidates."""
    return dict(_SCHEDULES)


def get_schedule(name: str) -> ScheduleFactory:
    """The factory registered as ``name``; the error lists the known names."""
    try:
        return _SCHEDULES[name.lower()]
    except KeyError:
        known = ", ".join(available_schedules())
        raise ScheduleError(f"unknown schedule {name!r}; available: {known}") from None


def resolve_schedule(spec: Any) -> ScheduleFactory:
    """``schedule=`` as a factory: a registered name, a `Schedule` subclass or instance, or a function
    ``fn(num_ranks, num_microbatches[, virtual_stages])`` returning per-rank lists of actions."""
    return resolve(spec, get_schedule)


__all__ = [
    "COSTS",
    "LOOP",
    "PLACEMENTS",
    "UNIT",
    "V",
    "Action",
    "ActionLists",
    "AsyncOneFOneB",
    "AutoChoice",
    "Candidate",
    "DualPipeV",
    "GPipe",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "Kind",
    "ListSchedule",
    "LoopedBFS",
    "OneFOneB",
    "Schedule",
    "ScheduleFactory",
    "StageCost",
    "StepCosts",
    "ZeroBubbleH1",
    "ZeroBubbleV",
    "available_schedules",
    "bubble_fraction",
    "choose",
    "format_grid",
    "get_schedule",
    "initial_placement",
    "makespan",
    "peak_activations",
    "placement_of",
    "register_schedule",
    "registered_schedules",
    "resolve_schedule",
    "simulate",
    "stage_ranks",
    "validate",
]
