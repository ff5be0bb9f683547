"""Placements: which rank holds each stage, looped (``s % ranks``) or in a V (stage ``r`` and ``2R-1-r`` on rank ``r``).

A schedule names its placement (`Schedule.placement`); the pipeline, the memory plan and launched mode
place the stages by the same name, so a stage's actions always run where the stage lives.
"""

from __future__ import annotations

from typing import Any

from lightning_pipe.base.errors import ScheduleError

LOOP = "loop"  # stage s on rank s % R: rank r holds r, r + R, r + 2R, ... (interleaved schedules)
V = "v"  # chunks zig-zag: rank r holds r, 2R - 1 - r, 2R + r, ... (ZB-V, DualPipeV)
PLACEMENTS = (LOOP, V)


def stage_rank(placement: str, stage: int, num_ranks: int) -> int:
    """The rank that holds ``stage`` under ``placement``.

    4 ranks, 8 stages: ``loop`` gives ranks 0 1 2 3 0 1 2 3; ``v`` gives 0 1 2 3 3 2 1 0, so the first and
    last stage share rank 0 and the middle two share the last rank (no message between them crosses ranks).
    """
    if placement == LOOP:
        return stage % num_ranks
    if placement == V:
        chunk, offset = divmod(stage, num_ranks)
        return offset if chunk % 2 == 0 else num_ranks - 1 - offset
    raise ScheduleError(f"unknown placement {placement!r}; available: {', '.join(PLACEMENTS)}")


def stage_ranks(placement: str, num_stages: int, num_ranks: int) -> list[int]:
    """The rank of every stage."""
    return [stage_rank(placement, s, num_ranks) for s in range(num_stages)]


def placement_of(factory: Any) -> str:
    """The placement a schedule factory's schedules use: its ``placement`` attribute, else ``loop``.

    A `Schedule` subclass has it as a class attribute; a schedule function may set ``fn.placement = "v"``.
    """
    placement = getattr(factory, "placement", LOOP)
    if placement not in PLACEMENTS:
        raise ScheduleError(f"unknown placement {placement!r}; available: {', '.join(PLACEMENTS)}")
    return str(placement)
