"""`Mode`: what differs between local, rpc and launched mode, as abstract interfaces that hold no behaviour.

Lightning chooses behaviour by class (DDP, FSDP, ModelParallel); `PipeStrategy` is one class whose hooks ask its
mode, chosen once when Lightning sets the world's ranks (`lightning_pipe.strategy.modes.mode_choice`). A mode is
three interfaces, one per concern: `ProcessWorld` (the processes: ranks, launcher, devices, transport, and their
`Collectives`), `StageResidence` (where the stages and their state live) and `TrainingStateIO` (how the training
state is read and written). `LocalMode`, `RpcMode` and `LaunchedMode` each implement every method; what two of
them share is an object they hold (`OneProcess`, `WholeFile`), never a body here (`tests/test_house_modes.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_pipe.comm import Communicator
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.schedule import LOOP
from lightning_pipe.strategy.building import Destination
from lightning_pipe.strategy.layout import Layout
from lightning_pipe.strategy.patch import Patches

Write = Callable[..., None]  # Lightning's own way of writing or removing a checkpoint (the strategy's base class's)


class Collectives(ABC):
    """Lightning's collectives among the processes that run its loop."""

    @abstractmethod
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``tensor`` reduced by ``reduce_op`` (a non-tensor as it is)."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait for the others."""

    @abstractmethod
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as global rank ``src`` holds it."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """``tensor`` of every process, stacked."""

    @abstractmethod
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Whether every process (``all``) or any decided so."""


class ProcessWorld(ABC):
    """The processes of a run: how many Lightning's loop sees, their ranks and launcher, their devices, the
    pipeline's transport between them, the collectives, and what a fit's start and end mean for them."""

    #: the mode's name, as `lightning_pipe.strategy.layout` spells it
    name: ClassVar[str]

    @abstractmethod
    def describe(self) -> str:
        """The line logged once when the run starts."""

    @abstractmethod
    def unread(self, checkpoint_io: Any) -> list[str | None]:
        """The warnings for the arguments this mode does not read (`lightning_pipe.strategy.unread`;
        ``checkpoint_io``: the strategy's); None where one does not apply."""

    @abstractmethod
    def fsdp_warning(self) -> str | None:
        """The warning for ``data_parallel="fsdp"`` where no stage has a second replica to shard over."""

    @property
    @abstractmethod
    def layout(self) -> Layout | None:
        """The processes, replicas and pipeline ranks of launched mode; None in one process."""

    @abstractmethod
    def set_ranks(self, environment: Any) -> None:
        """Lightning's connector sets the world's ranks (``environment``: its cluster environment)."""

    @abstractmethod
    def launcher(self, environment: Any, devices: int, num_nodes: int, serve: Callable[[Any], None]) -> Any:
        """Lightning's launcher for this mode (None: Lightning's loop runs in this process only)."""

    @abstractmethod
    def connect(self, environment: Any) -> None:
        """Lightning sets up the environment (each fit): join whatever the mode's processes share."""

    @property
    @abstractmethod
    def device_mesh(self) -> Any:
        """The DeviceMesh of the mode's processes, for ``configure_model`` (None: one process, no mesh)."""

    @abstractmethod
    def world_size(self, lightning: int) -> int:
        """The world size Lightning's loop sees (``lightning``: what Lightning's own reckoning gives)."""

    @property
    @abstractmethod
    def sampler_kwargs(self) -> dict[str, Any]:
        """Which share of the data this process's loop reads (Lightning's distributed sampler)."""

    @property
    @abstractmethod
    def distributed(self) -> bool:
        """Whether Lightning's connector gives the loop a distributed sampler."""

    @abstractmethod
    def root_device(self, placed: Callable[[], torch.device]) -> torch.device:
        """The coordinator's device (``placed``: where the strategy's placement puts the last stage's output)."""

    @abstractmethod
    def stage_devices(self, trainer_devices: Sequence[torch.device] | None = None, placement: str = LOOP) -> list[str]:
        """One device per stage (``trainer_devices``: the Trainer's; ``placement``: which rank holds each stage)."""

    @abstractmethod
    def transport(self) -> str | Communicator:
        """The pipeline's transport."""

    @property
    @abstractmethod
    def collectives(self) -> Collectives:
        """Lightning's collectives among the processes that run its loop."""

    @abstractmethod
    def hold(self) -> None:
        """A fit (or validate, test, predict) starts."""

    @abstractmethod
    def release(self, error: BaseException | None = None) -> None:
        """It ended (with ``error`` if it failed)."""


class StageResidence(ABC):
    """Where the stages' parameters and the optimizers' state live, and what a fit's setup and end do to them."""

    @abstractmethod
    def prepare_optimization(self, outside: Iterable[nn.Parameter]) -> None:
        """At setup: where the optimizers step (``outside``: the parameters outside the pipelined module)."""

    @abstractmethod
    def built(self, pipeline: Pipeline, device: torch.device) -> None:
        """A pipeline was built: each optimizer steps the stages' parameters where they live."""

    @abstractmethod
    def continue_from(self, destination: Destination) -> None:
        """At setup, after `ModelState.prepare`: where a later run of a module an earlier run here trained finds the
        values its stages start from, where the module does not hold them (``destination.init``)."""

    @abstractmethod
    def install(self, patches: Patches) -> None:
        """At setup, after the optimizers: what this mode sets on the user's objects for the fit."""

    @abstractmethod
    def keep_stages(self) -> None:
        """At teardown, before the stages stop: what the checkpoints written after the fit need of them."""

    @abstractmethod
    def fold_back(self) -> None:
        """Before the stages stop: the LightningModule and its optimizers end up trained where it takes them."""


class TrainingStateIO(ABC):
    """How Lightning's checkpoint hooks read and write the training state in this mode."""

    @abstractmethod
    def load_checkpoint(self, path: Any, weights_only: bool | None, lightning: Callable[..., Any]) -> dict[str, Any]:
        """``load_checkpoint``: what Lightning restores of ``path`` (``lightning``: Lightning's reading)."""

    @abstractmethod
    def load_optimizer_state(self, checkpoint: Any) -> None:
        """``load_optimizer_state_dict``: the checkpoint's optimizer states, each where its parameters live."""

    @abstractmethod
    def module_state(self, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``lightning_module_state_dict``: the LightningModule's state (``lightning``: Lightning's reading)."""

    @abstractmethod
    def optimizer_state(self, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """``optimizer_state``: ``optimizer``'s state (``lightning``: Lightning's reading)."""

    @abstractmethod
    def random_state(self, stages: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """What a checkpoint holds of the stages' generator states (``stages``: asks the stages for theirs)."""

    @abstractmethod
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Path, storage_options: Any, lightning: Write) -> None:
        """``save_checkpoint``: ``checkpoint`` at ``path`` (``lightning``: Lightning's writing)."""

    @abstractmethod
    def remove_checkpoint(self, path: Path, lightning: Write) -> None:
        """``remove_checkpoint``: once the checkpoint being written is published (``lightning``: Lightning's)."""

    @abstractmethod
    def end_fit(self, error: BaseException | None = None) -> None:
        """The fit ends: its last checkpoint written and published first (or, after ``error``, left to finish)."""


class Mode(ProcessWorld, StageResidence, TrainingStateIO):
    """A mode: the three interfaces, each method implemented by the mode itself."""
