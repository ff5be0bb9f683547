"""`StageStateCalls`: what a stage serves between steps: its parameters, gradients, optimizer, hooks and traces.

With the RPC transport a stage's parameters exist only in its worker process. The coordinator
reaches them through `StageProtocol`'s methods (``coordinator.stages.call(StageProtocol.<name>, ...)``,
or ``post`` for one whose result is not used) between steps; nothing here moves parameters during a
step. Names are the unsplit module's: a shard keeps its layers' names.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.backends import StageTrace
from lightning_pipe.base.dtensor_shards import local_of
from lightning_pipe.base.errors import PipeError
from lightning_pipe.engine.grad_norms import any_over_meshes, norm_share
from lightning_pipe.engine.grads import GradStash
from lightning_pipe.rng import StageRandom
from lightning_pipe.runtime import BaseRuntime

GroupSpec = dict[str, Any]  # {"hparams": {...}, "names": [...]}: one param group, this rank's part of it


class StageStateCalls:
    """The state of a worker's shards that the coordinator reaches between steps, and the calls that reach it.

    Owns the step's gradients set aside (``grads``: the worker's step begins and ends it) and this rank's
    part of the optimizer; reads the shards, their generators, runtimes and backend traces.
    """

    def __init__(
        self,
        rank: int,
        shards: dict[int, Any],
        random: dict[int, StageRandom],
        runtimes: dict[int, BaseRuntime],
        traces: dict[int, StageTrace],
    ) -> None:
        self.rank = rank
        self.shards = shards
        self.random = random
        self.runtimes = runtimes
        self.traces = traces
        self.grads = GradStash(p for shard in shards.values() for p in shard.module.parameters())
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_names: list[list[str]] = []
        #: whether a step's optimizer step goes ahead (torchft's commit, `QuorumReplicas`); None: always
        self.commits: Callable[[], bool] | None = None
        #: before the parameters, buffers or optimizer state change in place (a step, a load): a checkpoint's copy of
        #: them, made in the background, is complete first (`StageCheckpoint.staged`, set by the worker)
        self.before_change: Callable[[], None] = lambda: None

    def _named_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for shard in self.shards.values() for name, p in shard.module.named_parameters()}

    def _param_grads(self, skip: Sequence[str] = ()) -> list[torch.Tensor]:
        return [p.grad for name, p in self._named_parameters().items() if p.grad is not None and name not in skip]

    # module state
    def call_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of this rank's shards, under the unsplit module's keys."""
        state: dict[str, torch.Tensor] = {}
        for shard in self.shards.values():
            state.update(shard.module.state_dict())
        return state

    def call_load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this rank's keys of ``state`` (only its own keys are sent)."""
        self.before_change()
        for shard in self.shards.values():
            own = shard.module.state_dict().keys()
            missing = [k for k in own if k not in state]
            if missing:
                raise PipeError(f"the state to load lacks keys of stage {shard.index}: {', '.join(missing[:5])}")
            shard.module.load_state_dict({k: state[k] for k in own})

    def call_install_variants(self, updates: dict[int, list[tuple[int, dict[bool, str], dict[str, Any]]]]) -> None:
        """Add call variants traced after the stages were built: per shard index, [(variant, code, constants)]."""
        for index, variants in updates.items():
            task = self.shards[index]
            device = torch.device(task.device)
            for variant, sources, constants in variants:
                moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in constants.items()}
                task.module.install_with_constants(variant, sources, moved)

    def call_train(self, mode: bool) -> None:
        for shard in self.shards.values():
            shard.module.train(mode)

    # random generators
    def call_random_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each stage's generator states, by stage index (for checkpoints)."""
        return {index: random.generators.state() for index, random in self.random.items()}

    def call_load_random_state(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restore the generator states of this rank's stages (a resumed run continues their sequences)."""
        for index, state in states.items():
            self.random[index].generators.load_state(state)

    def call_grads(self) -> dict[str, torch.Tensor | None]:
        return {name: p.grad for name, p in self._named_parameters().items()}

    # gradients
    def call_apply_grads(self, scale: float) -> None:
        """Add the last step's gradients, times ``scale``, to ``p.grad`` (the strategy's backward)."""
        self.grads.apply(scale)

    def call_discard_grads(self) -> None:
        self.grads.discard()

    def call_step_grads(self, names: list[str]) -> dict[str, torch.Tensor | None]:
        """The last step's gradients of ``names``, before ``apply_grads`` (a tied weight's copies on this rank)."""
        params = self._named_parameters()
        return {name: self.grads.step_grad(params[name]) for name in names}

    def call_set_step_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Replace the last step's gradients of some parameters (each tied copy gets the sum over all copies)."""
        params = self._named_parameters()
        for name, grad in grads.items():
            p = params[name]
            self.grads.set_step_grad(p, grad.to(device=p.device, dtype=p.dtype))

    def call_zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._named_parameters().values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def call_grad_norm(self, norm_type: float, skip: Sequence[str] = ()) -> float:
        """This rank's share of the global norm: the sum of ``|g|^p`` (or the max of ``|g|`` for inf).

        ``skip`` names copies of a tied weight that another rank already counts. A gradient spread over processes
        (a DTensor: FSDP over the stage's replicas, tensor parallel over its tensor ranks, or both) counts whole and
        once: its parts' shares are summed over its mesh, its copies counted once (`lightning_pipe.engine.grad_norms`).
        """
        grads = self._param_grads(skip)
        if not grads:
            return 0.0
        return float(norm_share(grads, norm_type, math.isinf(norm_type)))

    def call_scale_grads(self, factor: float) -> None:
        for g in self._param_grads():
            g.detach().mul_(factor)

    def call_clamp_grads(self, value: float) -> None:
        for g in self._param_grads():
            g.detach().clamp_(-value, value)

    def call_unscale_grads(self, inv_scale: float) -> bool:
        """A GradScaler's unscale on this rank: multiply by ``inv_scale``; True if any gradient is inf/nan."""
        grads = self._param_grads()
        found = False
        for g in grads:
            g.detach().mul_(inv_scale)
            found = found or not bool(torch.isfinite(local_of(g)).all())
        return any_over_meshes(found, grads)

    # the optimizer
    def call_build_optimizer(self, cls: type, defaults: dict[str, Any], groups: list[GroupSpec]) -> None:
        """This rank's part of the optimizer: same class, same hyperparameters per group (groups may be empty)."""
        params = self._named_parameters()
        param_groups = [{**g["hparams"], "params": [params[n] for n in g["names"]]} for g in groups]
        try:
            self._optimizer = cls(param_groups, **defaults)
        except TypeError:  # an optimizer whose defaults are not all constructor arguments
            self._optimizer = cls(param_groups)
        self._optimizer_names = [list(g["names"]) for g in groups]

    def _stage_optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise PipeError(f"rank {self.rank} has no optimizer; build it first (StageOptimizers)")
        return self._optimizer

    def has_optimizer(self) -> bool:
        return self._optimizer is not None

    def optimizer(self) -> tuple[torch.optim.Optimizer, list[list[str]]]:
        """This rank's optimizer and, per parameter group, the names of its parameters in order."""
        return self._stage_optimizer(), self._optimizer_names

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters of this rank's shards, by the unsplit module's names."""
        return self._named_parameters()

    def regather(self) -> None:
        """The shards' parameters were replaced (sharded by FSDP): the gradients set aside follow the new ones."""
        self.grads = GradStash(p for shard in self.shards.values() for p in shard.module.parameters())

    def call_set_hparams(self, hparams: list[dict[str, Any]]) -> None:
        for group, values in zip(self._stage_optimizer().param_groups, hparams, strict=True):
            group.update(values)

    def call_optimizer_step(self, hparams: list[dict[str, Any]] | None) -> None:
        """Step this rank's optimizer, after taking over changed hyperparameters (an LR scheduler's)."""
        if hparams is not None:
            self.call_set_hparams(hparams)
        if self.commits is not None and not self.commits():
            return  # a replica group failed during the step: torchft drops it in every group
        self.before_change()
        self._stage_optimizer().step()

    def call_optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state by parameter name, and its groups' hyperparameters."""
        state = self._stage_optimizer().state_dict()
        names = [n for group in self._optimizer_names for n in group]
        return {
            "state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
        }

    def call_load_optimizer_state(self, state: dict[str, Any], hparams: list[dict[str, Any]]) -> None:
        """Load state given by parameter name (this rank's only) and the groups' hyperparameters."""
        self.before_change()
        optimizer = self._stage_optimizer()
        index, groups = 0, []
        flat: list[str] = []
        for names, values in zip(self._optimizer_names, hparams, strict=True):
            groups.append({**values, "params": list(range(index, index + len(names)))})
            index += len(names)
            flat += names
        by_index = {i: state[n] for i, n in enumerate(flat) if n in state}
        optimizer.load_state_dict({"state": by_index, "param_groups": groups})

    # the worker's runtimes and backend traces
    def call_runtime_hook(self, name: str, args: tuple[Any, ...]) -> None:
        """Call ``runtime.<name>(module, *args)`` for each shard of this rank."""
        for index, shard in self.shards.items():
            hook = getattr(self.runtimes[index], name)
            if name in ("train_epoch_begin", "train_validation_begin"):
                hook(shard.module)
            elif name == "get_pending_result":
                hook(shard.module, *args)
            elif name == "initialize_module":
                hook(shard.module, *args)
            else:  # pre/post step hooks: (trainer, module, batch_idx, batch[, outputs])
                hook(args[0], shard.module, *args[1:])

    def call_execution_trace(self, reset: bool = False) -> list[StageTrace]:
        """A copy of each shard's backend trace; ``reset`` zeroes the counts afterwards."""
        traces = [copy.deepcopy(trace) for trace in self.traces.values()]
        if reset:
            for trace in self.traces.values():
                trace.reset()
        return traces
