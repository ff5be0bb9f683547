"""`ParameterHome`: where a pipeline's stages keep their parameters, as each transport answers it.

The stages of the local transport are threads that share the coordinator's module (`SharedParameters`): a tied
weight is one parameter, an optimizer steps the module itself, the stages may move to other ranks. The stages of
the rpc and p2p transports hold their own copy in another process (`StageCopies`): gradients, optimizer steps and
call variants reach them over control calls, and they stay where they were built. The coordinator's side asks the
communicator's `ParameterHome` instead of testing which kind it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import override

from lightning_pipe.base import tree
from lightning_pipe.base.errors import ConfigurationError

Copies = list[list[tuple[int, str]]]  # per tied weight: the (rank, name) of each rank's copy, the first holder first
#: why the stages of a transport whose stages own their parameters do not move (``schedule="auto"``)
STAGES_STAY = (
    "the stages own their parameters in other processes (rpc or launched mode), and schedule='auto' does not move "
    "a stage between processes"
)


class ParameterHome(ABC):
    """What the coordinator's side does where the stages keep their parameters."""

    @abstractmethod
    def may_leave(self, inputs: Sequence[Any]) -> bool:
        """Whether a train step may return before the ranks other than the last stage's finished their backwards."""

    @abstractmethod
    def sender(self, stages: Any) -> Callable[..., Any]:
        """How a call that sets the stages' gradients reaches every rank (``stages``: the coordinator's proxy)."""

    @abstractmethod
    def copies(self, rank_of: Sequence[int], tied: Sequence[Sequence[tuple[int, str]]]) -> Copies:
        """Per weight that several shards hold (``tied``: their (shard, name)), its copies on several ranks."""

    @abstractmethod
    def held_names(self, shards: Sequence[Any]) -> list[set[str]]:
        """Per shard, the names of the submodules, parameters and buffers its stage holds a copy of."""

    @abstractmethod
    def update_copies(self, update: Callable[[], None]) -> None:
        """Tell the stages what changed in the coordinator's module (``update`` sends it) where they hold copies."""

    @abstractmethod
    def movable(self, placements: Callable[[], tuple[list[str], str]]) -> tuple[list[str], str]:
        """The placements the stages may move to, and why not others (``placements``: those that keep each stage
        on its device)."""

    @abstractmethod
    def check_stage_optimizers(self) -> None:
        """Per-stage optimizer parts are made for these stages: refused where they share the module."""


class SharedParameters(ParameterHome):
    """The stages share the coordinator's module (threads of its process)."""

    @override
    def may_leave(self, inputs: Sequence[Any]) -> bool:
        """No: the caller's optimizer reads the gradients the last backwards set."""
        return False

    @override
    def sender(self, stages: Any) -> Callable[..., Any]:
        """Called and waited for: the caller's optimizer reads ``p.grad`` next."""
        return stages.call_each  # type: ignore[no-any-return]

    @override
    def copies(self, rank_of: Sequence[int], tied: Sequence[Sequence[tuple[int, str]]]) -> Copies:
        """None: a tied weight is one parameter."""
        return []

    @override
    def held_names(self, shards: Sequence[Any]) -> list[set[str]]:
        """None: the stages hold no copies."""
        return []

    @override
    def update_copies(self, update: Callable[[], None]) -> None:
        """Nothing: the stages run the coordinator's own modules."""

    @override
    def movable(self, placements: Callable[[], tuple[list[str], str]]) -> tuple[list[str], str]:
        return placements()

    @override
    def check_stage_optimizers(self) -> None:
        raise ConfigurationError(
            "with transport='local' the stages share the module's parameters: step the optimizer itself"
        )


class StageCopies(ParameterHome):
    """Each stage holds its own copy of its parameters, in another process."""

    @override
    def may_leave(self, inputs: Sequence[Any]) -> bool:
        """Yes, unless the inputs need gradients (they come from the first stage's last backwards): everything the
        coordinator sends the stages later runs after their step, in order."""
        return not any(any(tree.grad_mask(x)) for x in inputs)

    @override
    def sender(self, stages: Any) -> Callable[..., Any]:
        """Posted: only later calls read the gradients, and each stage runs them after this one."""
        return stages.post_each  # type: ignore[no-any-return]

    @override
    def copies(self, rank_of: Sequence[int], tied: Sequence[Sequence[tuple[int, str]]]) -> Copies:
        """The (rank, name) of each rank's copy, the first holder first (two shards of one rank share one copy)."""
        found = []
        for places in tied:
            holders: dict[int, str] = {}
            for index, name in places:
                holders.setdefault(rank_of[index], name)
            if len(holders) > 1:
                found.append(list(holders.items()))
        return found

    @override
    def held_names(self, shards: Sequence[Any]) -> list[set[str]]:
        return [
            {n for n, _ in shard.module.named_modules(remove_duplicate=False) if n}
            | {n for n, _ in shard.module.named_parameters(remove_duplicate=False)}
            | {n for n, _ in shard.module.named_buffers(remove_duplicate=False)}
            for shard in shards
        ]

    @override
    def update_copies(self, update: Callable[[], None]) -> None:
        update()

    @override
    def movable(self, placements: Callable[[], tuple[list[str], str]]) -> tuple[list[str], str]:
        """None: a stage does not move between processes."""
        return [], STAGES_STAY

    @override
    def check_stage_optimizers(self) -> None:
        """Nothing to refuse: each stage steps its own copy."""
