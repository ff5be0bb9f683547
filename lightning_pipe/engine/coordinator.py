"""The `Coordinator`: feeds microbatches, computes losses, collects outputs and errors."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_pipe import tree
from lightning_pipe.comm.base import Communicator, Endpoint, Message, MessageKind
from lightning_pipe.engine.coordinator_messages import CoordinatorMessages, Key, LateRanks
from lightning_pipe.engine.plan import ASYNC, EVAL, TRAIN, LossPlan, StageSpec, StepPlan
from lightning_pipe.engine.runners import check_runner, worker_lists
from lightning_pipe.engine.shared_weights import SharedWeights
from lightning_pipe.engine.stage import StageWorker
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.executors import output_grads
from lightning_pipe.loss import Criterion, Loss, as_loss
from lightning_pipe.schedule import Schedule

Record = tuple[str, float, float]  # (action or "action part", start, end), time.perf_counter() seconds
F = TypeVar("F", bound=Callable[..., Any])


def _share_cores(method: F) -> F:
    """While a step runs, the coordinator's thread uses no more intra-op threads than a CPU stage does.

    The stages compute on all cores meanwhile; a larger pool for the loss would oversubscribe them.
    Between steps (the optimizer step, Lightning's hooks) the caller's own count applies again.
    """

    @functools.wraps(method)
    def wrapper(self: Coordinator, *args: Any, **kwargs: Any) -> Any:
        share = self.specs[0].options.get("num_threads")
        before = torch.get_num_threads()
        if not share or share >= before:
            return method(self, *args, **kwargs)
        torch.set_num_threads(share)
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return wrapper  # type: ignore[return-value]


class StepResult:
    """What a step returns: per-microbatch losses (train) or outputs (eval), and each rank's timeline.

    ``records`` and ``parts`` of a rank the train step did not wait for (`Coordinator.train_step`)
    are waited for when first read.
    """

    def __init__(
        self,
        losses: list[Any] | None = None,
        outputs: list[Any] | None = None,
        records: list[list[Record]] | None = None,
        schedule: Schedule | None = None,
        parts: list[list[Record]] | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self.losses = [] if losses is None else losses
        self.outputs = [] if outputs is None else outputs
        self.schedule = schedule
        self._records = [] if records is None else records
        #: per rank, the parts of each action ("1F0 idle", start, end): see `lightning_pipe.trace`
        self._parts = [] if parts is None else parts
        self._settle = settle

    @property
    def records(self) -> list[list[Record]]:
        """Per rank, its actions ("1F0", start, end)."""
        self._settled()
        return self._records

    @property
    def parts(self) -> list[list[Record]]:
        self._settled()
        return self._parts

    def _settled(self) -> None:
        if self._settle is not None:
            settle, self._settle = self._settle, None
            settle()


class Coordinator(CoordinatorMessages):
    """Drives the stage workers through a communicator, one step at a time.

    The coordinator holds no layers: it sends microbatch inputs to the first stage, receives the
    last stage's outputs, runs the loss (the `ForwardLossModule` of the last shard, with the
    identity as its model) and sends the gradients back.
    """

    def __init__(
        self,
        communicator: Communicator,
        specs: Sequence[StageSpec],
        schedule: Callable[[int, int, int], Schedule],
        timeout: float,
        device: torch.device | None = None,
        virtual_stages: int = 1,
        worker_cls: type = StageWorker,
        runner: str = "parallel",
    ) -> None:
        self.communicator = communicator
        self.specs = list(specs)
        self.schedule_factory = schedule
        self.timeout = timeout
        self.device = device or torch.device("cpu")
        self.virtual_stages = virtual_stages
        self.num_ranks = len(self.specs)
        self.num_stages = self.specs[0].num_stages
        self.rank_of_stage = self.specs[0].rank_of_stage
        self.runner = check_runner(runner)
        last = [shard for spec in self.specs for shard in spec.shards if shard.index == self.num_stages - 1][0]
        self.loss_module = last.forward_loss
        self._head = _Received()
        self._worker_cls = worker_cls
        self._endpoint: Endpoint | None = None
        self._step = 0
        self._pending: dict[Key, Message] = {}
        self._posted, self._raised_posts = False, 0
        self._late: dict[int, LateRanks] = {}
        self._schedules: dict[tuple[int, int], Schedule] = {}
        self.last_result: StepResult | None = None

    # lifetime
    def start(self) -> Coordinator:
        self._endpoint = self.communicator.launch(self.specs, self._worker_cls)
        return self

    def close(self) -> None:
        """Stop the stages; calls posted since the last `call` are not waited for (see `post`)."""
        self._posted = False
        self._late.clear()
        if self._endpoint is not None:
            self._endpoint = None
            self.communicator.shutdown(max(5.0, min(self.timeout, 30.0)))

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.flush()  # a failed posted call (the last optimizer step) is raised, not lost
        finally:
            self.close()

    def schedule(self, num_microbatches: int) -> Schedule:
        ranks = self.num_stages // self.virtual_stages  # the schedule's ranks; workers may be fewer (linear)
        key = (ranks, num_microbatches)
        if key not in self._schedules:
            self._schedules[key] = self.schedule_factory(ranks, num_microbatches, self.virtual_stages)
        return self._schedules[key]

    # steps
    @_share_cores
    def train_step(
        self,
        inputs: Sequence[Any],
        labels: Sequence[Any],
        criterion: Loss | Criterion,
        scaler: Any = None,
        optimizer: Any = None,
    ) -> StepResult:
        """Forward and backward of every microbatch; parameter gradients stay on the stages.

        Each microbatch's loss is ``criterion.compute_loss(output, label)``, backpropagated by
        ``criterion.compute_gradient`` (a plain function ``(output, label) -> loss`` is wrapped in a `Loss`).
        """
        criterion = as_loss(criterion)
        schedule = self.schedule(len(inputs))
        if schedule.asynchronous:
            raise ConfigurationError(
                f"schedule={schedule.name!r} trains a stream of batches without a flush between them; "
                "run it with Pipeline.train_async(batches, ...), or pick a synchronous schedule such as '1f1b'"
            )
        loss_plan = None
        if self.communicator.shares_objects:  # the last stage runs the criterion: no round trip per microbatch
            loss_plan = LossPlan(
                list(labels), criterion, scaler, optimizer, self.device, self._head, schedule.loss_after_all_forwards
            )
        step = self._begin(TRAIN, schedule.actions(), loss=loss_plan)
        try:
            self._feed(step, inputs)
            if loss_plan is not None:
                last = self.num_stages - 1
                losses = [self._wait(step, MessageKind.LOSS, last, m).payload for m in range(len(inputs))]
            else:
                losses = self._losses(step, labels, criterion, scaler, optimizer, schedule)
            records, parts = self._finish(step, late=self._may_leave(inputs))
            self._backward_inputs(step, inputs)
        except BaseException:
            self._abort(step)
            raise
        settle = self.settle if step in self._late else None
        self.last_result = StepResult(losses=losses, records=records, schedule=schedule, parts=parts, settle=settle)
        return self.last_result

    def train_stream(
        self,
        batches: Iterable[tuple[Sequence[Any], Sequence[Any]]],
        num_batches: int,
        criterion: Loss | Criterion,
        optimizer: Callable[[list[nn.Parameter]], Any],
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
        schedule = self.schedule(per_batch)
        if not schedule.asynchronous:
            raise ConfigurationError(
                f"train_stream needs an asynchronous schedule such as 'async', not {schedule.name!r}"
            )
        total = per_batch * num_batches
        window = window or self.num_stages + per_batch
        step = self._begin(ASYNC, schedule.stream(num_batches), update_every=per_batch, optimizer=optimizer)
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
                    payload = (tree.detach(x), [False] * len(tree.flatten(x)[0]))
                    self.endpoint.send(self.rank_of_stage[0], Message(MessageKind.ACTIVATION, step, 0, fed, payload))
                    fed += 1
                losses.append(self._loss_of(step, m, labels.pop(m), criterion)[1])
            records, parts = self._finish(step)
        except StopIteration:
            self._abort(step)
            raise ConfigurationError(f"the batches ran out before num_batches={num_batches}") from None
        except BaseException:
            self._abort(step)
            raise
        self.last_result = StepResult(losses=losses, records=records, schedule=schedule, parts=parts)
        return self.last_result

    @_share_cores
    def forward_step(self, inputs: Sequence[Any]) -> StepResult:
        """Forward only (evaluation, prediction): returns the last stage's outputs in order."""
        schedule = self.schedule(len(inputs))
        step = self._begin(EVAL, schedule.forward_actions())
        try:
            self._feed(step, inputs)
            outputs = [self._received_output(step, m, leaves=False) for m in range(len(inputs))]
            records, parts = self._finish(step)
        except BaseException:
            self._abort(step)
            raise
        self.last_result = StepResult(outputs=outputs, records=records, schedule=schedule, parts=parts)
        return self.last_result

    # internals
    def _begin(self, mode: str, actions: list[list[Any]], loss: LossPlan | None = None, **options: Any) -> int:
        lists = worker_lists(actions, self.num_stages, self.rank_of_stage)
        if mode == ASYNC:  # one object for every rank: stages of this process hand tied weights' gradients over
            options["shared"] = SharedWeights(self.timeout)
        self._step += 1
        self._pending.clear()
        for rank, rank_actions in enumerate(lists):
            plan = StepPlan(mode, rank_actions, dataflow=self.runner == "dataflow", **options)
            if rank == self.rank_of_stage[-1]:
                plan.loss = loss
            self.endpoint.send(rank, Message(MessageKind.STEP, self._step, payload=plan))
        return self._step

    def _losses(
        self,
        step: int,
        labels: Sequence[Any],
        criterion: Loss,
        scaler: Any,
        optimizer: Any,
        schedule: Schedule,
    ) -> list[Any]:
        """Each microbatch's loss from the last stage's output; its gradient goes back to the last stage."""
        if schedule.loss_after_all_forwards:
            for m in range(len(labels)):
                self._wait(step, MessageKind.OUTPUT, self.num_stages - 1, m, pop=False)
        losses = []
        for m in range(len(labels)):
            scaler, loss = self._loss_of(step, m, labels[m], criterion, optimizer, scaler)
            losses.append(loss)
        return losses

    def _loss_of(
        self,
        step: int,
        m: int,
        label: Any,
        criterion: Loss,
        optimizer: Any = None,
        scaler: Any = None,
    ) -> tuple[Any, Any]:
        """Microbatch ``m``'s loss from the last stage's output; its gradient goes back to the last stage."""
        output = self._received_output(step, m)
        scaler, grads, loss = output_grads(
            self.loss_module, self._head, optimizer, output, label, criterion, self.device, scaler
        )
        self.endpoint.send(self.rank_of_stage[-1], Message(MessageKind.GRAD, step, self.num_stages - 1, m, grads))
        return scaler, loss

    def _feed(self, step: int, inputs: Sequence[Any]) -> None:
        """Each microbatch's input as it is made; where the transport bundles messages (`Endpoint.bundles`),
        microbatch 0's at once (the first stage starts on it) and the others together, as one message."""
        endpoint, first = self.endpoint, self.rank_of_stage[0]
        later = []
        for m, x in enumerate(inputs):
            message = Message(MessageKind.ACTIVATION, step, 0, m, (tree.detach(x), tree.grad_mask(x)))
            if m > 0 and endpoint.bundles:
                later.append(message)
            else:
                endpoint.send(first, message)
        if later:
            endpoint.send_many(first, later)

    def _received_output(self, step: int, m: int, leaves: bool = True) -> Any:
        output, mask = self._wait(step, MessageKind.OUTPUT, self.num_stages - 1, m).payload
        output = tree.to_device(output, self.device)
        return tree.as_leaves(output, mask) if leaves else output

    def _finish(self, step: int, late: bool = False) -> tuple[list[list[Record]], list[list[Record]]]:
        """Each rank's action records and their parts (idle, recv, loss, compute, send), once all are done.

        ``late``: only the last stage's rank is waited for; the others' records fill in when their ends
        arrive (`settle`). Older steps' late ranks are waited for here.
        """
        records: list[Any] = [[] for _ in range(self.num_ranks)]
        parts: list[Any] = [[] for _ in range(self.num_ranks)]
        waited = [self.rank_of_stage[-1]] if late else list(range(self.num_ranks))
        for rank in waited:
            records[rank], parts[rank] = self._wait(step, MessageKind.DONE, -1, rank).payload
        waiting = set()
        for rank in set(range(self.num_ranks)) - set(waited):
            ended = self._pending.pop((MessageKind.DONE, -1, rank), None)  # arrived while the last one was awaited
            if ended is None:
                waiting.add(rank)
            else:
                records[rank], parts[rank] = ended.payload
        if waiting:
            self._late[step] = LateRanks(records, parts, waiting)
        self.settle(before=step)
        return records, parts

    def _may_leave(self, inputs: Sequence[Any]) -> bool:
        """Whether a train step may return before the ranks other than the last stage's finished its backwards.

        Where the stages own their parameters, everything the coordinator sends them later (the optimizer
        step, a call, the next step) runs after their step, in order; so Lightning's work after the step and
        before the next overlaps with the first stages' last backwards. Not where the inputs need gradients
        (they come from the first stage's last backwards).
        """
        return self.communicator.stages_own_parameters and not any(any(tree.grad_mask(x)) for x in inputs)

    def _backward_inputs(self, step: int, inputs: Sequence[Any]) -> None:
        """Carry the first stage's input gradients into whatever produced the inputs."""
        for m, x in enumerate(inputs):
            if not any(tree.grad_mask(x)):
                continue
            grads = self._wait(step, MessageKind.INPUT_GRAD, 0, m).payload
            pairs = [
                (t, g.to(t.device))
                for t, g in zip(tree.flatten(x)[0], grads, strict=True)
                if isinstance(t, torch.Tensor) and t.requires_grad and g is not None
            ]
            if pairs:
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])


class _Received(nn.Module):
    """The loss module's model: hands the last stage's output to the criterion as received (a tuple stays a tuple)."""

    def forward(self, *output: Any) -> Any:
        return output[0] if len(output) == 1 else output
