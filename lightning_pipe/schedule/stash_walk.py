"""A worker's stashed activations over its action list: the walk behind every memory plan."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lightning_pipe.schedule.action import Action, Kind


def walk(
    actions: Iterable[Action], stash: Mapping[int, int], split: Mapping[int, int] | None = None
) -> tuple[int, int, dict[int, int]]:
    """Follow one worker's list: its peak of stashed bytes, the microbatches held then, and per stage how many.

    A forward adds its stage's ``stash`` bytes, ``I`` adds its ``split`` bytes (kept until ``W``), ``B`` or
    ``W`` frees the microbatch.
    """
    live: dict[tuple[int, int], int] = {}
    current = peak = 0
    at_peak: dict[tuple[int, int], int] = {}
    for action in actions:
        key = (action.stage, action.microbatch)
        if action.kind is Kind.FORWARD:
            live[key] = stash[action.stage]
            current += stash[action.stage]
        elif action.kind is Kind.BACKWARD_INPUT:
            extra = (split or {}).get(action.stage, 0)
            live[key] += extra
            current += extra
        else:
            current -= live.pop(key)
        if current > peak or not at_peak:
            peak, at_peak = current, dict(live)
    held: dict[int, int] = {}
    for s, _ in at_peak:
        held[s] = held.get(s, 0) + 1
    return peak, len(at_peak), held
