"""The engine: a coordinator and stage workers that execute a schedule's actions."""

from lightning_pipe.engine.coordinator import Coordinator, StepResult
from lightning_pipe.engine.plan import EVAL, TRAIN, AutocastSpec, StageSpec, StepPlan
from lightning_pipe.engine.stage import StageWorker

__all__ = ["EVAL", "TRAIN", "AutocastSpec", "Coordinator", "StageSpec", "StageWorker", "StepPlan", "StepResult"]
