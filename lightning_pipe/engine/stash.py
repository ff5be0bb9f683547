"""Setting a step's parameter gradients aside, once per parameter even when stages share it.

A stage worker clears ``p.grad`` when a training step starts (keeping the old gradient) and, when
the step ends, records what the step accumulated and puts the old gradient back (see
`StageWorker._stash_grads`). A parameter used by two stages in one process (a tied embedding and
output head, two shards of one rank) must be set aside by the first stage that starts the step and
collected by the last that ends it, or the second stage would stash the first stage's fresh gradient
and the step's gradient would be counted twice. Stage workers of one process share this registry; in
other processes each worker holds its own copy of a parameter and the count is always one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

Grad = tuple[torch.nn.Parameter, torch.Tensor | None]

_lock = threading.Lock()
_held: dict[int, tuple[torch.nn.Parameter, int, torch.Tensor | None]] = {}  # id -> (param, holders, saved grad)


def unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """``params`` without repeats (a rank whose shards share a parameter lists it once)."""
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def stash(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Start a step for ``params``: the first holder of each saves and clears its gradient."""
    params = unique(params)
    with _lock:
        for p in params:
            entry = _held.get(id(p))
            if entry is None:
                _held[id(p)] = (p, 1, p.grad)
                p.grad = None
            else:
                _held[id(p)] = (p, entry[1] + 1, entry[2])
    return params


def unstash(params: Iterable[torch.nn.Parameter]) -> list[Grad]:
    """End a step for ``params``: the last holder of each takes the step's gradient and restores the old one.

    Returns the (parameter, step gradient) pairs this caller is responsible for applying.
    """
    collected: list[Grad] = []
    with _lock:
        for p in params:
            _, holders, saved = _held[id(p)]
            if holders > 1:
                _held[id(p)] = (p, holders - 1, saved)
                continue
            del _held[id(p)]
            collected.append((p, p.grad))
            p.grad = saved
    return collected
