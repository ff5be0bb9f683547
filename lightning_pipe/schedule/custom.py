"""User schedules: a function or a `Schedule` subclass that produces the per-rank action lists."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import Action
from lightning_pipe.schedule.base import ActionLists, Schedule
from lightning_pipe.schedule.placement import placement_of

ScheduleFactory = Callable[[int, int, int], Schedule]
ListsFunction = Callable[..., Sequence[Sequence[Action | str]]]


class ListSchedule(Schedule):
    """A schedule whose action lists come from a user function ``fn(num_ranks, num_microbatches[, virtual_stages])``.

    Each list entry is an `Action` or its text form (``"1F0"``); the lists are validated like every
    schedule's before any work starts, and a faulty one is reported with the grid, the first faulty
    action marked. The stages are placed by ``fn.placement`` where the function sets it (``"v"``), else looped.
    """

    def __init__(
        self,
        fn: ListsFunction,
        num_ranks: int,
        num_microbatches: int,
        virtual_stages: int = 1,
        lists: Sequence[Sequence[Action | str]] | None = None,
    ) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "custom")
        self.placement = placement_of(fn)
        self._given = lists
        super().__init__(num_ranks, num_microbatches, virtual_stages)

    def build(self) -> ActionLists:
        lists = (
            self._given
            if self._given is not None
            else _call(self.fn, self.num_ranks, self.num_microbatches, self.virtual_stages)
        )
        if not isinstance(lists, Sequence) or isinstance(lists, str) or len(lists) != self.num_ranks:
            got = f"{len(lists)} lists" if isinstance(lists, Sequence) else type(lists).__name__
            raise ScheduleError(
                f"schedule function {self.name!r} must return one action list per rank "
                f"({self.num_ranks} lists), got {got}"
            )
        return [[_action(entry, self.name) for entry in actions] for actions in lists]


def resolve(spec: Any, lookup: Callable[[str], ScheduleFactory]) -> ScheduleFactory:
    """Turn ``schedule=`` (a name, a `Schedule` subclass or instance, or a function) into a factory."""
    if isinstance(spec, str):
        return lookup(spec)
    if isinstance(spec, Schedule):
        return _fixed(spec)
    if isinstance(spec, type) and issubclass(spec, Schedule):
        return spec
    if callable(spec):
        return _from_function(spec)
    raise ScheduleError(
        f"schedule={spec!r} is neither a name, a Schedule subclass nor a function returning action lists"
    )


def _from_function(fn: Callable[..., Any]) -> ScheduleFactory:
    def factory(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
        result = _call(fn, num_ranks, num_microbatches, virtual_stages)
        if isinstance(result, Schedule):
            return result
        return ListSchedule(fn, num_ranks, num_microbatches, virtual_stages, lists=result)

    factory.__name__ = getattr(fn, "__name__", "custom")
    factory.placement = placement_of(fn)  # type: ignore[attr-defined]  # where the engine puts the stages
    return factory


def _fixed(schedule: Schedule) -> ScheduleFactory:
    def factory(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
        wanted = (num_ranks, num_microbatches, virtual_stages)
        have = (schedule.num_ranks, schedule.num_microbatches, schedule.virtual_stages)
        if wanted != have:
            raise ScheduleError(
                f"the schedule instance {schedule!r} was built for (ranks, microbatches, virtual_stages)={have} "
                f"but the step needs {wanted}; pass the class or a function instead of an instance"
            )
        return schedule

    factory.placement = schedule.placement  # type: ignore[attr-defined]  # where the engine puts the stages
    return factory


def _call(fn: Callable[..., Any], num_ranks: int, num_microbatches: int, virtual_stages: int) -> Any:
    """Call with (ranks, microbatches, virtual_stages), or without the last for two-argument functions."""
    try:
        inspect.signature(fn).bind(num_ranks, num_microbatches, virtual_stages)
    except TypeError:
        return fn(num_ranks, num_microbatches)
    except ValueError:  # no signature (a builtin): assume the full one
        pass
    return fn(num_ranks, num_microbatches, virtual_stages)


def _action(entry: Action | str, name: str) -> Action:
    if isinstance(entry, Action):
        return entry
    if isinstance(entry, str):
        try:
            return Action.parse(entry)
        except ValueError as exc:
            raise ScheduleError(f"schedule {name!r}: {exc}") from None
    raise ScheduleError(f"schedule {name!r} produced {entry!r}; expected an Action or text such as '1F0'")
