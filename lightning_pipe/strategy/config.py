"""`PipeConfig`: `PipeStrategy`'s arguments, validated once and frozen, handed to every part that reads them.

The strategy's parts (the pipeline builder, the step driver, the processes and the launched world) receive
this one object instead of re-listing ``timeout``, ``runner`` or ``virtual_stages`` each (torchtitan's
``JobConfig`` is the model). Adding an argument is two edits: a field here and a keyword of
`PipeStrategy.__init__` (its docstring says what it means); `PipeConfig.of` checks the values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pipe.backends import BackendArg
from lightning_pipe.microbatch_weights import MicrobatchWeight
from lightning_pipe.partition import Partitioner
from lightning_pipe.runtime import BaseRuntime
from lightning_pipe.strategy.arguments import check_arguments, check_memory_arguments
from lightning_pipe.strategy.tensor_parallel import check_tensor_parallel_arguments


@dataclass(frozen=True)
class PipeConfig:
    """The user's arguments of one `PipeStrategy` (see its docstring for each), checked, plus what they imply."""

    stages: int | None = None
    microbatches: int | str = 4
    schedule: Any = "1f1b"
    partition: str | Sequence[int] | Partitioner = "params"
    module: str | None = None
    devices: Sequence[str | torch.device] | None = None
    checkpoint: str = "auto"
    runtime: str | BaseRuntime | None = None
    timeout: float = 300.0
    backend: BackendArg = None
    strict: bool = False
    transport: str | None = None
    coordinator: str | None = None
    token: str | None = None
    compress: Any = None
    split_points: Sequence[str] | None = None
    virtual_stages: int = 1
    runner: str = "parallel"
    trace: Any = None
    microbatch_weight: MicrobatchWeight | None = None
    data_parallel: str = "ddp"
    weights: str | os.PathLike[str] | None = None
    save_distributed_checkpoint: bool = True
    memory_budget: int | None = None
    weights_only: bool | None = None
    tensor_parallel: int = 1
    # what the arguments imply (set by `of`)
    stage_devices: list[str] | None = field(default=None, init=False)  # ``devices`` as names
    asynchronous: bool = field(default=False, init=False)  # the schedule streams batches (``"async"``)
    transport_options: Mapping[str, Any] = field(default_factory=dict, init=False)  # rpc: coordinator, token, compress

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> PipeConfig:
        """The config of ``arguments`` (any mapping holding the fields' names, e.g. ``locals()``), checked:
        a bad value raises `ConfigurationError` naming the argument and the fix."""
        config = cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.init and f.name in arguments})
        stages, devices, asynchronous, options = check_arguments(
            config.stages, config.microbatches, config.schedule, config.devices, config.checkpoint, config.runtime,
            config.timeout, config.backend, config.strict, config.transport, config.coordinator, config.token,
            config.split_points, config.virtual_stages, config.runner, config.microbatch_weight, config.compress,
        )  # fmt: skip
        check_memory_arguments(
            config.data_parallel, config.weights, config.save_distributed_checkpoint, config.schedule
        )  # fmt: skip
        check_tensor_parallel_arguments(
            config.tensor_parallel, config.transport, config.schedule, config.virtual_stages, config.data_parallel
        )
        config = dataclasses.replace(config, stages=stages, timeout=float(config.timeout))
        for name, value in (("stage_devices", devices), ("asynchronous", asynchronous), ("transport_options", options)):
            object.__setattr__(config, name, value)  # derived once here; frozen for everyone after
        return config

    @property
    def weights_path(self) -> str | None:
        """``weights`` as a path string (None without pretrained weights)."""
        return os.fspath(self.weights) if self.weights is not None else None
