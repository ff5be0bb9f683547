"""``PipeStrategy(schedule="async")``: a Trainer feeding an asynchronous stream, one batch per training step.

Each ``training_step`` feeds its batch's microbatches into a `BatchStream` (no flush between batches)
and returns once that batch's losses are computed; the stages update their own weights (PipeDream-2BW
weight stashing, `lightning_pipe.engine.versions`) with per-stage optimizers built like the
``configure_optimizers`` optimizer (same class, hyperparameters per parameter group). A stream covers the
batches up to the next point where Lightning looks at the weights (the end of the epoch, the next
validation, the next step a ``ModelCheckpoint(every_n_train_steps=N)`` saves at, ``max_steps``); its last batch
drains it, so validation, checkpoints and the end of fit see every update. Lightning's optimizer keeps stepping
the parameters outside the pipelined module; in its parameter groups the stage parameters are replaced by
placeholders that never get a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.engine import StepResult
from lightning_pipe.engine.loss import WeightedLoss
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.engine.stream import BatchStream
from lightning_pipe.engine.versions import Staleness
from lightning_pipe.strategy.training import Training

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_pipe.pipeline.pipeline import Pipeline
    from lightning_pipe.strategy.optimization import StageOptimization


class AsyncTraining(Training):
    """The stage optimizers, the open stream and the staleness measured over a fit."""

    def __init__(self) -> None:
        self.template: torch.optim.Optimizer | None = None
        self._groups: list[set[int]] = []  # per template group: ids of the stage parameters it held
        self.stage_optimizers: list[tuple[torch.optim.Optimizer, list[int]]] = []  # (optimizer, template groups)
        #: the template's hyperparameters when each batch was fed: a stage's update n uses entry n
        self.fed_hparams: list[list[dict[str, Any]]] = []
        self._updates: dict[int, int] = {}  # id(stage optimizer) -> its updates so far
        self._first_update = 0  # the fed batch whose hyperparameters the first update of a new stage optimizer uses
        self._index: dict[int, int] = {}  # id(stage parameter) -> its index in the template's state_dict
        self._loaded: dict[int, Any] = {}  # state of a checkpoint for stage optimizers not built yet, by index
        self.stream: BatchStream | None = None
        self.totals: dict[int, Staleness] = {}
        self._factory = self.factory  # one object: the stages keep their optimizers while it stays the same

    @property
    @override
    def streaming(self) -> bool:
        """Whether a stream is open: it owns the stages (their weights and generators) until it drains."""
        return self.stream is not None and not self.stream.closed

    @property
    @override
    def owns_stages(self) -> bool:
        return self.stream is not None

    @override
    def attach(
        self, optimizers: list[torch.optim.Optimizer], stage_params: list[nn.Parameter], accumulate: int, scaler: Any
    ) -> None:
        """Take the hyperparameters from ``optimizers`` and hide the stage parameters from them."""
        if accumulate != 1 or scaler:
            raise ConfigurationError(
                "PipeStrategy(schedule='async') steps each stage once per batch in full precision; "
                "use accumulate_grad_batches=1 and no gradient scaler"
            )
        ids = {id(p) for p in stage_params}
        holders = [o for o in optimizers if any(id(p) in ids for g in o.param_groups for p in g["params"])]
        if len(holders) > 1:
            raise ConfigurationError(
                "PipeStrategy(schedule='async') builds each stage's optimizer from one configure_optimizers "
                f"optimizer, but {len(holders)} optimizers hold parameters of the pipelined module"
            )
        if not holders:
            return
        self.template = holders[0]
        self.stage_optimizers, self.fed_hparams, self._updates, self._first_update = [], [], {}, 0
        self._groups, self._index, self._loaded = [], {}, {}
        index = 0
        for group in self.template.param_groups:
            self._groups.append({id(p) for p in group["params"] if id(p) in ids})
            for p in group["params"]:
                if id(p) in ids:
                    self._index[id(p)] = index
                index += 1
            # a placeholder never gets a gradient, so Lightning's optimizer skips it; the layout stays the same
            group["params"] = [
                nn.Parameter(torch.empty(0, device=p.device, dtype=p.dtype)) if id(p) in ids else p
                for p in group["params"]
            ]

    @override
    def microbatches(self, pipeline: Pipeline, given: int | str, rows: int) -> int | None:
        return None  # the given count: a stream's batches are planned before it opens

    @override
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
        """Feed this batch into the stream (the whole batch at once); drain it after its last planned batch. Every
        step is a window of its own (``accumulate_grad_batches=1``): the stages stepped, nothing to drop."""
        inputs = list(inputs)
        with optimization.set_aside():
            stream = self.open(pipeline, trainer, len(inputs))
            self.sync_hparams()
            losses = stream.feed(inputs, labels, criterion)
            if stream.complete:
                self.end(pipeline)
        return StepResult(losses=losses, schedule=stream.schedule)

    @override
    def apply_grads(self, pipeline: Pipeline, scale: float) -> None:
        """Nothing: the stages stepped their own optimizers."""

    @override
    def holds(self, optimizer: Any) -> bool:
        """The ``configure_optimizers`` optimizer the stage optimizers are built like holds their state."""
        return self.template is not None and getattr(optimizer, "_optimizer", optimizer) is self.template

    def factory(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """One stage's optimizer: the template's class, one group per template group holding its parameters."""
        assert self.template is not None
        groups, used = [], []
        for index, (group, ids) in enumerate(zip(self.template.param_groups, self._groups, strict=True)):
            mine = [p for p in params if id(p) in ids]
            if mine:
                groups.append({**_hparams(group), "params": mine})
                used.append(index)
        optimizer = type(self.template)(groups, **self.template.defaults)
        for p in params:  # a checkpoint's state (momentum, Adam's moments) for these parameters
            saved = self._loaded.pop(self._index.get(id(p), -1), None)
            if saved is not None:
                optimizer.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
        self.stage_optimizers.append((optimizer, used))
        # built at the stage's first backward of a fit, before its first update (of the stream's first batch)
        self._updates[id(optimizer)] = self._first_update

        def batch_hparams(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            # runs in the stage's thread, when it steps for the next batch: that batch's hyperparameters
            n = self._updates[id(opt)]
            self._updates[id(opt)] = n + 1
            if self.fed_hparams:
                values = self.fed_hparams[min(n, len(self.fed_hparams) - 1)]
                for group, index in zip(opt.param_groups, used, strict=True):
                    group.update(values[index])

        optimizer.register_step_pre_hook(batch_hparams)
        return optimizer

    @override
    def state_dict(self) -> dict[str, Any]:
        """The template's state_dict with the stage optimizers' state at the stage parameters' indices."""
        assert self.template is not None
        state = self.template.state_dict()
        state["state"].update(self._loaded)
        for optimizer, _ in self.stage_optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p in optimizer.state and id(p) in self._index:
                        state["state"][self._index[id(p)]] = optimizer.state[p]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The template's part now; the stages' part when their optimizers are built (the next stream)."""
        assert self.template is not None
        stage = set(self._index.values())
        saved = state_dict["state"]
        self._loaded = {i: v for i, v in saved.items() if i in stage}
        rest = {i: v for i, v in saved.items() if i not in stage}
        self.template.load_state_dict({"state": rest, "param_groups": state_dict["param_groups"]})

    def sync_hparams(self) -> None:
        """Note the template's hyperparameters (an LR scheduler's lr) for the batch about to be fed: each
        stage's update of that batch uses them, however late it runs."""
        if self.template is not None:
            self.fed_hparams.append([_hparams(group) for group in self.template.param_groups])

    def open(self, pipeline: Pipeline, trainer: pl.Trainer, per_batch: int) -> BatchStream:
        """The open stream, or a new one running to the next point where Lightning looks at the weights."""
        if self.stream is None or self.stream.closed:
            if self.template is None:
                raise ConfigurationError("PipeStrategy(schedule='async') needs an optimizer over the pipelined module")
            self.stream = BatchStream(pipeline.coordinator, segment(trainer), per_batch, self._factory)
        return self.stream

    @override
    def end(self, pipeline: Pipeline | None) -> None:
        """Drain the stream (complete) or stop it (a fit stopped early: its unfinished updates are lost)."""
        stream, self.stream = self.stream, None
        if stream is None or stream.closed:
            return
        if stream.complete:
            stream.finish()
            if pipeline is not None:
                self.record(pipeline)
            return
        rank_zero_warn(
            f"PipeStrategy(schedule='async'): training stopped after {stream.fed} of the {stream.num_batches} "
            "batches planned for the stream; the stage updates of batches still in flight are dropped"
        )
        stream.abort()
        self._first_update = len(self.fed_hparams)
        for key in self._updates:  # the dropped updates: the next batch's update uses the next batch's values
            self._updates[key] = len(self.fed_hparams)

    @override
    def abort(self) -> None:
        """After an error: stop the open stream without draining it (its stages may be gone)."""
        if self.stream is not None:
            self.stream.abort()
            self.stream = None

    def record(self, pipeline: Pipeline) -> None:
        for stats in pipeline.coordinator.stages.call(StageProtocol.async_stats):
            for s in stats:
                total = self.totals.setdefault(s.stage, Staleness(s.stage))
                for f in fields(Staleness):
                    if f.name in ("stage",):
                        continue
                    old, new = getattr(total, f.name), getattr(s, f.name)
                    combined = max(old, new) if f.name in ("max", "max_live_versions") else old + new
                    setattr(total, f.name, combined)

    @override
    def staleness(self, schedule: Any = "async") -> list[Staleness]:
        return [self.totals[s] for s in sorted(self.totals)]


