"""`PipelineChoices`: what a `Pipeline` decides around its training steps, from what its first step measured.

``schedule="auto"`` (`lightning_pipe.pipeline.schedule_chooser`) measures the first training step and chooses the
schedule (with ``microbatches="auto"``, the count too) before the second, moving the stages where the choice places them
(`lightning_pipe.pipeline.stage_moves`); ``checkpoint="auto"`` (`lightning_pipe.pipeline.recompute`) decides before
the second step which stages recompute. A pipeline with neither decides nothing: the given count runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.engine import Coordinator, StepResult
from lightning_pipe.pipeline.recompute import AutoCheckpoint, RecomputePlan
from lightning_pipe.pipeline.schedule_chooser import AUTO, ScheduleChooser, StageMoves, first_microbatches

log = logging.getLogger("lightning_pipe")


class PipelineChoices:
    """A pipeline's ``schedule="auto"`` (``schedule``, a `ScheduleChooser`, or None) and ``checkpoint="auto"``
    (``checkpoint``, an `AutoCheckpoint`, or None), asked before and after each synchronous training step.

    ``coordinator`` gives the built pipeline's engine (None until the stages exist: a traced module is built on
    its first microbatch); ``moves`` says where the stages can move and how (asked once the stages exist).
    """

    def __init__(
        self,
        schedule: ScheduleChooser | None,
        checkpoint: AutoCheckpoint | None,
        ranks: int,
        coordinator: Callable[[], Coordinator | None],
        moves: Callable[[], StageMoves],
    ) -> None:
        self.schedule = schedule
        self.checkpoint = checkpoint
        self._ranks = ranks
        self._coordinator = coordinator
        self._moves = moves

    def microbatches(self, given: int | str, rows: int, report: Callable[[str], Any] = log.info) -> int:
        """Before a training step, before its batch of ``rows`` rows is split: how many microbatches it runs with.
        ``schedule="auto"`` decides before the second step and reports its choice; ``microbatches="auto"`` (only
        with ``schedule="auto"``) lets it choose the count too."""
        if self.schedule is None:
            if given == AUTO:
                raise ConfigurationError("microbatches='auto' is chosen by schedule='auto'; pass a number or both")
            return int(given)
        coordinator = self._coordinator()
        if coordinator is None:  # a traced module's first step: built on its first microbatch
            return first_microbatches(rows, self._ranks) if given == AUTO else int(given)
        return self.schedule.before_step(coordinator, given, rows, report, self._moves())

    def before_step(self, microbatches: int, report: Callable[[str], Any] = log.info) -> RecomputePlan | None:
        """Before each training step: ``checkpoint="auto"`` decides (and reports, once) before the second."""
        coordinator = self._coordinator()
        if self.checkpoint is None or coordinator is None:
            return None
        decided = self.checkpoint.before_step(coordinator, microbatches)
        if decided is not None:
            report(f"lightning_pipe: {decided.table()}")
        return decided

    def after_step(self, result: StepResult) -> None:
        """After each training step: ``schedule="auto"`` measures the first, predicts the later ones."""
        if self.schedule is not None:
            self.schedule.after_step(result)
