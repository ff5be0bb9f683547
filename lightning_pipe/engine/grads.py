"""`GradStash`: keeps a step's parameter gradients aside until Lightning's ``backward``.

Lightning zeroes gradients after ``training_step`` and before ``backward``; the pipeline computes
them during ``training_step``. The stash saves whatever ``p.grad`` held (an accumulation window),
lets the step write fresh gradients, then restores the old ones and keeps the new aside until
`apply` adds them.

A parameter held by several stashes of one process (a tied embedding and output head in two
stages, two shards of one rank) is set aside by the first stash that begins the step and collected
by the last that ends it, so the step's gradient (the sum of every stage's contribution) is counted
once. All stashes of a process share that bookkeeping; in another process a stash holds its own
copy of a parameter and is always the only holder.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

_lock = threading.Lock()
_held: dict[int, tuple[nn.Parameter, int, torch.Tensor | None]] = {}  # id -> (param, holders, saved grad)


class GradStash:
    def __init__(self, params: Iterable[nn.Parameter] = ()) -> None:
        self.params = _unique(p for p in params if p.requires_grad)
        self._step: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    def begin(self) -> None:
        """Before the step: set the current gradients aside and start from none."""
        with _lock:
            for p in self.params:
                entry = _held.get(id(p))
                if entry is None:
                    _held[id(p)] = (p, 1, p.grad)
                    p.grad = None
                else:
                    _held[id(p)] = (p, entry[1] + 1, entry[2])

    def end(self) -> None:
        """After the step: keep its gradients aside and put the earlier ones back (last holder only)."""
        step = []
        with _lock:
            for p in self.params:
                entry = _held.get(id(p))
                if entry is None:
                    continue
                _, holders, saved = entry
                if holders > 1:
                    _held[id(p)] = (p, holders - 1, saved)
                    continue
                del _held[id(p)]
                step.append((p, p.grad))
                p.grad = saved
        self._step = step

    def apply(self, scale: float = 1.0) -> None:
        """Add the last step's gradients, times ``scale``, to ``p.grad``."""
        for p, grad in self._step:
            if grad is None:
                continue
            grad = grad * scale if scale != 1.0 else grad
            p.grad = grad if p.grad is None else p.grad + grad
        self._step = []

    def discard(self) -> None:
        self._step = []

    def step_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The last step's gradient of ``p`` (not applied yet)."""
        return next((grad for q, grad in self._step if q is p), None)

    def set_step_grad(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Replace the last step's gradient of ``p`` (the sum over the copies of a tied weight)."""
        self._step = [(q, g) for q, g in self._step if q is not p] + [(p, grad)]


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
