"""lightning_pipe: pipeline-parallel training for PyTorch Lightning.

``import lightning_pipe`` registers the strategy name ``"pipe"`` with Lightning, so
``Trainer(strategy="pipe")`` works as well as ``Trainer(strategy=PipeStrategy(...))``.
"""

import os
import sys
from typing import Any

from lightning_pipe.base import moved
from lightning_pipe.base.errors import (
    ConfigurationError,
    PartitionError,
    PipeError,
    PipeTimeoutError,
    ScheduleError,
    StageError,
    TransportError,
)
from lightning_pipe.engine.executors import Activation, BackwardModule, ForwardLossModule, ForwardModule
from lightning_pipe.engine.loss import Loss
from lightning_pipe.partition import CallArgs, Partitioner, ShardedTask, TracedPartitioner, TraceError
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.runtime import BaseRuntime, PyTorchRuntime, runtime_registry, to
from lightning_pipe.schedule import Action, Schedule, get_schedule, register_schedule

moved.install()  # the old import paths of moved modules, for one release (base/moved.py)

__version__ = "0.1.0"


def _stage_worker_process() -> bool:
    """A stage worker process (``lightning-pipe worker``, or spawned by transport="rpc") serves stages only."""
    if os.environ.get("LIGHTNING_PIPE_WORKER") == "1":
        return True
    argv = list(getattr(sys, "orig_argv", sys.argv))
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and (
            argv[i + 1] == "lightning_pipe.comm.worker_command" or argv[i + 1 : i + 3] == ["lightning_pipe", "worker"]
        ):
            return True
    return os.path.basename(sys.argv[0]) == "lightning-pipe" and sys.argv[1:2] == ["worker"]


if _stage_worker_process():  # importing Lightning costs seconds per process; a stage never needs it

    def __getattr__(name: str) -> Any:
        if name in ("PipeStrategy", "PipeTrace", "FaultTolerance"):
            from lightning_pipe import strategy

            return getattr(strategy, name)
        raise AttributeError(f"module 'lightning_pipe' has no attribute {name!r}")

else:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pipe.strategy import FaultTolerance, PipeStrategy, PipeTrace

    PipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "Action",
    "Activation",
    "BackwardModule",
    "BaseRuntime",
    "CallArgs",
    "ConfigurationError",
    "FaultTolerance",
    "ForwardLossModule",
    "ForwardModule",
    "Loss",
    "PartitionError",
    "PipeError",
    "PipeStrategy",
    "PipeTimeoutError",
    "PipeTrace",
    "Pipeline",
    "Partitioner",
    "PyTorchRuntime",
    "Schedule",
    "ScheduleError",
    "ShardedTask",
    "StageError",
    "TraceError",
    "TracedPartitioner",
    "TransportError",
    "get_schedule",
    "register_schedule",
    "runtime_registry",
    "to",
]
