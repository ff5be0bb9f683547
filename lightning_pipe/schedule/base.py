"""The `Schedule` base class: per-rank action lists, validation, a printed grid and the memory plan."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedule.action import Action, Kind

ActionLists = list[list[Action]]


class Schedule(ABC):
    """Turns (stages, microbatches) into one ordered action list per rank.

    A *stage* is one piece of the model; a *rank* is one worker (a device). Most schedules place
    one stage on each rank; interleaved schedules place ``virtual_stages`` stages on each rank,
    stage ``s`` on rank ``s % num_ranks``. The engine runs each rank's list in order.
    """

    name: str = "schedule"
    #: the coordinator computes every loss only after all forwards finished (synchronous training)
    loss_after_all_forwards: bool = False

    def __init__(self, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> None:
        if num_ranks < 1:
            raise ScheduleError(f"a schedule needs at least one stage, got {num_ranks}")
        if num_microbatches < 1:
            raise ScheduleError(f"a schedule needs at least one microbatch, got {num_microbatches}")
        if virtual_stages < 1:
            raise ScheduleError(f"virtual_stages must be >= 1, got {virtual_stages}")
        self.num_ranks = num_ranks
        self.num_microbatches = num_microbatches
        self.virtual_stages = virtual_stages
        self._actions: ActionLists | None = None

    @property
    def num_stages(self) -> int:
        """Number of model stages (``num_ranks * virtual_stages``)."""
        return self.num_ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        return stage % self.num_ranks

    @abstractmethod
    def build(self) -> ActionLists:
        """Return the training action list of every rank."""

    def actions(self) -> ActionLists:
        """The training action lists (built once, validated)."""
        if self._actions is None:
            actions = self.build()
            validate(actions, self.num_stages, self.num_microbatches, self.rank_of)
            self._actions = actions
        return self._actions

    def forward_actions(self) -> ActionLists:
        """Action lists for evaluation and prediction: every stage's forwards, in microbatch order."""
        lists: ActionLists = [[] for _ in range(self.num_ranks)]
        for m in range(self.num_microbatches):
            for s in range(self.num_stages):
                lists[self.rank_of(s)].append(Action(s, Kind.FORWARD, m))
        return lists

    def grid(self, forward_only: bool = False) -> str:
        """The schedule drawn as a rank x time grid, one column per time unit, blanks for idle."""
        lists = self.forward_actions() if forward_only else self.actions()
        return format_grid(lists, simulate(lists, self.num_stages))

    def peak_activations(self) -> list[int]:
        """Most microbatch activations each rank holds at once (forward done, backward not yet)."""
        return peak_activations(self.actions())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_ranks={self.num_ranks}, "
            f"num_microbatches={self.num_microbatches}, virtual_stages={self.virtual_stages})"
        )


def _dependencies(action: Action, num_stages: int, kinds: set[Kind]) -> list[Action]:
    """Actions of other stages that must finish before ``action`` can start."""
    s, m = action.stage, action.microbatch
    full = Kind.BACKWARD if Kind.BACKWARD in kinds else Kind.BACKWARD_INPUT
    if action.kind is Kind.FORWARD:
        return [Action(s - 1, Kind.FORWARD, m)] if s > 0 else []
    if action.kind is Kind.BACKWARD_WEIGHT:
        return [Action(s, Kind.BACKWARD_INPUT, m)]
    # B or I: needs its own forward, and the gradient from the next stage (the loss on the last)
    deps = [Action(s, Kind.FORWARD, m)]
    if s < num_stages - 1:
        deps.append(Action(s + 1, full, m))
    else:
        deps.append(Action(s, Kind.FORWARD, m))
    return deps


