"""The one place that swaps what ``fully_shard`` runs: a ``configure_model``'s calls recorded, to be applied per stage.

Lightning's TP x FSDP recipe ends ``configure_model`` with ``fully_shard`` of each block, then of the whole model,
whose unit lies in several stages once PipeStrategy cuts it. While ``configure_model`` runs in launched mode,
`deferred` records each call (`ShardUnit`) and returns the module unchanged; each process applies the units its
stage holds (`lightning_pipe.engine.stage_shards`). ``fully_shard`` is torch's ``@contract`` wrapper, which calls
the function it wraps through its closure variable ``func``: that cell's contents are swapped for a recorder and put
back in a ``finally``. Where the installed torch differs, nothing is deferred (`unavailable` says why; the calls go
through and `lightning_pipe.strategy.tensor_parallel.refuse_self_sharded` names the fix). docs/internals.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

TESTED_WITH = "2.13"  # the newest torch this module was read against

# what `deferred` reads: fully_shard.__code__.co_freevars holds FUNC, whose cell holds the function named WRAPPED;
# the contract wrapper's entries on each module: module.__dict__[contract.STATE_KEY][func] and [REGISTRY_KEY][name]
FUNC = "func"
WRAPPED = "fully_shard"
CONTRACT = "torch.distributed._composable.contract"
RECORDER_NAME = "lightning_pipe_deferred_fully_shard"  # not "fully_shard": its registry entry never blocks the real one

Check = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class ShardUnit:
    """One ``fully_shard`` call of ``configure_model``: what it was given (a module, or a list of modules sharded as
    one unit) and its keyword arguments (``mesh``, ``mp_policy``, ``reshard_after_forward``, ...)."""

    target: nn.Module | list[nn.Module]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def modules(self) -> list[nn.Module]:
        return [self.target] if isinstance(self.target, nn.Module) else list(self.target)


def unavailable() -> str | None:
    """Why the installed torch's ``fully_shard`` cannot be deferred (None: it can)."""
    return _cell()[1]


@contextmanager
def deferred(check: Check) -> Iterator[list[ShardUnit] | None]:
    """While inside, ``fully_shard(module, **kwargs)`` records a `ShardUnit` in the list yielded (after ``check`` of
    its keyword arguments, which raises naming the fix) and returns ``module`` unchanged. Yields None, and defers
    nothing, where torch's structure differs (`unavailable`)."""
    cell, _ = _cell()
    if cell is None:
        yield None
        return
    units: list[ShardUnit] = []

    def record(module: nn.Module | list[nn.Module], **kwargs: Any) -> nn.Module | list[nn.Module]:
        unit = ShardUnit(module if isinstance(module, nn.Module) else list(module), dict(kwargs))
        _forget(unit.modules, record)  # first: a call that `check` refuses leaves no entries either
        check(unit.kwargs)
        units.append(unit)
        return module

    record.__name__ = record.__qualname__ = RECORDER_NAME
    real = cell.cell_contents
    cell.cell_contents = record
    try:
        yield units
    finally:
        cell.cell_contents = real


def _cell() -> tuple[Any, str | None]:
    """The closure cell through which ``fully_shard`` calls the function it wraps, or None and why not."""
    from torch.distributed.fsdp import fully_shard

    code, closure = getattr(fully_shard, "__code__", None), getattr(fully_shard, "__closure__", None)
    if code is None or not closure:
        return None, _changed("fully_shard is not a closure (torch's @contract wrapper)")
    names = code.co_freevars
    if FUNC not in names or len(names) != len(closure):
        return None, _changed(f"fully_shard's closure variables are {names}, without {FUNC!r}")
    cell = closure[names.index(FUNC)]
    try:
        wrapped = cell.cell_contents
    except ValueError:  # an empty cell
        return None, _changed(f"fully_shard's {FUNC!r} is empty")
    if getattr(wrapped, "__name__", None) != WRAPPED or not callable(wrapped):
        if getattr(wrapped, "__name__", None) == RECORDER_NAME:
            return None, "fully_shard is being deferred already (a configure_model inside another)"
        return None, _changed(f"fully_shard's {FUNC!r} is {wrapped!r}, not the function {WRAPPED}")
    return cell, None


def _forget(modules: list[nn.Module], recorder: Callable[..., Any]) -> None:
    """Remove what the contract wrapper wrote on ``modules`` for ``recorder`` (its state, keyed by the function, and
    its registry entry, keyed by its name), so that the module holds what it held before the call."""
    contract = importlib.import_module(CONTRACT)
    state, registry = getattr(contract, "STATE_KEY", None), getattr(contract, "REGISTRY_KEY", None)
    for key, entry in ((state, recorder), (registry, recorder.__name__)):
        if key is None:  # another torch: its entries are keyed by the recorder, which the real call never meets
            continue
        for module in modules:
            found = module.__dict__.get(key)
            if isinstance(found, dict):
                found.pop(entry, None)
                if not found:
                    del module.__dict__[key]


def _changed(what: str) -> str:
    return (
        f"torch {torch.__version__} changed fully_shard's wrapper, through which lightning_pipe defers a "
        f"configure_model's calls ({what}; lightning_pipe/engine/fsdp_deferral.py, read against torch {TESTED_WITH})"
    )
