"""`StepDriver`: running a Lightning step once per microbatch around the pipeline.

``training_step`` and the evaluation steps of `PipeStrategy` call `StepDriver.run`, which runs the user's
step of every microbatch in a `Driver` up to the pipelined call, feeds the pipeline as those calls arrive,
and resumes each step with its microbatch's output (training: as that microbatch's loss, computed on the
last stage where it shares this process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_pipe.backends import CoordinatorOps
from lightning_pipe.base.errors import ConfigurationError, PipeError
from lightning_pipe.base.microbatch_weights import Microbatches
from lightning_pipe.engine.loss import Loss, WeightedLoss
from lightning_pipe.partition.tracer import CallArgs
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.pipeline.schedule_chooser import AUTO, first_microbatches
from lightning_pipe.strategy.building import PipelineBuilder
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.outputs import combine_eval, combine_predict, combine_training
from lightning_pipe.strategy.patch import patch
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.random_state import RandomStreams
from lightning_pipe.strategy.session import Driver, DriverThreads, LogRecorder, MissingCall, StepInputs, current_driver
from lightning_pipe.strategy.training import Training


@dataclass(frozen=True)
class StepSetting:
    """What a fit's steps run with, as the strategy knows it at setup."""

    lightning_module: pl.LightningModule
    trainer: pl.Trainer
    device: torch.device  # the coordinator's: the step code's generators draw there
    scaler: Any  # the precision plugin's GradScaler, or None