def validate(
    lists: Sequence[Sequence[Action]],
    num_stages: int,
    num_microbatches: int,
    rank_of: object = None,
) -> None:
    """Check action lists: complete, on the right ranks, forwards before backwards, no deadlock.

    Raises `ScheduleError` naming the first faulty action and printing the grid with it marked.
    """
    owner = rank_of if callable(rank_of) else (lambda s: s % len(lists))
    seen: dict[Action, int] = {}
    for rank, actions in enumerate(lists):
        for action in actions:
            if not 0 <= action.stage < num_stages or not 0 <= action.microbatch < num_microbatches:
                _fail(lists, action, f"{action} is outside {num_stages} stages x {num_microbatches} microbatches")
            if owner(action.stage) != rank:
                where = owner(action.stage)
                _fail(lists, action, f"{action} is on rank {rank} but stage {action.stage} lives on rank {where}")
            if action in seen:
                _fail(lists, action, f"{action} appears twice")
            seen[action] = rank
    kinds = {a.kind for a in seen}
    backward = Kind.BACKWARD if Kind.BACKWARD in kinds else Kind.BACKWARD_INPUT
    for s in range(num_stages):
        for m in range(num_microbatches):
            for kind in [Kind.FORWARD, backward] + ([Kind.BACKWARD_WEIGHT] if backward is Kind.BACKWARD_INPUT else []):
                if Action(s, kind, m) not in seen:
                    raise ScheduleError(f"schedule is missing {Action(s, kind, m)}\n{format_grid(lists)}")
    if Kind.BACKWARD in kinds and Kind.BACKWARD_INPUT in kinds:
        raise ScheduleError("a schedule uses either full backwards (B) or split ones (I and W), not both")
    simulate(lists, num_stages)  # raises on a deadlock


def simulate(lists: Sequence[Sequence[Action]], num_stages: int) -> dict[Action, int]:
    """Start time of each action with unit durations, each rank running its list in order."""
    kinds = {a for actions in lists for a in actions}
    kind_set = {a.kind for a in kinds}
    start: dict[Action, int] = {}
    finish: dict[Action, int] = {}
    position = [0] * len(lists)
    free = [0] * len(lists)
    total = sum(len(a) for a in lists)
    while len(finish) < total:
        progressed = False
        for rank, actions in enumerate(lists):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                deps = [d for d in _dependencies(action, num_stages, kind_set) if d in kinds or d.kind is Kind.FORWARD]
                if any(d not in finish for d in deps):
                    break
                t = max([free[rank], *(finish[d] for d in deps)])
                start[action], finish[action] = t, t + 1
                free[rank] = t + 1
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = [actions[position[r]] for r, actions in enumerate(lists) if position[r] < len(actions)]
            _fail(lists, stuck[0], "deadlock: no rank can run its next action (" + ", ".join(map(str, stuck)) + ")")
    return start


def peak_activations(lists: Sequence[Sequence[Action]]) -> list[int]:
    """Most activations each rank keeps alive at once, following its list in order."""
    peaks = []
    for actions in lists:
        live = peak = 0
        for action in actions:
            if action.kind is Kind.FORWARD:
                live += 1
                peak = max(peak, live)
            elif action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                live -= 1
        peaks.append(peak)
    return peaks


def format_grid(
    lists: Sequence[Sequence[Action]],
    start: dict[Action, int] | None = None,
    mark: Action | None = None,
) -> str:
    """Draw rank x time; without start times each column is the position in the rank's list."""
    if start is None:
        start = {a: i for actions in lists for i, a in enumerate(actions)}
    width = max([len(str(a)) for actions in lists for a in actions] + [3]) + (1 if mark else 0)
    length = max([t + 1 for t in start.values()] + [0])
    lines = []
    for rank, actions in enumerate(lists):
        cells = [" " * width] * length
        for action in actions:
            if action in start:
                text = str(action) + ("*" if action == mark else "")
                cells[start[action]] = text.ljust(width)
        lines.append(f"rank {rank} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def _fail(lists: Sequence[Sequence[Action]], action: Action, reason: str) -> None:
    raise ScheduleError(f"invalid schedule: {reason}\n{format_grid(lists, mark=action)}\n(* marks {action})")
