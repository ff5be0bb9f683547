"""The Lightning layer: `PipeStrategy` and its helpers."""

from lightning_pipe.strategy.hooks import RuntimeHooks, TrainerView
from lightning_pipe.strategy.strategy import PipeStrategy

__all__ = ["PipeStrategy", "RuntimeHooks", "TrainerView"]
