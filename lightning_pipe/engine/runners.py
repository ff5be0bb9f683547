"""Runners: how the workers execute a schedule's task graph (``linear``, ``dataflow``, ``parallel``).

``parallel``  one worker per rank, each running its rank's action list in order, all concurrently.
``dataflow``  one worker per rank; each runs whichever of its actions has its inputs, preferring the
              list's order (an event loop over the worker's inbox).
``linear``    one worker holds every stage and walks a single global order (the schedule's simulated
              timeline, a topological order of the task graph): no concurrency between stages.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.schedule import LOOP, Action, simulate, stage_ranks

RUNNERS = ("parallel", "dataflow", "linear")


def check_runner(runner: str) -> str:
    if runner not in RUNNERS:
        raise ConfigurationError(f"unknown runner={runner!r}; available: {', '.join(RUNNERS)}")
    return runner


def worker_of_stages(runner: str, num_stages: int, virtual_stages: int, placement: str = LOOP) -> list[int]:
    """Which worker holds each stage: the schedule's ``placement`` (`lightning_pipe.schedule.placement`: stage ``s``
    on rank ``s % ranks``, or in a V), or all on one for ``linear``."""
    check_runner(runner)
    if num_stages % virtual_stages:
        raise ConfigurationError(
            f"stages={num_stages} is not a multiple of virtual_stages={virtual_stages}; "
            "each rank holds virtual_stages stages, so pass stages = ranks * virtual_stages"
        )
    if runner == "linear":
        return [0] * num_stages
    return stage_ranks(placement, num_stages, num_stages // virtual_stages)


def worker_lists(
    lists: Sequence[Sequence[Action]], num_stages: int, worker_of_stage: Sequence[int]
) -> list[list[Action]]:
    """Map a schedule's per-rank lists onto the workers.

    A worker serving several of the schedule's ranks gets their actions merged by simulated start
    time (ties by rank), which keeps every dependency before its consumer.
    """
    num_workers = max(worker_of_stage) + 1
    rank_worker = {rank: worker_of_stage[actions[0].stage] for rank, actions in enumerate(lists) if actions}
    if num_workers == len(lists) and all(w == r for r, w in rank_worker.items()):
        return [list(actions) for actions in lists]
    start = simulate(lists, num_stages)
    merged: list[list[tuple[float, int, int, Action]]] = [[] for _ in range(num_workers)]
    for rank, actions in enumerate(lists):
        for position, action in enumerate(actions):
            merged[worker_of_stage[action.stage]].append((start[action], rank, position, action))
    return [[entry[-1] for entry in sorted(entries)] for entries in merged]
