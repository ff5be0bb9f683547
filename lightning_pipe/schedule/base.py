"""The `Schedule` base class: per-rank action lists, validation, a printed grid and the memory plan."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence

from lightning_pipe.base.errors import ScheduleError
from lightning_pipe.schedule.action import Action, Kind
from lightning_pipe.schedule.placement import LOOP, stage_rank

ActionLists = list[list[Action]]
Durations = Mapping[Kind, float]
#: an action's time: the same for every action of a kind, or per action (measured stages: `schedule.auto`)
Costs = Durations | Callable[[Action], float]

#: every action takes one time unit (the grids in the docstrings)
UNIT: Durations = {Kind.FORWARD: 1, Kind.BACKWARD: 1, Kind.BACKWARD_INPUT: 1, Kind.BACKWARD_WEIGHT: 1}
#: a backward costs two forwards, split evenly into input and weight gradients (the zero-bubble paper's model)
COSTS: Durations = {Kind.FORWARD: 1, Kind.BACKWARD: 2, Kind.BACKWARD_INPUT: 1, Kind.BACKWARD_WEIGHT: 1}


class Schedule(ABC):
    """Turns (stages, microbatches) into one ordered action list per rank.

    A *stage* is one piece of the model; a *rank* is one worker (a device). Most schedules place
    one stage on each rank; interleaved schedules place ``virtual_stages`` stages on each rank,
    stage ``s`` on rank ``s % num_ranks`` (``placement = "loop"``), V-shaped ones stage ``r`` and
    ``2 num_ranks - 1 - r`` on rank ``r`` (``placement = "v"``, `lightning_pipe.schedule.placement`).
    The engine places the stages by ``placement`` and runs each rank's list in order.
    """

    name: str = "schedule"
    #: which rank holds each stage (`rank_of`); the pipeline places the stages by this name
    placement: str = LOOP
    #: some backwards run as ``I`` and ``W`` (a stage sharded with FSDP cannot run them)
    splits_backward: bool = False
    #: the coordinator computes every loss only after all forwards finished (synchronous training)
    loss_after_all_forwards: bool = False
    #: stages update their own weights as gradients arrive, over a stream of batches (``stream()``)
    asynchronous: bool = False

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
        self.check()

    def check(self) -> None:  # noqa: B027 - a hook with a no-op default
        """Raise `ScheduleError` if this schedule cannot serve (ranks, microbatches, virtual_stages)."""

    @property
    def num_stages(self) -> int:
        """Number of model stages (``num_ranks * virtual_stages``)."""
        return self.num_ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage`` (set ``placement`` to change it: the engine follows that name)."""
        return stage_rank(self.placement, stage, self.num_ranks)

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

    def stream(self, num_batches: int) -> ActionLists:
        """Action lists of ``num_batches`` batches without a flush (asynchronous schedules only)."""
        raise ScheduleError(f"schedule {self.name!r} flushes after every batch; only asynchronous schedules stream")

    def forward_actions(self) -> ActionLists:
        """Action lists for evaluation and prediction: every stage's forwards, in microbatch order."""
        lists: ActionLists = [[] for _ in range(self.num_ranks)]
        for m in range(self.num_microbatches):
            for s in range(self.num_stages):
                lists[self.rank_of(s)].append(Action(s, Kind.FORWARD, m))
        return lists

    def simulate(self, durations: Durations = UNIT) -> dict[Action, float]:
        """Start time of each training action when every rank runs its list in order."""
        return simulate(self.actions(), self.num_stages, durations)

    def grid(self, forward_only: bool = False, durations: Durations = UNIT) -> str:
        """The schedule drawn as a rank x time grid, one column per time unit, blanks for idle."""
        lists = self.forward_actions() if forward_only else self.actions()
        return format_grid(lists, simulate(lists, self.num_stages, durations), durations=durations)

    def bubble(self, durations: Durations = COSTS) -> float:
        """Fraction of rank x time left idle in the simulated step (0 = no bubble)."""
        return bubble_fraction(self.actions(), self.num_stages, durations)

    def peak_activations(self) -> list[int]:
        """Most microbatch activations each rank holds at once (forward done, backward not yet)."""
        return peak_activations(self.actions())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_ranks={self.num_ranks}, "
            f"num_microbatches={self.num_microbatches}, virtual_stages={self.virtual_stages})"
        )