class StepDriver:
    """Cuts each batch into microbatches and runs the user's step once per microbatch around the pipeline.

    Owns the microbatch count and weights, the threads of the microbatches' steps and the last step's
    result. `PipeStrategy` calls `setup`, `run` from its step hooks and `close` at teardown; the pipelined
    module's ``forward`` is `forward` while the strategy runs.
    """

    def __init__(
        self,
        config: PipeConfig,
        builder: PipelineBuilder,
        optimization: StageOptimization,
        random: RandomStreams,
        training: Training,
    ) -> None:
        self.microbatches = config.microbatches
        self.microbatch_weight = config.microbatch_weight
        self.timeout = config.timeout
        self.builder = builder  # builds the pipeline on the first step, turns calls into its inputs
        self.optimization = optimization  # the outside parameters' gradients wait there during a step
        self.random = random  # each microbatch's step code draws from its own generator
        #: how a training step's updates land: after each batch (`Training`), or in a stream (schedule="async")
        self.training = training
        self.threads = DriverThreads()  # the threads of the microbatches' steps, kept between steps
        #: the last step's `StepResult` (per-rank action timings, the schedule), kept after teardown
        self.last_step: Any = None
        self._setting: StepSetting | None = None
        self._seen_batch = False

    def setup(self, setting: StepSetting) -> None:
        """At the strategy's setup: the LightningModule, Trainer, device and scaler of this fit's steps."""
        self._setting = setting

    def close(self) -> None:
        """At teardown: the step threads end; the next fit checks its first batch's size again."""
        self.threads.close()
        self._seen_batch = False

    def end_stream(self) -> None:
        """The flush of schedule="async": every fed batch's backwards and stage updates have landed."""
        self.training.end(self.builder.pipeline)

    def run(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: Callable[[], AbstractContextManager[Any]],
    ) -> Any:
        """Lightning's ``name`` (``"training_step"``, ...) of the batch ``args[0]``, microbatch by microbatch.

        ``context`` (the precision plugin's step context) is held here around every microbatch's thread, each of
        which enters it again for its thread-local state (autocast): what it sets process-wide (a ``"*-true"``
        precision's default dtype) would otherwise be restored by overlapping threads in any order, and leak."""
        with context():
            setting = self._setting
            assert setting is not None, "StepDriver.setup comes first"
            lightning_module = setting.lightning_module
            training = name == "training_step"
            if not training:
                self.end_stream()
            cut = self._cut(args[0], name)
            weights = cut.shares
            step_fn = getattr(lightning_module, name)
            recorder = LogRecorder(lightning_module.log, weights)
            context = _with_ops(context, self.builder.coordinator_ops, "train" if training else "eval")
            turn = threading.Lock()  # one driver at a time runs the user's step
            drivers = [
                Driver(
                    _bind(step_fn, p, args[1:], kwargs),
                    i,
                    self.random.step_context(context, setting.trainer, setting.device, name, args, i),
                    self.timeout,
                    turn,
                    self.threads,
                )
                for i, p in enumerate(cut.pieces)
            ]
            restore_log = patch(lightning_module, "log", recorder)
            try:
                first = self._start(drivers[0], name)
                pipeline = self.builder.build(first)
                inputs: Sequence[Any] = StepInputs(
                    len(drivers), lambda i: _packed(pipeline, self._start(drivers[i], name)), [_packed(pipeline, first)]
                )
                if training:
                    trainer = setting.trainer
                    result = self.training.step(
                        pipeline,
                        inputs,
                        list(zip(weights, range(len(drivers)), strict=True)),
                        self._criterion(pipeline, drivers, name),
                        trainer,
                        setting.scaler,
                        self.optimization,
                        _starts_window(args, trainer.accumulate_grad_batches),
                    )
                else:
                    result = pipeline.coordinator.forward_step(inputs)
                    for driver, output in zip(drivers, result.outputs, strict=True):
                        self.resume(driver, pipeline.unpack(output), name)
            finally:
                restore_log()
                for driver in drivers:
                    driver.abandon()
            recorder.flush()
            self.last_step = result
            outputs = [driver.result for driver in drivers]
            if training:
                return combine_training(outputs, result.losses, weights)
            if name == "predict_step":
                return combine_predict(outputs)
            return combine_eval(outputs, weights)

    def runtime_hook(self, name: str, *args: Any) -> None:
        """Call ``runtime.<name>`` on every stage (skipped when no stage's runtime overrides it, and while a stream
        owns the stages, until it drains)."""
        if not self.training.owns_stages:
            self.builder.runtime_hook(name, args)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The pipelined module's ``forward`` while the strategy runs: a step's call goes to its driver."""
        driver = current_driver()
        if driver is not None:
            return driver.call(args, kwargs)
        # called outside a step (a callback, an epoch-end hook): run it through the pipeline, forward only
        self.end_stream()
        inputs = self.builder.pipeline_input(args, kwargs)
        pipeline = self.builder.build(inputs)
        return pipeline.unpack(pipeline.coordinator.forward_step([_packed(pipeline, inputs)]).outputs[0])

    def resume(self, driver: Driver, output: Any, name: str) -> Any:
        """Hand ``output`` to the step of ``driver``, which runs to its end; its result."""
        kind, value = driver.resume(output)
        if kind == "call":
            raise PipeError(
                f"{name} of microbatch {driver.index} called the pipelined module a second time; "
                "PipeStrategy pipelines exactly one call per step"
            )
        return value

    def _cut(self, batch: Any, name: str) -> Microbatches:
        """``batch`` cut into this step's microbatches, each with its share of the step's loss and logged values
        (``microbatch_weight``, or rows; predictions are not averaged: rows)."""
        training = name == "training_step"
        weigh = self.microbatch_weight if name != "predict_step" else None
        argument = "PipeStrategy(microbatch_weight=...)"
        return Microbatches.of(batch, lambda rows: self._microbatches_for(rows, training), weigh, argument)

    def _microbatches_for(self, rows: int, training: bool) -> int:
        wanted = self._wanted(rows, training)
        if rows >= wanted:
            self._seen_batch = True
            return wanted
        if not self._seen_batch:
            raise ConfigurationError(
                f"PipeStrategy(microbatches={wanted}) is larger than the batch ({rows} rows); "
                f"use microbatches <= {rows} or a larger batch_size"
            )
        rank_zero_warn(
            f"a batch of {rows} rows is smaller than microbatches={wanted}; it runs as {rows} microbatches of one row",
        )
        return rows

    def _wanted(self, rows: int, training: bool) -> int:
        """This step's microbatch count: the given one, or ``schedule="auto"``'s (chosen before the second
        training step, logged: `PipelineChoices.microbatches`)."""
        pipeline, given = self.builder.pipeline, self.microbatches
        resumed = self.builder.selection.resumed  # schedule="auto"'s choice, from the checkpoint
        if given == AUTO and resumed is not None:
            given = min(int(resumed["microbatches"]), rows)
        if training and pipeline is not None:
            chosen = self.training.microbatches(pipeline, given, rows)
            if chosen is not None:
                return chosen
        if given != AUTO:
            return int(given)
        chooser = pipeline.choices.schedule if pipeline is not None else None
        if chooser is not None and chooser.choice is not None:
            return chooser.choice.chosen.microbatches
        return first_microbatches(rows, self.builder.ranks)

    def _start(self, driver: Driver, name: str) -> Any:
        kind, value = driver.start()
        if kind == "return":
            raise MissingCall(
                f"{name} of microbatch {driver.index} returned without calling the pipelined module; "
                "PipeStrategy needs exactly one call of it per step"
            )
        call_args, call_kwargs = value
        return self.builder.pipeline_input(call_args, call_kwargs)

    def _criterion(self, pipeline: Pipeline, drivers: list[Driver], name: str) -> WeightedLoss:
        """The `Loss` of a step: the rest of microbatch ``i``'s step is its loss, weighted by the label's weight."""
        return WeightedLoss(_StepLoss(self, drivers, name), pipeline.unpack)


class _StepLoss(Loss):
    """``compute_loss(output, i)`` resumes microbatch ``i``'s step with its output; the step returns the loss."""

    def __init__(self, steps: StepDriver, drivers: list[Driver], name: str) -> None:
        super().__init__()
        self.steps, self.drivers, self.name = steps, drivers, name

    @override
    def compute_loss(self, output: Any, target: int) -> Any:
        result = self.steps.resume(self.drivers[target], output, self.name)
        loss = result.get("loss") if isinstance(result, dict) else result
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise PipeError(f"{self.name} must return a loss tensor, a dict with 'loss', or None; got {type(loss)}")
        return loss


def _starts_window(args: tuple[Any, ...], accumulate: int) -> bool:
    """Whether the training step of ``args`` (``batch, batch_idx, ...``) starts a gradient accumulation window."""
    batch_idx = args[1] if len(args) > 1 and isinstance(args[1], int) else None
    return batch_idx is not None and batch_idx % accumulate == 0


def _bind(step_fn: Callable[..., Any], piece: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
    """The user's step for one microbatch, as a call without arguments."""
    return lambda: step_fn(piece, *rest, **kwargs)


def _packed(pipeline: Pipeline, inputs: Any) -> Any:
    """The first stage's input: a traced module's call arguments packed into its flat inputs."""
    return pipeline.pack(inputs.args, inputs.kwargs) if isinstance(inputs, CallArgs) else inputs


def _with_ops(
    context: Callable[[], AbstractContextManager[Any]], ops: CoordinatorOps | None, mode: str
) -> Callable[[], AbstractContextManager[Any]]:
    """``context`` plus the backends' op substitution, entered in the thread that runs the step."""
    if ops is None:
        return context

    @contextmanager
    def both() -> Iterator[None]:
        with context(), ops.context(mode):
            yield

    return both
