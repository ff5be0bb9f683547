"""State that lives on the stages: gradients, parameters and optimizers as the stage workers hold them.

With a transport whose stages own their parameters (``rpc``, ``p2p``) this is the only copy that
trains; with ``local`` the stages share the module's parameters and most of this is a pass-through.
`Pipeline` mixes this in.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_pipe.comm import Communicator
from lightning_pipe.optim import StageOptimizers
from lightning_pipe.partition import Partitioner, ShardedTask

if TYPE_CHECKING:
    from lightning_pipe.engine import Coordinator


class StageState:
    """Gradients, parameters, checkpoints and optimizers of the stages (a mixin of `Pipeline`)."""

    module: nn.Module
    seed: int
    shards: list[ShardedTask]
    partitioner: Partitioner
    communicator: Communicator

    if TYPE_CHECKING:

        @property
        def coordinator(self) -> Coordinator: ...

    def apply_grads(self, scale: float = 1.0) -> None:
        """Add the last step's gradients, times ``scale``, to ``p.grad`` on every stage.

        Each copy of a tied weight (`tied`) first gets the sum of every copy's gradient of the step,
        the gradient the one shared parameter gets in the unsplit module.

        Stages that own their parameters are posted the work (`Coordinator.post`): only later calls
        read their gradients, and each stage runs them after it. Stages that share ``module``'s
        parameters have them in ``p.grad`` when this returns: the caller's optimizer reads them next.
        """
        send = self.coordinator.post if self.communicator.stages_own_parameters else self.coordinator.call
        tied = self.tied
        if tied:
            names: list[list[str]] = [[] for _ in range(self.coordinator.num_ranks)]
            for holders in tied:
                for rank, name in holders:
                    names[rank].append(name)
            got = self.coordinator.call("step_grads", each=[(own,) for own in names])
            totals: list[dict[str, torch.Tensor]] = [{} for _ in names]
            for holders in tied:
                parts = [g for g in (got[rank][name] for rank, name in holders) if g is not None]
                if not parts:
                    continue
                total = parts[0].clone()
                for g in parts[1:]:
                    total += g.to(total.device)
                for rank, name in holders:
                    totals[rank][name] = total
            send("set_step_grads", each=[(own,) for own in totals])
        send("apply_grads", scale)

    @property
    def tied(self) -> list[list[tuple[int, str]]]:
        """Per weight of which several ranks hold a copy: the (rank, name) of each copy, the first holder first.

        Empty when the stages share ``module``'s parameters (the local transport): then a tied weight
        is one parameter. With ``transport="rpc"`` every worker unpickles its own copy; the copies
        get the same gradient (`apply_grads`) and so make the same optimizer updates.
        """
        if not self.communicator.stages_own_parameters:
            return []
        rank_of = self.coordinator.rank_of_stage
        tied = []
        for places in getattr(self.partitioner, "tied", []):
            holders: dict[int, str] = {}
            for index, name in places:
                holders.setdefault(rank_of[index], name)  # two shards of one rank share one copy
            if len(holders) > 1:
                tied.append(list(holders.items()))
        return tied

    def parameter_locations(self) -> dict[int, tuple[int, str]]:
        """``id(p)`` of each parameter of ``module`` -> (rank, name) of the (first) stage that holds it."""
        rank_of = self.coordinator.rank_of_stage
        locations: dict[int, tuple[int, str]] = {}
        for shard in self.shards:
            for name, p in shard.module.named_parameters():
                locations.setdefault(id(p), (rank_of[shard.index], name))
        return locations

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's parameters and buffers as the stages hold them, under ``module.state_dict()``'s keys.

        A tied weight is taken from its first holder: all its keys name that one tensor, as in the module.
        """
        state: dict[str, torch.Tensor] = {}
        for part in self.coordinator.call("state_dict"):
            state.update(part)
        for holders in self.tied:
            for _, name in holders[1:]:
                state[name] = state[holders[0][1]]
        return {k: state[k] for k in self.module.state_dict() if k in state}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load ``state`` (keys of ``module.state_dict()``) into ``module`` and send each stage its part.

        Every copy of a tied weight gets the value under its first holder's key.
        """
        tied = self.tied
        if tied:
            state = dict(state)
            for holders in tied:
                if holders[0][1] in state:
                    for _, name in holders[1:]:
                        state[name] = state[holders[0][1]]
        self.module.load_state_dict(state)
        keys: list[list[str]] = [[] for _ in range(self.coordinator.num_ranks)]
        for shard in self.shards:
            keys[self.coordinator.rank_of_stage[shard.index]] += list(shard.module.state_dict())
        self.coordinator.call("load_state_dict", each=[({k: state[k] for k in own},) for own in keys])

    def random_state(self) -> dict[str, Any]:
        """The stages' random generator states: ``{"seed": run seed, "stages": {stage: {device: state}}}``."""
        stages: dict[int, dict[str, torch.Tensor]] = {}
        for part in self.coordinator.call("random_state"):
            stages.update(part)
        return {"seed": self.seed, "stages": dict(sorted(stages.items()))}

    def load_random_state(self, state: dict[str, Any]) -> None:
        """Continue the sequences of `random_state` (a resumed run).

        The states of another number of stages are not loaded (a warning): the stages start from the run's seed.
        """
        stages: dict[int, dict[str, torch.Tensor]] = state.get("stages", {})
        if set(stages) != set(range(len(self.shards))):
            warnings.warn(
                f"the saved random generator states are of {len(stages)} stages, this pipeline has "
                f"{len(self.shards)}: its stages start from the run's seed (their dropout masks do not continue "
                "the saved run's)",
                stacklevel=2,
            )
            return
        rank_of = self.coordinator.rank_of_stage
        each: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in range(self.coordinator.num_ranks)]
        for index, states in stages.items():
            each[rank_of[index]][index] = states
        self.coordinator.call("load_random_state", each=[(own,) for own in each])

    def sync_module(self) -> None:
        """Copy the stages' parameters and buffers into ``module`` (with transport="rpc" they train apart)."""
        self.module.load_state_dict(self.state_dict())

    def grads(self) -> dict[str, torch.Tensor | None]:
        """Each parameter's gradient as its stage holds it, by name."""
        grads: dict[str, torch.Tensor | None] = {}
        for part in self.coordinator.call("grads"):
            grads.update(part)
        return grads

    def optimizer(self, template: torch.optim.Optimizer) -> StageOptimizers:
        """Per-stage parts of ``template`` (an optimizer over ``module``'s parameters); see `StageOptimizers`."""
        return StageOptimizers(self, template)
