"""What the coordinator tells the stage workers: their build spec and each step's plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_pipe.engine.loss import Loss
from lightning_pipe.schedule import Action
from lightning_pipe.schedule.action import pack_actions, unpack_actions

TRAIN = "train"
EVAL = "eval"
ASYNC = "async"  # a stream of batches; each stage updates its own weights (engine/versions.py)


@dataclass
class AutocastSpec:
    """Mixed precision each stage applies to its own thread (autocast is thread-local)."""

    dtype: Any  # torch.dtype

    def for_device(self, device_type: str) -> dict[str, Any]:
        return {"device_type": device_type, "dtype": self.dtype}


@dataclass
class StageSpec:
    """Everything a rank needs to build its stage worker: its shards and how to run them."""

    rank: int
    shards: list[Any]  # ShardedTask
    num_stages: int
    rank_of_stage: list[int]
    checkpoint: list[bool | None]  # per stage index: recompute the forward in the backward; None: "auto"
    timeout: float
    runtime: Any = None  # a BaseRuntime for every shard, {stage: BaseRuntime}, or None: chosen by device type
    autocast: AutocastSpec | None = None
    backend: Any = None  # a backends.BackendPlan (names and op maps, no compiled objects), None: defaults
    seed: int | None = None  # the run's seed: each stage's generators are seeded from it and the stage index
    init: Any = None  # a weights.StageInit: the shards' tensors without values, or a resumed run's, made where they run
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class LossPlan:
    """What the last stage needs to compute the losses itself (only where stages share objects)."""

    labels: list[Any]
    criterion: Loss
    scaler: Any  # torch.amp.GradScaler or None
    optimizer: Any
    device: Any  # torch.device the loss is computed on (the coordinator's)
    head: Any  # the loss module's model: hands the output to the criterion as received
    after_all_forwards: bool = False  # the schedule computes every loss after the last forward (gpipe)


@dataclass
class StepPlan:
    """One step for one rank: train or eval, and the rank's actions in order."""

    mode: str
    actions: list[Action]
    trace: bool = True
    dataflow: bool = False  # run whichever action is ready instead of the list's order
    update_every: int = 0  # ASYNC: backwards per optimizer step of a stage (the microbatches of a batch)
    optimizer: Any = None  # ASYNC: params -> torch.optim.Optimizer, one per stage
    shared: Any = None  # ASYNC: the run's engine.shared_weights.SharedWeights, one object for every rank
    loss: LossPlan | None = None  # the rank of the last stage computes the losses (see LossPlan)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its actions as one bytes object (`schedule.action.pack_actions`)."""
        return {**self.__dict__, "actions": pack_actions(self.actions)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "actions": unpack_actions(state["actions"])})