def dependencies(action: Action, num_stages: int, present: Collection[Action]) -> list[Action]:
    """Actions that must finish before ``action`` can start (the edges of the task graph).

    A forward needs the previous stage's forward; a backward (``B`` or ``I``) needs its own forward
    and the input gradient of the next stage (``B`` or ``I``, whichever ``present`` holds; the loss
    on the last stage); a weight gradient ``W`` needs its own ``I``.
    """
    s, m = action.stage, action.microbatch
    if action.kind is Kind.FORWARD:
        return [Action(s - 1, Kind.FORWARD, m)] if s > 0 else []
    if action.kind is Kind.BACKWARD_WEIGHT:
        return [Action(s, Kind.BACKWARD_INPUT, m)]
    deps = [Action(s, Kind.FORWARD, m)]
    if s < num_stages - 1:
        full = Action(s + 1, Kind.BACKWARD, m)
        deps.append(full if full in present else Action(s + 1, Kind.BACKWARD_INPUT, m))
    return deps


def validate(
    lists: Sequence[Sequence[Action]],
    num_stages: int,
    num_microbatches: int,
    rank_of: Callable[[int], int] | None = None,
) -> None:
    """Check action lists: complete, on the right ranks, forwards before backwards, no deadlock.

    Raises `ScheduleError` naming the first faulty action and printing the grid with it marked.
    """
    owner = rank_of if rank_of is not None else (lambda s: s % len(lists))
    seen: dict[Action, tuple[int, int]] = {}  # action -> (rank, position)
    for rank, actions in enumerate(lists):
        for position, action in enumerate(actions):
            if not isinstance(action, Action):
                raise ScheduleError(
                    f"invalid schedule: rank {rank} position {position} holds {action!r}, not an Action; "
                    "use Action(stage, Kind.FORWARD, microbatch) or its text form such as '1F0'"
                )
            if not 0 <= action.stage < num_stages or not 0 <= action.microbatch < num_microbatches:
                _fail(lists, action, f"{action} is outside {num_stages} stages x {num_microbatches} microbatches")
            if owner(action.stage) != rank:
                where = owner(action.stage)
                _fail(lists, action, f"{action} is on rank {rank} but stage {action.stage} lives on rank {where}")
            if action in seen:
                _fail(lists, action, f"{action} appears twice")
            seen[action] = (rank, position)
    _check_order(lists, seen)
    _check_complete(lists, seen, num_stages, num_microbatches)
    simulate(lists, num_stages)  # raises on a deadlock


def _check_order(lists: Sequence[Sequence[Action]], seen: dict[Action, tuple[int, int]]) -> None:
    """On its rank, each backward comes after its forward and each ``W`` after its ``I``."""
    for actions in lists:
        for action in actions:
            if action.kind is Kind.FORWARD:
                continue
            before = Kind.BACKWARD_INPUT if action.kind is Kind.BACKWARD_WEIGHT else Kind.FORWARD
            first = Action(action.stage, before, action.microbatch)
            if first in seen and seen[first][1] > seen[action][1]:
                _fail(
                    lists, action, f"{action} runs before {first} on its rank and would wait for it forever (deadlock)"
                )


def _check_complete(
    lists: Sequence[Sequence[Action]],
    seen: dict[Action, tuple[int, int]],
    num_stages: int,
    num_microbatches: int,
) -> None:
    """Every (stage, microbatch) has a forward and either ``B`` or both ``I`` and ``W``: sends meet receives."""
    for m in range(num_microbatches):
        for s in range(num_stages):
            f, b = Action(s, Kind.FORWARD, m), Action(s, Kind.BACKWARD, m)
            i, w = Action(s, Kind.BACKWARD_INPUT, m), Action(s, Kind.BACKWARD_WEIGHT, m)
            if f not in seen:
                sender = Action(s - 1, Kind.FORWARD, m)
                if sender in seen:
                    _fail(lists, sender, f"{sender} sends its activation to stage {s} but no rank runs {f}")
                others = [a for a in (b, i, w) if a in seen]
                if others:
                    _fail(lists, others[0], f"{others[0]} has no forward {f}")
                raise ScheduleError(f"invalid schedule: no rank runs {f}\n{format_grid(lists)}")
            if b in seen and (i in seen or w in seen):
                _fail(lists, b, f"{b} and a split backward ({i}/{w}) are both present; use B, or I and W")
            if i in seen and w not in seen:
                _fail(lists, i, f"{i} has no {w}: the weight gradient of stage {s} would never be computed")
            if w in seen and i not in seen:
                _fail(lists, w, f"{w} has no {i}: a weight gradient needs its input gradient first")
            if b not in seen and i not in seen:
                receiver = f"the loss of microbatch {m}" if s == num_stages - 1 else f"stage {s + 1}"
                _fail(
                    lists,
                    f,
                    f"{f} has no backward (missing {b}, or {i} and {w}); "
                    f"the gradient from {receiver} is never received",
                )


