"""State that lives on the stages: gradients, parameters and optimizers as the stage workers hold them.

With a transport whose stages own their parameters (``rpc``, ``p2p``) this is the only copy that
trains; with ``local`` the stages share the module's parameters and most of this is a pass-through.
A built `Pipeline` holds one (``Pipeline.stage_state``) and hands these calls to it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.comm import Communicator
from lightning_pipe.engine import Coordinator, StageProtocol
from lightning_pipe.partition import ShardedTask
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.pipeline.optimizers import StageOptimizers


class StageState:
    """Gradients, parameters, checkpoints and optimizers of the stages of a built pipeline.

    ``module`` is the unsplit module, ``shards`` its stages; everything the stage workers hold is
    reached through ``coordinator``'s control calls.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        module: nn.Module,
        shards: list[ShardedTask],
        communicator: Communicator,
        seed: int,
    ) -> None:
        self.coordinator = coordinator
        self.module = module
        self.shards = shards
        self.communicator = communicator
        self.seed = seed

    @property
    def tied(self) -> list[list[tuple[int, str]]]:
        """Per weight of which several ranks hold a copy: the (rank, name) of each copy (`Coordinator.tied`)."""
        return self.coordinator.tied

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
        for part in self.coordinator.stages.call(StageProtocol.state_dict):
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
        own_parts = [({k: state[k] for k in own},) for own in keys]
        self.coordinator.stages.call_each(StageProtocol.load_state_dict, own_parts)

    def random_state(self) -> dict[str, Any]:
        """The stages' random generator states: ``{"seed": run seed, "stages": {stage: {device: state}}}``."""
        stages: dict[int, dict[str, torch.Tensor]] = {}
        for part in self.coordinator.stages.call(StageProtocol.random_state):
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
        self.coordinator.stages.call_each(StageProtocol.load_random_state, [(own,) for own in each])

    def sync_module(self) -> None:
        """Copy the stages' parameters and buffers into ``module`` (with transport="rpc" they train apart)."""
        self.module.load_state_dict(self.state_dict())

    def grads(self) -> dict[str, torch.Tensor | None]:
        """Each parameter's gradient as its stage holds it, by name."""
        grads: dict[str, torch.Tensor | None] = {}
        for part in self.coordinator.stages.call(StageProtocol.grads):
            grads.update(part)
        return grads

    def held_names(self) -> list[set[str]]:
        """Per shard, the names of its submodules, parameters and buffers, where stages hold their own copies."""
        return self.communicator.parameters.held_names(self.shards)

    def install_variants(self, partitioner: TracedPartitioner, first: int, before: list[set[str]]) -> None:
        """Send the stages (in other processes) the code of the call variants traced since ``first``.

        ``before``: `held_names` before those variants were traced; a variant that makes a stage use a
        submodule, parameter or buffer its worker process does not hold cannot be installed.
        """
        self.communicator.parameters.update_copies(lambda: self._send_variants(partitioner, first, before))

    def _send_variants(self, partitioner: TracedPartitioner, first: int, before: list[set[str]]) -> None:
        """`install_variants` where the stages hold copies of their shards."""
        updates: list[dict[int, Any]] = [{} for _ in range(self.coordinator.num_ranks)]
        for shard, held, now in zip(self.shards, before, self.held_names(), strict=True):
            for variant in range(first, len(partitioner.variants)):
                sources, constants = partitioner.variant_update(shard.index, variant)
                new = sorted(n for n in now - held if not any(n == c or c.startswith(n + ".") for c in constants))
                if new:
                    raise ConfigurationError(
                        f"the pipelined module was called in a new way that makes stage {shard.index} use "
                        f"{', '.join(new[:5])}, which its worker process does not hold; call it the same way every "
                        "time, or build the pipeline on a call of each way first"
                    )
                updates[self.coordinator.rank_of_stage[shard.index]].setdefault(shard.index, []).append(
                    (variant, sources, constants)
                )
        self.coordinator.stages.call_each(StageProtocol.install_variants, [(own,) for own in updates])

    def optimizer(self, template: torch.optim.Optimizer, names: dict[int, str] | None = None) -> StageOptimizers:
        """Per-stage parts of ``template`` (an optimizer over ``module``'s parameters); see `StageOptimizers`."""
        return StageOptimizers(self, template, names)
