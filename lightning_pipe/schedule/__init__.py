"""Schedules as data: per-rank action lists, printable and testable without a model."""

from __future__ import annotations

from collections.abc import Callable

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedule.action import Action, Kind
from lightning_pipe.schedule.base import Schedule, format_grid, peak_activations, simulate, validate
from lightning_pipe.schedule.schedules import GPipe, OneFOneB

ScheduleFactory = Callable[[int, int, int], Schedule]

_SCHEDULES: dict[str, ScheduleFactory] = {"gpipe": GPipe, "1f1b": OneFOneB}


def register_schedule(name: str, factory: ScheduleFactory) -> None:
    """Make ``factory(num_ranks, num_microbatches, virtual_stages)`` available as ``schedule=name``."""
    _SCHEDULES[name.lower()] = factory


def available_schedules() -> list[str]:
    return sorted(_SCHEDULES)


def get_schedule(name: str) -> ScheduleFactory:
    """The factory registered as ``name``; the error lists the known names."""
    try:
        return _SCHEDULES[name.lower()]
    except KeyError:
        known = ", ".join(available_schedules())
        raise ScheduleError(f"unknown schedule {name!r}; available: {known}") from None


__all__ = [
    "Action",
    "GPipe",
    "Kind",
    "OneFOneB",
    "Schedule",
    "ScheduleFactory",
    "available_schedules",
    "format_grid",
    "get_schedule",
    "peak_activations",
    "register_schedule",
    "simulate",
    "validate",
]
