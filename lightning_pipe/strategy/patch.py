"""Attributes the strategy sets on the user's objects for a while, and putting back exactly what was there.

The strategy replaces the pipelined module's ``forward`` (and the LightningModule's ``log`` during a step)
on the instance. Popping the attribute afterwards is not the same as restoring it: a module may have had
an instance ``forward`` of its own (``torch.compile``'s ``OptimizedModule`` keeps its compiled forward
there), which a pop would delete. The instance dictionary is written directly so that classes with their
own ``__setattr__`` (``OptimizedModule`` forwards most names to the original module) keep it where it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


def patch(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj.<name> = value`` on the instance; returns the function that puts back what was there."""
    before = obj.__dict__.get(name, _MISSING)
    obj.__dict__[name] = value
    restored = False

    def restore() -> None:
        nonlocal restored
        if restored:
            return
        restored = True
        if before is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = before

    return restore


class Patches:
    """Several patches, restored together in reverse order (and only once)."""

    def __init__(self) -> None:
        self._restores: list[Callable[[], None]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._restores.append(patch(obj, name, value))

    def restore(self) -> None:
        while self._restores:
            self._restores.pop()()
