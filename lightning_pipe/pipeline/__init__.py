"""The `Pipeline` and what only it uses: its inputs and choices, the schedule chooser, stage moves and state,
the layout, optimizers, timeline, memory plan and recomputation."""

from lightning_pipe.pipeline.pipeline import Pipeline

__all__ = ["Pipeline"]
