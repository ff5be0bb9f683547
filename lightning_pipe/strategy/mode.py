"""`Mode`: what differs between local, rpc and launched mode, behind one small interface.

Lightning chooses behaviour by class (DDP, FSDP, ModelParallel); `PipeStrategy` is one class whose
hooks ask its mode, chosen once when Lightning sets the world's ranks (`lightning_pipe.strategy.layout`
says which mode runs when). A mode answers: how many processes Lightning's loop sees and which share
of the data each reads, the collectives among them, the coordinator's device, which transport the
pipeline's stages use and whether they own their parameters, and what a fit's start and end mean for
the processes. `LocalMode` and `RpcMode` run Lightning's loop in one process (every collective is the
identity); launched mode (`lightning_pipe.strategy.launched.LaunchedMode`) spans the processes that
Lightning's launchers start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from lightning_pipe.comm import Communicator
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.layout import LOCAL, RPC, Layout


class Mode:
    """One Lightning process, stages wherever its transport puts them: the defaults every mode starts from."""

    name: ClassVar[str]
    #: the stages hold their own parameters and optimizer state (workers, other processes), not the module's
    stages_own_parameters: ClassVar[bool] = True
    #: after a fit the LightningModule gets the stages' trained values back (one process holds the model)
    folds_stages_back: ClassVar[bool] = True

    @property
    def layout(self) -> Layout | None:
        """The processes, replicas and pipeline ranks of launched mode; None in one process."""
        return None

    def describe(self) -> str:
        """The line logged once when the run starts."""
        return f"PipeStrategy: {self.name} mode, one Lightning process"

    def set_ranks(self, environment: Any) -> None:
        """Lightning's connector sets the world's ranks: this process is the only one Lightning sees."""
        if environment is not None:
            environment.set_global_rank(0)
            environment.set_world_size(1)

    def connect(self, environment: Any) -> None:
        """Lightning sets up the environment: join whatever the mode's processes share (nothing here)."""

    def launcher(self, environment: Any, devices: int, num_nodes: int, serve: Callable[[Any], None]) -> Any:
        """Lightning's launcher for this mode (None: Lightning's loop runs in this process only)."""
        return None

    def world_size(self, lightning: int) -> int:
        """The world size Lightning's loop sees (``lightning``: what Lightning's own reckoning gives)."""
        return lightning

    @property
    def sampler_kwargs(self) -> dict[str, Any]:
        """Which share of the data this process's loop reads (Lightning's distributed sampler)."""
        return {"num_replicas": 1, "rank": 0}

    @property
    def distributed(self) -> bool:
        """Whether Lightning's connector gives the loop a distributed sampler."""
        return False

    def root_device(self, placed: Callable[[], torch.device]) -> torch.device:
        """The coordinator's device (``placed``: where the strategy's placement puts the last stage's output)."""
        return placed()

    def stage_devices(self, given: Callable[[], list[str]], placement: str = LOOP) -> list[str]:
        """One device per stage (``given``: from ``devices=`` or the Trainer's devices; ``placement``: which rank
        holds each stage, as the schedule says)."""
        return given()

    def transport(self, name: str | None) -> str | Communicator:
        """The pipeline's transport: ``name`` (the strategy's ``transport``) here."""
        return name or LOCAL

    # a fit
    def hold(self) -> None:
        """A fit (or validate, test, predict) starts."""

    def release(self, error: BaseException | None = None) -> None:
        """It ended (with ``error`` if it failed)."""

    # Lightning's collectives: nothing to agree on in one process
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision


class LocalMode(Mode):
    """Stages are threads of this process on the Trainer's devices; they share the module's parameters."""

    name = LOCAL
    stages_own_parameters = False

    def describe(self) -> str:
        return f"{super().describe()}, stages in threads of this process"


class RpcMode(Mode):
    """Stages are worker processes of a private RPC world; each owns its stage's parameters and optimizer."""

    name = RPC

    def describe(self) -> str:
        return f"{super().describe()}, stages in rpc worker processes"
