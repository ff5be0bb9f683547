"""`ModeParts`: the strategy's parts a mode holds from its construction, so it asks them directly.

A mode reads the running fit's Lightning objects (``host``), writes and reads the training state through
``state`` (`lightning_pipe.strategy.model_state.ModelState`), finds the pipeline through ``builder``, routes
optimizer steps through ``optimization``, and, in launched mode, binds this process's model through ``stage``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipe.strategy.building import PipelineBuilder
from lightning_pipe.strategy.model_state import Host, ModelState
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.process_stage import ProcessStage


@dataclass(frozen=True)
class ModeParts:
    """The parts of one `PipeStrategy` that its mode works with (each the strategy's own object)."""

    host: Host  # the strategy: Lightning's objects of the running fit
    state: ModelState
    builder: PipelineBuilder
    optimization: StageOptimization
    stage: ProcessStage  # this process's part of the model (launched mode binds and serves it)
