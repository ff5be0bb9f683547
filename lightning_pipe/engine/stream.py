"""Asynchronous runs (``schedule="async"``): a stream of batches as one task graph, without a flush between them.

`train_stream` pulls batches from an iterator and feeds a window of microbatches ahead of the losses it
computes, so the next batch is pulled before the current batch's losses are known. A caller that produces
batch ``b + 1`` only after batch ``b``'s losses (Lightning's loop: ``training_step`` returns a loss before
the next batch is fetched) would block there. `BatchStream` runs the same task graph
(``schedule.stream(num_batches)``, no flush between batches) but is fed explicitly: `feed` sends one
batch's microbatches, computes their losses, sends their output gradients to the last stage and returns;
the batch's backwards and the stages' updates may still be running. `finish` waits until every rank is
done (the flush). A microbatch's output only depends on forwards and backwards of earlier microbatches
in the 1F1B order over the stream, so `feed` never waits for a batch that was not fed yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.base import tree
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.comm.base import Message, MessageKind
from lightning_pipe.engine.coordinator import Coordinator
from lightning_pipe.engine.loss import Criterion, Loss, as_loss
from lightning_pipe.engine.messages import ASYNC
from lightning_pipe.engine.step_result import StepResult
from lightning_pipe.engine.versions import Staleness
from lightning_pipe.schedule import Schedule

OptimizerFactory = Callable[[list[nn.Parameter]], Any]


def stream_schedule(coordinator: Coordinator, per_batch: int, what: str) -> Schedule:
    """The coordinator's schedule for batches of ``per_batch`` microbatches, which must stream (``"async"``)."""
    schedule = coordinator.schedule(per_batch)
    if not schedule.asynchronous:
        raise ConfigurationError(f"{what} needs an asynchronous schedule such as 'async', not {schedule.name!r}")
    return schedule


def train_stream(
    coordinator: Coordinator,
    batches: Iterable[tuple[Sequence[Any], Sequence[Any]]],
    num_batches: int,
    criterion: Loss | Criterion,
    optimizer: OptimizerFactory,
    window: int | None = None,
) -> StepResult:
    """An asynchronous run: ``num_batches`` batches (each a list of microbatch inputs and one of
    labels) as one task graph without a flush; each stage steps ``optimizer(its parameters)``
    after every batch's worth of its backwards. Losses are returned per microbatch, in order.

    At most ``window`` microbatches (default: stages + microbatches per batch) are fed ahead of
    the last output received, so a long stream never sits in the first stage's inbox.
    """
    criterion = as_loss(criterion)
    stream = iter(batches)
    first_inputs, first_labels = next(stream, ([], []))
    if not first_inputs or num_batches < 1:
        raise ConfigurationError("train_stream needs at least one batch")
    per_batch = len(first_inputs)
    schedule = stream_schedule(coordinator, per_batch, "train_stream")
    total = per_batch * num_batches
    window = window or coordinator.num_stages + per_batch
    step = coordinator.begin(ASYNC, schedule.stream(num_batches), update_every=per_batch, optimizer=optimizer)
    labels: dict[int, Any] = {}
    queued = list(zip(first_inputs, first_labels, strict=True))
    fed, losses = 0, []
    try:
        for m in range(total):
            while fed < min(m + window, total):
                if not queued:
                    inputs, targets = next(stream)
                    if len(inputs) != per_batch:
                        raise ConfigurationError(
                            f"batch {fed // per_batch} has {len(inputs)} microbatches, the first had {per_batch}"
                        )
                    queued = list(zip(inputs, targets, strict=True))
                x, labels[fed] = queued.pop(0)
                _send_input(coordinator, step, fed, x)
                fed += 1
            losses.append(coordinator.loss_of(step, m, labels.pop(m), criterion)[1])
        records, parts = coordinator.finish(step)
    except StopIteration:
        coordinator.abort(step)
        raise ConfigurationError(f"the batches ran out before num_batches={num_batches}") from None
    except BaseException:
        coordinator.abort(step)
        raise
    coordinator.last_result = StepResult(losses=losses, records=records, schedule=schedule, parts=parts)
    return coordinator.last_result


@dataclass
class AsyncRun:
    """What `Pipeline.train_async` returns: per-batch losses and each stage's measured staleness."""

    losses: list[torch.Tensor]
    staleness: list[Staleness]
    step: StepResult

    @property
    def max_staleness(self) -> int:
        return max(s.max for s in self.staleness)


class BatchStream:
    """``num_batches`` batches of ``per_batch`` microbatches each, fed one batch per `feed` call."""

    def __init__(
        self,
        coordinator: Coordinator,
        num_batches: int,
        per_batch: int,
        optimizer: OptimizerFactory,
    ) -> None:
        if num_batches < 1 or per_batch < 1:
            raise ConfigurationError(f"a stream needs batches and microbatches, got {num_batches} x {per_batch}")
        self.coordinator = coordinator
        self.num_batches = num_batches
        self.per_batch = per_batch
        self.schedule = stream_schedule(coordinator, per_batch, "a batch stream")
        self.fed = 0  # batches fed so far
        self.losses: list[Any] = []
        self.step = coordinator.begin(
            ASYNC, self.schedule.stream(num_batches), update_every=per_batch, optimizer=optimizer
        )
        self.closed = False

    @property
    def complete(self) -> bool:
        """Every planned batch was fed."""
        return self.fed == self.num_batches

    def feed(self, inputs: Sequence[Any], labels: Sequence[Any], criterion: Loss | Criterion) -> list[Any]:
        """Send one batch's microbatches and return their losses, ``criterion.compute_loss(output, label)`` each."""
        criterion = as_loss(criterion)
        c = self.coordinator
        if self.closed or self.complete:
            raise ConfigurationError(f"the stream of {self.num_batches} batches is closed or was fully fed")
        if len(inputs) != self.per_batch or len(labels) != self.per_batch:
            raise ConfigurationError(
                f"batch {self.fed} has {len(inputs)} microbatches; this stream runs {self.per_batch} per batch"
            )
        first = self.fed * self.per_batch
        try:
            for i, x in enumerate(inputs):
                _send_input(c, self.step, first + i, x)
            losses = [c.loss_of(self.step, first + i, label, criterion)[1] for i, label in enumerate(labels)]
        except BaseException:
            self.abort()
            raise
        self.fed += 1
        self.losses.extend(losses)
        return losses

    def finish(self) -> StepResult:
        """The flush: wait until every backward and every stage's update of the fed batches has landed."""
        if not self.complete:
            raise ConfigurationError(f"the stream was planned for {self.num_batches} batches, {self.fed} were fed")
        try:
            records, parts = self.coordinator.finish(self.step)
        except BaseException:
            self.abort()
            raise
        self.closed = True
        result = StepResult(losses=self.losses, records=records, schedule=self.schedule, parts=parts)
        self.coordinator.last_result = result
        return result

    def abort(self) -> None:
        """Stop the stream on every rank; updates of batches whose backwards had not finished are lost."""
        if not self.closed:
            self.closed = True
            self.coordinator.abort(self.step)


def _send_input(coordinator: Coordinator, step: int, m: int, x: Any) -> None:
    """Microbatch ``m``'s input to the first stage (a stream's inputs need no gradient)."""
    payload = (tree.detach(x), [False] * len(tree.flatten(x)[0]))
    coordinator.endpoint.send(coordinator.rank_of_stage[0], Message(MessageKind.ACTIVATION, step, 0, m, payload))
