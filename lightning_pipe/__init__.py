"""lightning_pipe: pipeline-parallel training for PyTorch Lightning.

``import lightning_pipe`` registers the strategy name ``"pipe"`` with Lightning, so
``Trainer(strategy="pipe")`` works as well as ``Trainer(strategy=PipeStrategy(...))``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.errors import (
    ConfigurationError,
    PartitionError,
    PipeError,
    PipeTimeoutError,
    ScheduleError,
    StageError,
    TransportError,
)
from lightning_pipe.executors import Activation, BackwardModule, ForwardLossModule, ForwardModule
from lightning_pipe.partition import Partitioner, ShardedTask
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.runtime import BaseRuntime, PyTorchRuntime, runtime_registry, to
from lightning_pipe.schedule import Action, Schedule, get_schedule, register_schedule
from lightning_pipe.strategy import PipeStrategy

__version__ = "0.1.0"

PipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "Action",
    "Activation",
    "BackwardModule",
    "BaseRuntime",
    "ConfigurationError",
    "ForwardLossModule",
    "ForwardModule",
    "PartitionError",
    "PipeError",
    "PipeStrategy",
    "PipeTimeoutError",
    "Pipeline",
    "Partitioner",
    "PyTorchRuntime",
    "Schedule",
    "ScheduleError",
    "ShardedTask",
    "StageError",
    "TransportError",
    "get_schedule",
    "register_schedule",
    "runtime_registry",
    "to",
]
