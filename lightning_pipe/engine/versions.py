"""Weight stashing for asynchronous training (PipeDream-2BW style): one weight version per microbatch.

Under ``schedule="async"`` a stage updates its weights after every ``update_every`` backwards, without a flush.
A microbatch's forward and backward run on the same weight *version* (a copy made after each update, dropped
when no microbatch in flight uses it), so every gradient is exact for the weights it was taken on; it is then
added to the live parameters, which the optimizer steps. The staleness this gives: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from lightning_pipe.engine.shared_weights import SharedWeights

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Versioned(nn.Module):
    """``module`` called with one weight version's parameters (for modules that cannot be deep-copied)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._target = [module]  # a list: not registered as a submodule
        with torch.no_grad():
            self._params = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in module.named_parameters()}

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return iter(self._params.items())

    def forward(self, *args: Any) -> Any:
        return functional_call(self._target[0], self._params, args)


def snapshot(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its own parameters (this version's weights) and the live buffers."""
    memo: dict[int, Any] = {id(b): b for b in module.buffers()}
    runtime = getattr(module, "_pipe_runtime", None)
    if runtime is not None:
        memo[id(runtime)] = runtime
    try:
        copy = deepcopy(module, memo)
    except Exception:  # a module holding something that cannot be copied
        return Versioned(module)
    copy.requires_grad_(False)
    for (_, p), (_, q) in zip(module.named_parameters(), copy.named_parameters(), strict=True):
        q.requires_grad_(p.requires_grad)
    return copy


@dataclass
class Staleness:
    """What one stage saw during an asynchronous run."""

    stage: int
    updates: int = 0
    microbatches: int = 0
    stale: int = 0  # microbatches whose version was behind the synchronous one
    total: int = 0  # sum of staleness over microbatches
    max: int = 0
    max_live_versions: int = 1

    @property
    def mean(self) -> float:
        return self.total / self.microbatches if self.microbatches else 0.0


class StageVersions:
    """The live parameters of one stage, the versions in use, its optimizer and its staleness."""

    def __init__(self, stage: int, module: nn.Module, update_every: int, optimizer: OptimizerFactory) -> None:
        self.stage = stage
        self.module = module
        self.named = [(name, p) for name, p in module.named_parameters()]
        self.factory = optimizer
        self.trainable = [p for _, p in self.named if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = None  # built at the first backward (`_shared_roles`)
        self.version = 0
        self.versions: dict[int, nn.Module] = {}
        self.start_run(update_every)

    def start_run(self, update_every: int, shared: SharedWeights | None = None) -> None:
        """A new stream: microbatches count from 0 again; the weights and optimizer state carry on.

        ``shared``: the run's weights that other stages of this process hold too (one object for all).
        """
        self.update_every = update_every
        self.base = self.version  # the version a synchronous schedule would use for batch 0
        self.shared = shared if shared is not None else SharedWeights()
        self.shared.register(self.stage, self.trainable)
        self._roles: tuple[list[nn.Parameter], set[int]] | None = None  # (owned, ids handed over), at 1st backward
        self.versions = {self.version: self._snapshot()}
        self.in_flight: dict[int, int] = {}  # microbatch -> version its forward used
        self.backwards = 0
        self.stats = Staleness(self.stage)

    def model(self, microbatch: int) -> nn.Module:
        """The module for ``microbatch``: the version its forward used, or the newest for a new forward."""
        if microbatch not in self.in_flight:
            self.in_flight[microbatch] = self.version
            self._count(microbatch)
        return self.versions[self.in_flight[microbatch]]

    def backward_done(self, microbatch: int) -> None:
        """Move the microbatch's gradient to the live parameters; step the optimizer after a batch.

        The gradient of a weight that a lower stage of this process holds too goes to that stage instead
        (`SharedWeights`): this stage never steps or clears it.
        """
        owned, handed = self._shared_roles()
        batch = microbatch // self.update_every
        version = self.versions[self.in_flight.pop(microbatch)]
        for (_, live), (_, p) in zip(self.named, version.named_parameters(), strict=True):
            if id(live) in handed:
                self.shared.hand_over(live, batch, p.grad)
            elif p.grad is not None:
                live.grad = p.grad if live.grad is None else live.grad + p.grad
            p.grad = None
        self.backwards += 1
        updated = self.backwards % self.update_every == 0
        if updated:
            self._update(batch, owned)
        used = set(self.in_flight.values()) | ({self.version} if not updated else set())
        self.versions = {v: module for v, module in self.versions.items() if v in used}
        if updated:
            for live in self.trainable:  # the shared weights as the owner's previous update left them
                if id(live) in handed:
                    self.shared.wait_stepped(live, self.version - self.base - 1, self.stage)
            self.versions[self.version] = self._snapshot()
        self.stats.max_live_versions = max(self.stats.max_live_versions, len(self.versions))

    def _update(self, batch: int, owned: list[nn.Parameter]) -> None:
        """Step after ``batch``'s backwards: the owned shared weights with every holder's gradients, once."""
        for live in owned:
            extra = self.shared.collect(live, batch, self.update_every, self.stage)
            if extra is not None:
                live.grad = extra if live.grad is None else live.grad + extra
        if self.optimizer is not None:  # it holds no weight handed over: nothing here steps or clears those
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for live in owned:
            self.shared.stepped(live)
        self.version += 1
        self.stats.updates += 1

    def _shared_roles(self) -> tuple[list[nn.Parameter], set[int]]:
        """The shared weights this stage steps and the ids of those it hands over; at the first backward of a
        run, when every holder has registered, also the optimizer, without the weights handed over."""
        if self._roles is None:
            owned, handed = self.shared.roles(self.stage, self.trainable)
            self._roles = (owned, {id(p) for p in handed})
            mine = [p for p in self.trainable if id(p) not in self._roles[1]]
            if self.optimizer is None and mine:
                self.optimizer = self.factory(mine)
        return self._roles

    def drop_run(self) -> None:
        """The run was aborted: stages of this process waiting on this one's shared weights stop too."""
        self.shared.drop()

    def _snapshot(self) -> nn.Module:
        return snapshot(self.module)

    def weights(self) -> list[torch.Tensor]:
        """Every stashed version's parameters (weights, not activations, for the stash meter)."""
        return [p for version in self.versions.values() for _, p in version.named_parameters()]

    def _count(self, microbatch: int) -> None:
        stale = microbatch // self.update_every - (self.version - self.base)
        self.stats.microbatches += 1
        self.stats.total += stale
        self.stats.stale += stale > 0
        self.stats.max = max(self.stats.max, stale)


class WorkerVersions:
    """The `StageVersions` of every stage of one worker, kept across asynchronous runs with the same optimizer.

    The worker sets ``active`` for each step: only an asynchronous stream runs on weight versions.
    """

    def __init__(self, shards: Iterable[Any]) -> None:
        self.shards = list(shards)
        self.active = False
        self._stages: dict[int, StageVersions] = {}

    def start(self, update_every: int, optimizer: OptimizerFactory, shared: SharedWeights | None = None) -> None:
        """A new asynchronous run; the versions and optimizers start afresh only with another optimizer factory.

        ``shared``: the run's weights that several stages of this process hold (`StageVersions.start_run`).
        """
        first = next(iter(self._stages.values()), None)
        if first is None or first.factory is not optimizer:
            self._stages = {
                shard.index: StageVersions(shard.index, shard.module, update_every, optimizer) for shard in self.shards
            }
        for versions in self._stages.values():
            versions.start_run(update_every, shared)

    def drop_run(self) -> None:
        """The run was aborted: stages of this process waiting on these stages' shared weights stop too."""
        for versions in self._stages.values():
            versions.drop_run()

    def model(self, stage: int, microbatch: int) -> nn.Module:
        """The module ``stage`` runs ``microbatch`` on (`StageVersions.model`)."""
        return self._stages[stage].model(microbatch)

    def backward_done(self, stage: int, microbatch: int) -> None:
        self._stages[stage].backward_done(microbatch)

    def weights(self, stage: int) -> list[torch.Tensor]:
        """The parameters of every version ``stage`` keeps (`StageVersions.weights`)."""
        return self._stages[stage].weights()

    def call_async_stats(self) -> list[Staleness]:
        """Each stage's `Staleness` in the last asynchronous run."""
        return [versions.stats for versions in self._stages.values()]
