"""`Training`: how a training step's updates land: after each batch's flush (here), or in a stream (`AsyncTraining`).

The step driver holds one, chosen once from the schedule when the strategy is made: this class for every
synchronous schedule (each ``training_step`` runs its batch through the pipeline and the stages' gradients wait
for Lightning's optimizer step), `lightning_pipe.strategy.async_training.AsyncTraining` for ``schedule="async"``
(batches stream through the stages, which step their own optimizers). The strategy's other parts ask it, not the
schedule, what a step leaves behind: whether a stream owns the stages, who holds an optimizer's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.engine import StepResult
from lightning_pipe.engine.loss import WeightedLoss
from lightning_pipe.engine.versions import Staleness
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.strategy.optimization import StageOptimization


class Training:
    """A training step per batch, flushed: the pipeline's gradients wait on the stages for Lightning's step."""

    @property
    def streaming(self) -> bool:
        """Whether an open stream owns the stages (their weights and generators) until it drains."""
        return False

    @property
    def owns_stages(self) -> bool:
        """Whether a stream, open or drained but not yet ended, keeps the stages from other calls."""
        return False

    def attach(
        self, optimizers: list[torch.optim.Optimizer], stage_params: list[nn.Parameter], accumulate: int, scaler: Any
    ) -> None:
        """At the setup of a fit: Lightning's optimizers step the stages' parameters where they live."""

    def microbatches(self, pipeline: Pipeline, given: int | str, rows: int) -> int | None:
        """A training step's microbatch count where the pipeline chooses it (``schedule="auto"``: chosen before the
        second training step, logged: `PipelineChoices.microbatches`)."""
        return pipeline.choices.microbatches(given, rows, rank_zero_info)

    def step(
        self,
        pipeline: Pipeline,
        inputs: Sequence[Any],
        labels: list[tuple[float, int]],
        criterion: WeightedLoss,
        trainer: pl.Trainer,
        scaler: Any,
        optimization: StageOptimization,
        starts_window: bool,
    ) -> StepResult:
        """One batch through the pipeline, forwards and backwards, the gradients of the parameters outside the
        pipelined module set aside (``optimization``); ``starts_window``: the first step of a gradient accumulation
        window, whose gradients Lightning zeroes right after it."""
        pipeline.choices.before_step(len(labels), rank_zero_info)  # checkpoint="auto": logged once per fit
        if starts_window:
            # they go now, before the step makes its own, so that a stage never holds two steps' gradients at once
            optimization.drop_grads(trainer.optimizers)
        with optimization.set_aside():
            result = pipeline.coordinator.train_step(inputs, labels, criterion, scaler)
        pipeline.choices.after_step(result)  # schedule="auto": the first step measures, later ones predicted
        return result

    def apply_grads(self, pipeline: Pipeline, scale: float) -> None:
        """In ``backward``: the step's gradients on the stages, times ``scale``, onto ``p.grad`` (the end of the step
        that `step` began, by the same coordinator)."""
        pipeline.coordinator.apply_grads(scale)

    def end(self, pipeline: Pipeline | None) -> None:
        """Before anything else uses the stages (an evaluation step, a checkpoint, the end of a fit)."""

    def abort(self) -> None:
        """After an error (the stages may be gone)."""

    def holds(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s state is held here rather than where Lightning or the stages hold it."""
        return False

    def state_dict(self) -> dict[str, Any]:
        raise ConfigurationError("only schedule='async' holds an optimizer's state in its stream")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise ConfigurationError("only schedule='async' holds an optimizer's state in its stream")

    def staleness(self, schedule: Any) -> list[Staleness]:
        """Per stage, the staleness its microbatches saw (``schedule="async"``)."""
        raise ConfigurationError(f"staleness is measured with schedule='async', not {schedule!r}")
