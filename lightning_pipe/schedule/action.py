"""Actions: the unit of work a schedule hands to a stage, with a short text form such as ``1F0``."""

from __future__ import annotations

import functools
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    """What an action does to one microbatch on one stage."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # input gradient only (zero-bubble)
    BACKWARD_WEIGHT = "W"  # weight gradient only (zero-bubble)

    @property
    def is_backward(self) -> bool:
        return self is not Kind.FORWARD


_TEXT = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """Stage ``stage`` runs ``kind`` on microbatch ``microbatch``; ``str()`` gives e.g. ``"1F0"``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``Action.parse("1F0") == Action(1, Kind.FORWARD, 0)``."""
        match = _TEXT.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected <stage><F|B|I|W><microbatch>, e.g. '1F0'")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 - reads like the text form
    return Action(stage, Kind.FORWARD, microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.BACKWARD, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: N802, E743 - reads like the text form
    return Action(stage, Kind.BACKWARD_INPUT, microbatch)


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.BACKWARD_WEIGHT, microbatch)


_KINDS = list(Kind)
_CODES = {kind: code for code, kind in enumerate(_KINDS)}


def pack_actions(actions: Sequence[Action]) -> bytes:
    """``actions`` as bytes, three integers each (`unpack_actions` reverses it): a step's plan crosses to another
    process every step, and pickling an object per action was the slowest part of starting a step."""
    flat = array("i")
    for action in actions:
        flat.extend((action.stage, _CODES[action.kind], action.microbatch))
    return flat.tobytes()


def unpack_actions(data: bytes) -> list[Action]:
    """The actions `pack_actions` packed (a new list; the actions of a schedule seen before are made once)."""
    return list(_unpacked(data))


@functools.lru_cache(maxsize=64)
def _unpacked(data: bytes) -> tuple[Action, ...]:
    flat = array("i")
    flat.frombytes(data)
    return tuple(Action(flat[k], _KINDS[flat[k + 1]], flat[k + 2]) for k in range(0, len(flat), 3))
