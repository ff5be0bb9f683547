"""The engine: a coordinator and stage workers that execute a schedule's actions."""

from lightning_pipe.engine.coordinator import Coordinator
from lightning_pipe.engine.coordinator_link import CoordinatorLink
from lightning_pipe.engine.messages import EVAL, TRAIN, AutocastSpec, StageSpec, StepPlan
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.engine.stage_worker import StageWorker
from lightning_pipe.engine.step_result import StepResult

__all__ = [
    "EVAL",
    "TRAIN",
    "AutocastSpec",
    "Coordinator",
    "CoordinatorLink",
    "StageProtocol",
    "StageSpec",
    "StageWorker",
    "StepPlan",
    "StepResult",
]
