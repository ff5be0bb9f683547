"""`OneProcess`: what a mode whose Lightning loop runs in one process answers (local and rpc mode hold one).

Lightning sees one process of rank 0, reading all the data; there is no launcher and no device mesh; every
collective is the identity (`Alone`); the stages' devices come from ``devices=`` or the Trainer's devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.strategy.arguments import fsdp_without_replicas
from lightning_pipe.strategy.modes.mode import Collectives
from lightning_pipe.strategy.pipe_config import PipeConfig


class Alone(Collectives):
    """Lightning's collectives in one process: nothing to agree on."""

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    @override
    def barrier(self) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision


class OneProcess:
    """The answers of a mode named ``name`` that runs Lightning's loop in this process only (``config``: the
    strategy's arguments; ``stages``, ``devices`` and ``data_parallel`` are read)."""

    def __init__(self, name: str, config: PipeConfig) -> None:
        self.name = name
        self.config = config
        self.collectives = Alone()

    def describe(self, where: str) -> str:
        """The line logged once when the run starts (``where``: where the stages run)."""
        return f"PipeStrategy: {self.name} mode, one Lightning process, stages in {where}"

    @staticmethod
    def set_ranks(environment: Any) -> None:
        """This process is the only one Lightning sees."""
        if environment is not None:
            environment.set_global_rank(0)
            environment.set_world_size(1)

    @property
    def sampler_kwargs(self) -> dict[str, Any]:
        """This process's loop reads all the data."""
        return {"num_replicas": 1, "rank": 0}

    def fsdp_warning(self) -> str | None:
        """No stage has a second replica to shard over."""
        return fsdp_without_replicas(self.config.data_parallel, f"{self.name} mode", 1)

    def stage_devices(self, trainer_devices: Sequence[torch.device] | None) -> list[str]:
        """One device per stage: ``devices=``, else the Trainer's devices (``trainer_devices``), or cpu for every
        stage."""
        config = self.config
        if config.stage_devices is not None:
            return config.stage_devices
        names = [str(d) for d in (trainer_devices or [torch.device("cpu")])]
        stages = config.stages or len(names)
        if all(d == "cpu" for d in names):
            return ["cpu"] * stages
        if stages > len(names):
            raise ConfigurationError(
                f"stages={stages} but the Trainer has {len(names)} devices ({', '.join(names)}); "
                "pass devices=[...] with one device per stage (stages may share a device)"
            )
        return names[:stages]
