"""Running a Lightning step once per microbatch around the pipeline (the strategy's step machinery).

`PipeStrategy` mixes this in: ``training_step`` and the evaluation steps call `_run`, which runs the
user's step of every microbatch in a `Driver` up to the pipelined call, feeds the pipeline as those
calls arrive, and resumes each step with its microbatch's output (training: as that microbatch's
loss, computed on the last stage where it shares this process).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_pipe.backends import CoordinatorOps
from lightning_pipe.engine import StepResult
from lightning_pipe.errors import ConfigurationError, PipeError
from lightning_pipe.grads import GradStash
from lightning_pipe.loss import Loss, WeightedLoss
from lightning_pipe.microbatch import batch_size, split
from lightning_pipe.microbatch_weights import MicrobatchWeight, shares
from lightning_pipe.partition import Partitioner
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.partition.tracer import CallArgs
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.strategy.asynchronous import AsyncTraining
from lightning_pipe.strategy.outputs import combine_eval, combine_predict, combine_training
from lightning_pipe.strategy.patch import Patches, patch
from lightning_pipe.strategy.session import Driver, DriverThreads, LogRecorder, MissingCall, StepInputs, current_driver


class PipelinedSteps:
    """The step machinery of `PipeStrategy` (a mixin: it uses the strategy's state declared below)."""

    microbatches: int
    microbatch_weight: MicrobatchWeight | None
    timeout: float
    partitioner: Partitioner
    pipeline: Pipeline | None
    precision_plugin: Any
    last_step: Any
    _async: AsyncTraining | None
    _outside: GradStash
    _coordinator_ops: CoordinatorOps | None
    _seen_batch: bool
    _trainer: Any
    driver_threads: DriverThreads  # the threads of the microbatches' steps, kept between steps

    if TYPE_CHECKING:

        @property
        def lightning_module(self) -> pl.LightningModule | None: ...

        def _build(self, sample: Any) -> Pipeline: ...

        def step_random(
            self, context: Callable[[], AbstractContextManager[Any]], name: str, args: tuple[Any, ...], index: int
        ) -> Callable[[], AbstractContextManager[Any]]: ...

    def _capture_input(self, lightning_module: pl.LightningModule, pipelined: nn.Module, batch: Any) -> Any:
        """Run ``training_step`` on ``batch`` until it calls the pipelined module; return that input."""

        def capture(*args: Any, **kwargs: Any) -> Any:
            driver = current_driver()
            assert driver is not None
            return driver.call(args, kwargs)

        step = _bind(lightning_module.training_step, batch, (0,), {})
        driver = Driver(step, 0, contextlib.nullcontext, self.timeout)  # once per build: a thread of its own
        patches = Patches()
        patches.set(pipelined, "forward", capture)
        patches.set(lightning_module, "log", lambda *args, **kwargs: None)
        try:
            kind, value = driver.start()
        finally:
            driver.abandon()
            patches.restore()
        if kind == "return":
            raise MissingCall("training_step returned without calling the pipelined module; nothing to plan")
        return self._pipeline_input(*value)

    def _microbatches_for(self, batch: Any) -> int:
        rows = batch_size(batch)
        if rows >= self.microbatches:
            self._seen_batch = True
            return self.microbatches
        if not self._seen_batch:
            raise ConfigurationError(
                f"PipeStrategy(microbatches={self.microbatches}) is larger than the batch ({rows} rows); "
                f"use microbatches <= {rows} or a larger batch_size"
            )
        rank_zero_warn(
            f"a batch of {rows} rows is smaller than microbatches={self.microbatches}; "
            f"it runs as {rows} microbatches of one row",
        )
        return rows

    def _run(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: Callable[[], AbstractContextManager[Any]],
    ) -> Any:
        lightning_module = self.lightning_module
        assert lightning_module is not None
        training = name == "training_step"
        if not training:
            self._end_stream()
        batch, rest = args[0], args[1:]
        pieces = split(batch, self._microbatches_for(batch))
        weights = self._weights(pieces, name)
        step_fn = getattr(lightning_module, name)
        recorder = LogRecorder(lightning_module.log, weights)
        context = _with_ops(context, self._coordinator_ops, "train" if training else "eval")
        turn = threading.Lock()  # one driver at a time runs the user's step
        drivers = [
            Driver(
                _bind(step_fn, p, rest, kwargs),
                i,
                self.step_random(context, name, args, i),
                self.timeout,
                turn,
                self.driver_threads,
            )
            for i, p in enumerate(pieces)
        ]
        restore_log = patch(lightning_module, "log", recorder)
        try:
            first = self._start(drivers[0], name)
            pipeline = self._build(first)
            inputs: Sequence[Any] = StepInputs(
                len(drivers), lambda i: _packed(pipeline, self._start(drivers[i], name)), [_packed(pipeline, first)]
            )
            if training and self._async is not None:
                inputs = list(inputs)
                self._outside.begin()
                try:
                    result = self._feed_async(pipeline, inputs, drivers, weights)
                finally:
                    self._outside.end()
            elif training:
                pipeline.before_train_step(len(drivers), rank_zero_info)  # checkpoint="auto": logged once per fit
                self._outside.begin()
                try:
                    result = pipeline.coordinator.train_step(
                        inputs,
                        list(zip(weights, range(len(drivers)), strict=True)),
                        self._criterion(drivers, name),
                        getattr(self.precision_plugin, "scaler", None),
                    )
                finally:
                    self._outside.end()
            else:
                result = pipeline.coordinator.forward_step(inputs)
                for driver, output in zip(drivers, result.outputs, strict=True):
                    self._resume(driver, pipeline.unpack(output), name)
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

    def _weights(self, pieces: Sequence[Any], name: str) -> list[float]:
        """Each microbatch's share of the step's loss and logged values (``microbatch_weight``, or rows)."""
        weigh = self.microbatch_weight if name != "predict_step" else None  # predictions are not averaged
        return shares(pieces, weigh, "PipeStrategy(microbatch_weight=...)")

    def _feed_async(
        self, pipeline: Pipeline, inputs: list[Any], drivers: list[Driver], weights: list[float]
    ) -> StepResult:
        """Feed this batch into the asynchronous stream; drain it after the stream's last planned batch."""
        assert self._async is not None
        stream = self._async.open(pipeline, self._trainer, len(inputs))
        self._async.sync_hparams()
        criterion = self._criterion(drivers, "training_step")
        losses = stream.feed(inputs, list(zip(weights, range(len(drivers)), strict=True)), criterion)
        if stream.complete:
            self._end_stream()
        return StepResult(losses=losses, schedule=stream.schedule)

    def _end_stream(self) -> None:
        """The flush of schedule="async": every fed batch's backwards and stage updates have landed."""
        if self._async is not None:
            self._async.end(self.pipeline)

    def _start(self, driver: Driver, name: str) -> Any:
        kind, value = driver.start()
        if kind == "return":
            raise MissingCall(
                f"{name} of microbatch {driver.index} returned without calling the pipelined module; "
                "PipeStrategy needs exactly one call of it per step"
            )
        call_args, call_kwargs = value
        return self._pipeline_input(call_args, call_kwargs)

    def _pipeline_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if isinstance(self.partitioner, TracedPartitioner):
            return CallArgs(tuple(args), dict(kwargs))  # packed into the first stage's inputs once traced
        if kwargs:
            raise ConfigurationError(
                f"the pipelined nn.Sequential was called with keyword arguments ({', '.join(kwargs)}); "
                "an nn.Sequential takes one input"
            )
        return args[0] if len(args) == 1 else tuple(args)

    def _resume(self, driver: Driver, output: Any, name: str) -> Any:
        kind, value = driver.resume(output)
        if kind == "call":
            raise PipeError(
                f"{name} of microbatch {driver.index} called the pipelined module a second time; "
                "PipeStrategy pipelines exactly one call per step"
            )
        return value

    def _criterion(self, drivers: list[Driver], name: str) -> WeightedLoss:
        """The `Loss` of a step: the rest of microbatch ``i``'s step is its loss, weighted by the label's weight."""
        assert self.pipeline is not None
        return WeightedLoss(_StepLoss(self, drivers, name), self.pipeline.unpack)

    def _pipelined_forward(self, *args: Any, **kwargs: Any) -> Any:
        driver = current_driver()
        if driver is not None:
            return driver.call(args, kwargs)
        # called outside a step (a callback, an epoch-end hook): run it through the pipeline, forward only
        self._end_stream()
        inputs = self._pipeline_input(args, kwargs)
        pipeline = self._build(inputs)
        return pipeline.unpack(pipeline.coordinator.forward_step([_packed(pipeline, inputs)]).outputs[0])


class _StepLoss(Loss):
    """``compute_loss(output, i)`` resumes microbatch ``i``'s step with its output; the step returns the loss."""

    def __init__(self, steps: PipelinedSteps, drivers: list[Driver], name: str) -> None:
        super().__init__()
        self.steps, self.drivers, self.name = steps, drivers, name

    @override
    def compute_loss(self, output: Any, target: int) -> Any:
        result = self.steps._resume(self.drivers[target], output, self.name)
        loss = result.get("loss") if isinstance(result, dict) else result
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise PipeError(f"{self.name} must return a loss tensor, a dict with 'loss', or None; got {type(loss)}")
        return loss


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
