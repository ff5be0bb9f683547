"""`ScheduleSelection`: which schedule a fit's pipeline runs, and where its stages are placed for it.

A named schedule runs as named. ``schedule="auto"`` builds where its chooser predicts best and decides after its
first measured step (`lightning_pipe.pipeline.schedule_chooser`); its choice is kept after the fit and in the
checkpoint, so a resumed fit runs what the uninterrupted one ran; with stages sharded by FSDP it leaves out the
schedules that split the backward, and says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.pipeline.schedule_chooser import AutoSchedule, ScheduleChooser, is_auto
from lightning_pipe.schedule import AutoChoice, placement_of, resolve_schedule
from lightning_pipe.strategy.arguments import (
    FSDP_ARGUMENT,
    auto_schedule_of,
    check_sharded_stages,
    leaves_out_split_backward,
    split_backward_left_out,
)
from lightning_pipe.strategy.pipe_config import PipeConfig


class ScheduleSelection:
    """The schedule of the strategy's fits: ``schedule`` (a name, a schedule, or ``schedule="auto"``'s
    `AutoSchedule`), what ``auto`` chose last (``last_choice``) and what a loaded checkpoint says it chose
    (``resumed``)."""

    def __init__(self, config: PipeConfig, agree: Callable[[Any], Any] | None = None) -> None:
        self.config = config
        # schedule="auto" with its options; ``agree``: launched mode's replicas run the first coordinator's choice
        self.schedule = auto_schedule_of(
            config.schedule, config.microbatches, config.memory_budget, config.data_parallel, agree
        )
        #: what left the schedules that split the backward out of ``schedule="auto"``'s choice (said once)
        self.left_out: str | None = FSDP_ARGUMENT if leaves_out_split_backward(config) else None
        self._said_left_out = False
        #: what ``schedule="auto"`` chose in the last fit that chose (`AutoChoice`), kept after it
        self.last_choice: AutoChoice | None = None
        #: schedule="auto"'s choice as a loaded checkpoint holds it (`resume_choice`): a resumed fit runs it
        self.resumed: dict[str, Any] | None = None

    @property
    def rank_placement(self) -> str:
        """Which rank holds each stage: the schedule's placement (``loop``, or ``v`` for ``zbv`` and ``dualpipev``)."""
        if self.resumed is not None:  # schedule="auto"'s choice, from the checkpoint
            return placement_of(resolve_schedule(self.resumed["schedule"]))
        if is_auto(self.schedule):  # built where schedule="auto" predicts best before measuring (`initial_placement`)
            return self.chooser().placement
        return placement_of(resolve_schedule(self.schedule))

    def choice(self, pipeline: Pipeline | None) -> AutoChoice | None:
        """What ``schedule="auto"`` chose in this fit (``pipeline``), or in the last fit that chose; None before."""
        chooser = pipeline.choices.schedule if pipeline is not None else None
        if chooser is not None and chooser.choice is not None:
            return chooser.choice
        return self.last_choice

    def chosen(self, pipeline: Pipeline | None) -> dict[str, Any] | None:
        """``schedule="auto"``'s choice as a checkpoint keeps it (schedule, placement, microbatches), so that a run
        resumed from it runs what the uninterrupted run ran (measured again, it could choose otherwise: a step's
        time is noisy, and a microbatch count of its own changes the sums' rounding); None before it chose."""
        choice = self.choice(pipeline)
        if choice is None:
            return self.resumed
        chosen = choice.chosen
        return {"schedule": chosen.name, "placement": chosen.placement, "microbatches": chosen.microbatches}

    def resume_choice(self, chosen: dict[str, Any]) -> None:
        """A loaded checkpoint's `chosen`: this fit runs it from its first step, measuring nothing
        (``schedule="auto"`` only; a named schedule stays as named)."""
        if not is_auto(self.schedule):
            return
        self.resumed = chosen
        rank_zero_info(
            f"PipeStrategy: schedule='auto' resumes with the choice the checkpoint holds: {chosen['schedule']!r} "
            f"(placement {chosen['placement']!r}), {chosen['microbatches']} microbatches where they are 'auto'"
        )

    def stages_sharded(self, cause: str) -> None:
        """At setup, where this fit's stages are sharded with FSDP (``cause``: what shards them,
        `ProcessStage.sharded`): what they cannot run is refused naming the fix (`check_sharded_stages`), and
        ``schedule="auto"`` leaves out the schedules that split the backward (its pipeline placed as before, or
        refused naming the fix)."""
        check_sharded_stages(cause, self.config.save_distributed_checkpoint, self.config.schedule)
        if isinstance(self.schedule, AutoSchedule) and self.schedule.split_backward:
            placed = self.rank_placement
            self.schedule = replace(self.schedule, split_backward=False)
            self.left_out = cause
            if self.rank_placement != placed:  # the processes were placed for a schedule that splits its backward
                raise ConfigurationError(
                    f"schedule='auto' placed the stages for a schedule that splits the backward ({placed!r}), which "
                    f"the stages sharded by {cause} cannot run: pass schedule=AutoSchedule(split_backward=False) "
                    "(lightning_pipe.pipeline.schedule_chooser), or a schedule such as '1f1b' or 'interleaved-1f1b'"
                )

    def say_left_out(self) -> None:
        """At setup: which schedules ``schedule="auto"`` leaves out for stages sharded with FSDP, and why (once)."""
        if self.left_out is not None and not self._said_left_out:
            self._said_left_out = True
            rank_zero_info(split_backward_left_out(self.left_out))

    def chooser(self) -> ScheduleChooser:
        """A ``schedule="auto"`` chooser of this configuration: its probe and the placement it builds in (the loop
        where the stage count is not given)."""
        options = self.schedule if isinstance(self.schedule, AutoSchedule) else AutoSchedule()
        virtual, stages = self.config.virtual_stages, self.config.stages
        ranks = stages // virtual if stages is not None else None
        chooser = ScheduleChooser(options, virtual, self.config.runner, ranks, self.config.microbatches)
        chooser.options = replace(options, placement=chooser.placement)  # the pipeline builds there
        return chooser

    def for_pipeline(self) -> Any:
        """What a new pipeline runs: the checkpoint's choice of ``schedule="auto"``, the chooser placed where it
        builds, or the named schedule."""
        if self.resumed is not None:
            return self.resumed["schedule"]
        return self.chooser().options if is_auto(self.schedule) else self.schedule

    def for_plan(self) -> Any:
        """What the memory plan plans: ``schedule="auto"`` as its first, measured step runs (the probe)."""
        return self.chooser() if is_auto(self.schedule) else self.schedule

    def closing(self, pipeline: Pipeline) -> None:
        """A fit's pipeline closes: ``schedule="auto"``'s choice stays readable after the fit."""
        if pipeline.choices.schedule is not None:
            self.last_choice = pipeline.choices.schedule.choice
