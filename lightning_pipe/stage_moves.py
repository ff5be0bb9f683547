"""Moving a built pipeline's stages to another placement: ``schedule="auto"`` choosing a schedule placed otherwise.

The stage costs the first step measures are per stage, wherever a stage runs, so ``schedule="auto"`` simulates
schedules of every placement (`lightning_pipe.schedule.placement`: the loop, the V of ZB-V and DualPipeV). Where it
chooses one placed otherwise than the pipeline was built, the stage workers are started again in that placement
before the next step. Nothing a stage holds is lost or changed:

- with stages that share the module's parameters (``transport="local"``), a stage that moves to another worker is
  the same module object: its parameters, buffers and gradients, and the optimizer's state keyed by them, stay
  as they are; a stage moves only where it keeps its device (`moves_of`);
- what a worker holds apart from the module moves through `StageProtocol`'s control calls: each stage's random
  generator states (`StageProtocol.random_state`, loaded into the new workers), the first step's stash sizes
  (kept for ``checkpoint="auto"``'s decision, `AutoCheckpoint.remember`), and the backends' execution trace
  (returned, for `Pipeline.execution_trace` to add).

Stages that own their parameters in other processes (``transport="rpc"``, launched mode) do not move: there
``schedule="auto"`` chooses among the schedules of the built placement, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_pipe.auto_schedule import StageMoves
from lightning_pipe.backends import ExecutionTrace
from lightning_pipe.comm import Communicator
from lightning_pipe.engine import Coordinator, StageProtocol, StageSpec
from lightning_pipe.recompute import AutoCheckpoint
from lightning_pipe.schedule import PLACEMENTS
from lightning_pipe.stage_layout import stage_devices
from lightning_pipe.stage_state import StageState

OWN_PARAMETERS = (
    "the stages own their parameters in other processes (rpc or launched mode), and schedule='auto' does not move "
    "a stage between processes"
)


def moves_of(
    communicator: Communicator,
    given: Sequence[Any] | None,
    devices: Sequence[str],
    virtual_stages: int,
    move: Callable[[str], None],
) -> StageMoves:
    """Where a pipeline of ``devices`` (one per stage, from the user's ``given``) can move its stages: every placement
    that keeps each stage on its device, where the stages share the module's parameters; nowhere where they own them."""
    if communicator.stages_own_parameters:
        return StageMoves([], move, OWN_PARAMETERS)
    stages, ranks = len(devices), len(devices) // virtual_stages
    same = [p for p in PLACEMENTS if stage_devices(given, stages, ranks, p) == list(devices)]
    why = "" if len(same) == len(PLACEMENTS) else "another placement would put a stage on another device"
    return StageMoves(same, move, why)


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
