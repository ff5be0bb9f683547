"""`StageProtocol`: the control calls a stage worker serves between steps, one method each.

The coordinator reaches these methods through `CoordinatorLink` (`engine/coordinator_link.py`), the other half
of the protocol: the wire carries a method's name, taken from the method itself, so no other module
spells a call's name and a type checker follows every call from the coordinator to the part of the
worker that serves it. Each method hands the work to the part that owns what it touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_pipe.backends import StageTrace
from lightning_pipe.base.errors import PipeError
from lightning_pipe.checkpoint.reader import OptimizerLayout
from lightning_pipe.checkpoint.stage_part import CoordinatorPart, StageCheckpoint
from lightning_pipe.comm.base import PING
from lightning_pipe.engine.stage_memory import StageMemory
from lightning_pipe.engine.stash import StageBytes
from lightning_pipe.engine.state_calls import GroupSpec, StageStateCalls
from lightning_pipe.engine.versions import Staleness, WorkerVersions
from lightning_pipe.runtime import DeviceMemory
from lightning_pipe.weights.edited import StateEdits

StateDict = dict[str, torch.Tensor]
Hparams = list[dict[str, Any]]
RandomStates = dict[int, dict[str, torch.Tensor]]


class StageProtocol:
    """Every control call of a stage worker; served by name (`serve`) for the calls the coordinator sends."""

    def __init__(
        self,
        rank: int,
        state: StageStateCalls,
        memory: StageMemory,
        versions: WorkerVersions,
        checkpoint: StageCheckpoint,
    ) -> None:
        self._rank = rank
        self._state = state
        self._memory = memory
        self._versions = versions
        self._checkpoint = checkpoint

    def serve(self, name: str) -> Callable[..., Any]:
        """The method a message names; the error lists the calls served."""
        if name in _CALLS:
            method: Callable[..., Any] = getattr(self, name)
            return method
        raise PipeError(f"a stage worker serves no call {name!r}; it serves {', '.join(sorted(_CALLS))}")

    def ping(self) -> int:
        """This worker's rank: it is ready, and it ran everything sent to it before."""
        return self._rank

    # parameters, modes, hooks and traces
    def state_dict(self) -> StateDict:
        """Parameters and buffers of this rank's shards, under the unsplit module's keys."""
        return self._state.call_state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        """Load this rank's keys of ``state`` (only its own keys are sent)."""
        self._state.call_load_state_dict(state)

    def install_variants(self, updates: dict[int, list[tuple[int, dict[bool, str], dict[str, Any]]]]) -> None:
        """Add call variants traced after the stages were built (per shard index)."""
        self._state.call_install_variants(updates)

    def train(self, mode: bool) -> None:
        """Put this rank's shards in training (True) or evaluation (False) mode."""
        self._state.call_train(mode)

    def random_state(self) -> RandomStates:
        """Each stage's generator states, by stage index (for checkpoints)."""
        return self._state.call_random_state()

    def load_random_state(self, states: RandomStates) -> None:
        """Restore the generator states of this rank's stages."""
        self._state.call_load_random_state(states)

    def runtime_hook(self, name: str, args: tuple[Any, ...]) -> None:
        """Call ``runtime.<name>(module, *args)`` for each shard of this rank."""
        self._state.call_runtime_hook(name, args)

    def execution_trace(self, reset: bool = False) -> list[StageTrace]:
        """A copy of each shard's backend trace; ``reset`` zeroes the counts afterwards."""
        return self._state.call_execution_trace(reset)

    # gradients
    def grads(self) -> dict[str, torch.Tensor | None]:
        """``p.grad`` of this rank's parameters by name."""
        return self._state.call_grads()

    def apply_grads(self, scale: float) -> None:
        """Add the last step's gradients, times ``scale``, to ``p.grad`` (the strategy's backward)."""
        self._state.call_apply_grads(scale)

    def discard_grads(self) -> None:
        """Drop the last step's gradients set aside."""
        self._state.call_discard_grads()

    def step_grads(self, names: list[str]) -> dict[str, torch.Tensor | None]:
        """The last step's gradients of ``names``, before `apply_grads` (a tied weight's copies)."""
        return self._state.call_step_grads(names)

    def set_step_grads(self, grads: StateDict) -> None:
        """Replace the last step's gradients of some parameters (a tied weight's summed gradient)."""
        self._state.call_set_step_grads(grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._state.call_zero_grad(set_to_none)

    def grad_norm(self, norm_type: float, skip: Sequence[str] = ()) -> float:
        """This rank's share of the global gradient norm (the sum of ``|g|^p``, or the max for inf)."""
        return self._state.call_grad_norm(norm_type, skip)

    def scale_grads(self, factor: float) -> None:
        self._state.call_scale_grads(factor)

    def clamp_grads(self, value: float) -> None:
        self._state.call_clamp_grads(value)

    def unscale_grads(self, inv_scale: float) -> bool:
        """A GradScaler's unscale on this rank; True if any gradient is inf or nan."""
        return self._state.call_unscale_grads(inv_scale)

    # the optimizer
    def build_optimizer(self, cls: type, defaults: dict[str, Any], groups: list[GroupSpec]) -> None:
        """This rank's part of the optimizer: same class, same hyperparameters per group."""
        self._state.call_build_optimizer(cls, defaults, groups)

    def set_hparams(self, hparams: Hparams) -> None:
        self._state.call_set_hparams(hparams)

    def optimizer_step(self, hparams: Hparams | None) -> None:
        """Step this rank's optimizer, after taking over changed hyperparameters."""
        self._state.call_optimizer_step(hparams)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state by parameter name, and its groups' hyperparameters."""
        return self._state.call_optimizer_state()

    def load_optimizer_state(self, state: dict[str, Any], hparams: Hparams) -> None:
        """Load state given by parameter name (this rank's only) and the groups' hyperparameters."""
        self._state.call_load_optimizer_state(state, hparams)

    # memory
    def stash_sizes(self) -> dict[int, StageBytes]:
        """Per stage of this rank measured so far: what its largest microbatch keeps alive."""
        return self._memory.call_stash_sizes()

    def stash_held(self) -> dict[int, tuple[int, int]]:
        """Per stage of this rank: what its largest microbatch stashes, and keeps from I until W (``"auto"``)."""
        return self._memory.call_stash_held()

    def stash_peak(self) -> int:
        """Most bytes of stashed tensors this rank held at once during the last training step."""
        return self._memory.call_stash_peak()

    def device_memory(self) -> dict[int, DeviceMemory | None]:
        """Per stage of this rank: its device's memory, read in the process that owns the device."""
        return self._memory.call_device_memory()

    def set_recompute(self, flags: dict[int, bool]) -> None:
        """From the next step on, these of this rank's stages recompute their forward in the backward."""
        self._memory.call_set_recompute(flags)

    # asynchronous training
    def async_stats(self) -> list[Staleness]:
        """Each stage's `Staleness` in the last asynchronous run."""
        return self._versions.call_async_stats()

    # sharded checkpoints
    def save_sharded(
        self, path: str, prefix: str, coordinator: CoordinatorPart | None = None, edits: StateEdits | None = None
    ) -> None:
        """Write this process's part of the folder ``path`` (every process of the world at once), under the keys
        the ``on_save_checkpoint`` hooks left (``edits``)."""
        self._checkpoint.call_save_sharded(path, prefix, coordinator, edits)

    def plan_part(self, path: str, prefix: str, optimizer: bool, index: int, edits: StateEdits | None = None) -> Any:
        """Plan this rank's part of the folder ``path`` as participant ``index`` (rpc: DCP's local plan, returned),
        with its optimizer state unless ``optimizer`` is False, under the keys the hooks left (``edits``)."""
        return self._checkpoint.call_plan_part(path, prefix, optimizer, index, edits)

    def write_part(self, plan: Any) -> list[Any]:
        """Write the part `plan_part` planned, as the global ``plan`` says; DCP's write results."""
        return self._checkpoint.call_write_part(plan)

    def load_optimizer_from(
        self,
        path: str,
        prefix: str,
        layout: OptimizerLayout,
        hparams: Hparams,
        aliases: dict[str, list[str]],
    ) -> None:
        """Read this rank's optimizer state from the checkpoint ``path`` by parameter name."""
        self._checkpoint.call_load_optimizer_from(path, prefix, layout, hparams, aliases)


#: the names a message may carry: the public methods above
_CALLS = frozenset(
    name
    for name, value in vars(StageProtocol).items()
    if callable(value) and not name.startswith("_") and name != "serve"
)

assert StageProtocol.ping.__name__ == PING, "the transports' ready ping must name StageProtocol.ping"