def duration(durations: Costs, action: Action) -> float:
    """How long ``action`` takes under ``durations`` (per kind, or a function of the action)."""
    return durations(action) if callable(durations) else durations[action.kind]


def simulate(
    lists: Sequence[Sequence[Action]], num_stages: int, durations: Costs = UNIT, latency: float = 0.0
) -> dict[Action, float]:
    """Start time of each action, each rank running its list in order; raises on a deadlock.

    ``latency``: the time an input takes from another rank (a hand-off between ranks): an action waits that long
    after a dependency that ran on another rank finished; a dependency on its own rank is ready at once.
    """
    present = {a for actions in lists for a in actions}
    where = {a: r for r, actions in enumerate(lists) for a in actions} if latency else {}
    start: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    position = [0] * len(lists)
    free = [0.0] * len(lists)
    while len(finish) < len(present):
        progressed = False
        for rank, actions in enumerate(lists):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                deps = [d for d in dependencies(action, num_stages, present) if d in present]
                if any(d not in finish for d in deps):
                    break
                t = max([free[rank], *(finish[d] + (latency if where.get(d, rank) != rank else 0.0) for d in deps)])
                start[action], finish[action] = t, t + duration(durations, action)
                free[rank] = finish[action]
                position[rank] += 1
                progressed = True
        if not progressed:
            stuck = [actions[position[r]] for r, actions in enumerate(lists) if position[r] < len(actions)]
            _fail(lists, stuck[0], "deadlock: no rank can run its next action (" + ", ".join(map(str, stuck)) + ")")
    return start


def makespan(
    lists: Sequence[Sequence[Action]], num_stages: int, durations: Costs = COSTS, latency: float = 0.0
) -> float:
    """Simulated length of a step (``latency``: each hand-off between ranks, as in `simulate`)."""
    start = simulate(lists, num_stages, durations, latency)
    return max([t + duration(durations, a) for a, t in start.items()] + [0.0])


def bubble_fraction(lists: Sequence[Sequence[Action]], num_stages: int, durations: Costs = COSTS) -> float:
    """Idle share of ranks x simulated step time: ``idle / (ranks x makespan)``, the whole step's rank-time as the
    denominator (the zero-bubble paper's bubble rate divides the idle time by the compute time instead)."""
    busy = sum(duration(durations, a) for actions in lists for a in actions)
    total = makespan(lists, num_stages, durations) * len(lists)
    return 1.0 - busy / total if total else 0.0


def peak_activations(lists: Sequence[Sequence[Action]]) -> list[int]:
    """Most activations each rank keeps alive at once, following its list in order.

    An activation is held from a microbatch's forward until its backward ``B`` or, for a split
    backward, until its weight gradient ``W`` (which still needs the stage's saved inputs).
    """
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
    start: Mapping[Action, float] | None = None,
    mark: Action | None = None,
    durations: Durations = UNIT,
) -> str:
    """Draw rank x time; without start times each column is the position in the rank's list.

    With ``durations`` an action longer than one unit continues in ``---`` cells.
    """
    if start is None:
        start = {a: i for actions in lists for i, a in enumerate(actions)}
    width = max([len(str(a)) for actions in lists for a in actions] + [3]) + (1 if mark else 0)
    spans = {a: max(1, round(durations[a.kind])) for a in start}
    length = max([round(t) + spans[a] for a, t in start.items()] + [0])
    lines = []
    for rank, actions in enumerate(lists):
        cells = [" " * width] * length
        for action in actions:
            if action in start:
                t = round(start[action])
                cells[t] = (str(action) + ("*" if action == mark else "")).ljust(width)
                for extra in range(1, spans[action]):
                    cells[t + extra] = "-" * width
        lines.append(f"rank {rank} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def _fail(lists: Sequence[Sequence[Action]], action: Action, reason: str) -> None:
    raise ScheduleError(f"invalid schedule: {reason}\n{format_grid(lists, mark=action)}\n(* marks {action})")