def training_for(streams: bool) -> Training:
    """The step driver's variant, chosen once: a stream for ``schedule="async"`` (``streams``), else a flush after
    each batch."""
    return AsyncTraining() if streams else Training()


def segment(trainer: pl.Trainer) -> int:
    """Batches from the current one up to the end of the epoch, the next validation, the next checkpoint a
    ``ModelCheckpoint(every_n_train_steps=N)`` writes, or ``max_steps``. A checkpoint thus holds every update of the
    batches before it (no weight version in flight) and the stages' generator states: a run resumed from it goes on
    as the uninterrupted run does, whose stream also ends there."""
    loop = trainer.fit_loop.epoch_loop
    index = loop.batch_idx
    bounds: list[float] = [float(trainer.num_training_batches) - index]
    check = trainer.val_check_batch
    if trainer.enable_validation and isinstance(check, int) and check > 0:
        bounds.append(check - index % check)
    for callback in trainer.checkpoint_callbacks:
        every = getattr(callback, "_every_n_train_steps", 0)
        if isinstance(every, int) and every > 0:
            bounds.append(every - trainer.global_step % every)
    if trainer.max_steps is not None and trainer.max_steps > 0:
        bounds.append(trainer.max_steps - trainer.global_step)
    count = min(bounds)
    if not math.isfinite(count) or count < 1:
        raise ConfigurationError(
            "PipeStrategy(schedule='async') plans each stream up to the end of the epoch, the next validation or "
            "max_steps; give the train dataloader a length, val_check_interval=<batches> or max_steps"
        )
    return int(count)


def _hparams(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
