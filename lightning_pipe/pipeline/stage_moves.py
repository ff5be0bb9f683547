"""Moving a built pipeline's stages to another placement: ``schedule="auto"`` choosing a schedule placed otherwise.

In local mode the stages share the module's parameters, so new workers in the new placement hold the same module
objects (parameters, buffers, optimizer state stay); each stage's generator states, the first step's stash sizes
and the execution trace are carried over the control calls. Stages that own their parameters in other processes
(rpc, launched mode) do not move. How and why: docs/internals.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_pipe.backends import ExecutionTrace
from lightning_pipe.comm import Communicator
from lightning_pipe.engine import Coordinator, StageProtocol, StageSpec
from lightning_pipe.pipeline.recompute import AutoCheckpoint
from lightning_pipe.pipeline.schedule_chooser import StageMoves
from lightning_pipe.pipeline.stage_layout import stage_devices
from lightning_pipe.pipeline.stage_state import StageState
from lightning_pipe.schedule import PLACEMENTS


def moves_of(
    communicator: Communicator,
    given: Sequence[Any] | None,
    devices: Sequence[str],
    virtual_stages: int,
    move: Callable[[str], None],
) -> StageMoves:
    """Where a pipeline of ``devices`` (one per stage, from the user's ``given``) can move its stages: every placement
    that keeps each stage on its device, where the stages share the module's parameters; nowhere where they own them."""
    placements, why = communicator.parameters.movable(lambda: _same_devices(given, devices, virtual_stages))
    return StageMoves(placements, move, why)


def _same_devices(given: Sequence[Any] | None, devices: Sequence[str], virtual_stages: int) -> tuple[list[str], str]:
    """The placements that keep each stage on its device, and why not the others."""
    stages, ranks = len(devices), len(devices) // virtual_stages
    same = [p for p in PLACEMENTS if stage_devices(given, stages, ranks, p) == list(devices)]
    why = "" if len(same) == len(PLACEMENTS) else "another placement would put a stage on another device"
    return same, why


def move_stages(
    coordinator: Coordinator, stage_state: StageState, specs: Sequence[StageSpec], checkpoint: AutoCheckpoint | None
) -> ExecutionTrace:
    """Start the stage workers again from ``specs`` (the same shards, placed otherwise), carrying what the old ones
    held apart from the module; returns the old workers' execution trace (the new ones count from zero)."""
    random = stage_state.random_state()
    traces = [t for rank in coordinator.stages.call(StageProtocol.execution_trace, False) for t in rank]
    if checkpoint is not None:
        checkpoint.remember(coordinator)
    coordinator.restart(specs)
    stage_state.load_random_state(random)
    return ExecutionTrace(sorted(traces, key=lambda t: t.stage))
