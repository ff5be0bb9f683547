"""An asynchronous stream fed one batch at a time (``schedule="async"`` driven from outside, e.g. a Trainer).

`Coordinator.train_stream` pulls batches from an iterator and feeds a window of microbatches ahead of
the losses it computes, so the next batch is pulled before the current batch's losses are known. A
caller that produces batch ``b + 1`` only after batch ``b``'s losses (Lightning's loop: ``training_step``
returns a loss before the next batch is fetched) would block there. `BatchStream` runs the same task
graph (``schedule.stream(num_batches)``, no flush between batches) but is fed explicitly: `feed` sends one
batch's microbatches, computes their losses, sends their output gradients to the last stage and returns;
the batch's backwards and the stages' updates may still be running. `finish` waits until every rank is
done (the flush). A microbatch's output only depends on forwards and backwards of earlier microbatches
in the 1F1B order over the stream, so `feed` never waits for a batch that was not fed yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_pipe import tree
from lightning_pipe.comm.base import Message, MessageKind
from lightning_pipe.engine.plan import ASYNC
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.loss import Criterion, Loss, as_loss

if TYPE_CHECKING:
    from lightning_pipe.engine.coordinator import Coordinator, StepResult


class BatchStream:
    """``num_batches`` batches of ``per_batch`` microbatches each, fed one batch per `feed` call."""

    def __init__(
        self,
        coordinator: Coordinator,
        num_batches: int,
        per_batch: int,
        optimizer: Callable[[list[nn.Parameter]], Any],
    ) -> None:
        if num_batches < 1 or per_batch < 1:
            raise ConfigurationError(f"a stream needs batches and microbatches, got {num_batches} x {per_batch}")
        self.coordinator = coordinator
        self.num_batches = num_batches
        self.per_batch = per_batch
        self.schedule = coordinator.schedule(per_batch)
        if not self.schedule.asynchronous:
            raise ConfigurationError(
                f"a batch stream needs an asynchronous schedule such as 'async', not {self.schedule.name!r}"
            )
        self.fed = 0  # batches fed so far
        self.losses: list[Any] = []
        self.step = coordinator._begin(
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
                payload = (tree.detach(x), [False] * len(tree.flatten(x)[0]))
                c.endpoint.send(c.rank_of_stage[0], Message(MessageKind.ACTIVATION, self.step, 0, first + i, payload))
            losses = [c._loss_of(self.step, first + i, label, criterion)[1] for i, label in enumerate(labels)]
        except BaseException:
            self.abort()
            raise
        self.fed += 1
        self.losses.extend(losses)
        return losses

    def finish(self) -> StepResult:
        """The flush: wait until every backward and every stage's update of the fed batches has landed."""
        from lightning_pipe.engine.coordinator import StepResult

        if not self.complete:
            raise ConfigurationError(f"the stream was planned for {self.num_batches} batches, {self.fed} were fed")
        try:
            records, parts = self.coordinator._finish(self.step)
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
            self.coordinator._abort(self.step)
