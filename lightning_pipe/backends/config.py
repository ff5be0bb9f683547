"""From the user's ``backend=`` argument to a `BackendPlan`: per stage and mode, the backends to try.

::

    backend="inductor"                               every stage, train and eval
    backend=["eager", "inductor"]                    a list: one entry per stage
    backend=("tensorrt", "inductor")                 a tuple: a fallback chain for every stage
    backend=[("tensorrt", "inductor"), "eager"]      per stage, with a chain for stage 0
    backend={"train": "inductor", "eval": "tensorrt"} per mode, each of the forms above

Every chain continues with the default backends (registered with ``add_to_default=True``) and ends
with eager, which always accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_pipe.backends.base import Backend
from lightning_pipe.backends.registry import default_backends, get_backend
from lightning_pipe.base.errors import ConfigurationError

MODES = ("train", "eval")
StageArg = str | Sequence[str] | None
BackendArg = StageArg | Sequence[StageArg] | Mapping[str, Any]


@dataclass
class StageChain:
    """The backends one stage tries in one mode: those asked for, then the defaults, then eager."""

    requested: list[str]
    backends: list[Backend]

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.backends]


@dataclass
class BackendPlan:
    """Per stage and mode the chain of backends; it travels to the stages inside their `StageSpec`."""

    chains: dict[int, dict[str, StageChain]] = field(default_factory=dict)
    strict: bool = False
    every_stage: dict[str, StageChain] | None = None  # the chains when they are not given per stage

    def chain(self, stage: int, mode: str) -> StageChain:
        per_stage = self.chains.get(stage)
        if per_stage is not None:
            return per_stage[mode]
        if self.every_stage is not None:  # e.g. more (virtual) stages than the plan was built for
            return self.every_stage[mode]
        raise ConfigurationError(
            f"the backend plan has chains for stages {sorted(self.chains)} but stage {stage} asked for one; "
            "give one backend per stage"
        )


def resolve_backends(
    backend: BackendArg | BackendPlan, num_stages: int | None = None, strict: bool = False
) -> BackendPlan:
    """Validate ``backend=`` (unknown names list the registered ones) and build the plan.

    With ``num_stages=None`` (not known yet) per-stage lists are checked for names only.
    """
    if isinstance(backend, BackendPlan):
        return backend
    if num_stages is None:
        lists = [a for a in (backend.values() if isinstance(backend, Mapping) else [backend]) if isinstance(a, list)]
        num_stages = len(lists[0]) if lists else 1
    if isinstance(backend, Mapping):
        unknown = sorted(set(backend) - set(MODES))
        if unknown:
            raise ConfigurationError(
                f"backend has unknown mode(s) {', '.join(map(repr, unknown))}; use the keys {', '.join(MODES)}"
            )
        per_mode = {mode: backend.get(mode) for mode in MODES}
    else:
        per_mode = {mode: backend for mode in MODES}
    stage_names = {mode: _per_stage(arg, num_stages) for mode, arg in per_mode.items()}
    chains = {stage: {mode: _chain(stage_names[mode][stage]) for mode in MODES} for stage in range(num_stages)}
    uniform = not any(isinstance(arg, list) for arg in per_mode.values())
    return BackendPlan(chains, bool(strict), chains[0] if uniform and chains else None)


def with_options(plan: BackendPlan, name: str, options: Mapping[str, Any]) -> BackendPlan:
    """A copy of ``plan`` in which backend ``name`` runs with ``options`` over its registered ones.

    The options travel with the plan (to stage worker processes too); the registry is left alone.
    """

    def chain(old: StageChain) -> StageChain:
        backends = [replace(b, options={**b.options, **options}) if b.name == name else b for b in old.backends]
        return StageChain(list(old.requested), backends)

    chains = {stage: {mode: chain(c) for mode, c in modes.items()} for stage, modes in plan.chains.items()}
    every = {mode: chain(c) for mode, c in plan.every_stage.items()} if plan.every_stage is not None else None
    return BackendPlan(chains, plan.strict, every)


def _per_stage(arg: Any, num_stages: int) -> list[list[str]]:
    if arg is None or isinstance(arg, (str, tuple)):
        return [_names(arg)] * num_stages
    if isinstance(arg, list):
        if len(arg) != num_stages:  # also when per-mode lists disagree
            raise ConfigurationError(
                f"backend={arg!r} has {len(arg)} entries but stages={num_stages}; give one backend per stage, "
                "a single name for all stages, or a tuple for a fallback chain used on every stage"
            )
        return [_names(a) for a in arg]
    raise ConfigurationError(
        f"backend={arg!r} is not a backend name, a list (one per stage), a tuple (a chain) or a dict by mode"
    )


def _names(arg: Any) -> list[str]:
    if arg is None:
        return []
    names = [arg] if isinstance(arg, str) else list(arg)
    for name in names:
        get_backend(name)  # unknown names list the registered ones
    return names


def _chain(requested: list[str]) -> StageChain:
    names = [*requested, *(d for d in default_backends() if d not in requested)]
    return StageChain(list(requested), [get_backend(n) for n in names])
