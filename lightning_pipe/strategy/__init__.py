"""The Lightning layer: `PipeStrategy` and its helpers."""

from lightning_pipe.strategy.fault_tolerance import FaultTolerance
from lightning_pipe.strategy.hooks import RuntimeHooks, TrainerView
from lightning_pipe.strategy.strategy import PipeStrategy
from lightning_pipe.strategy.trace_callback import PipeTrace

__all__ = ["FaultTolerance", "PipeStrategy", "PipeTrace", "RuntimeHooks", "TrainerView"]
