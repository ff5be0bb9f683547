"""The `Coordinator`: feeds microbatches, computes losses, collects outputs and errors."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_pipe.base import tree
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.comm.base import Communicator, Endpoint, Message, MessageKind
from lightning_pipe.engine.coordinator_link import CoordinatorLink
from lightning_pipe.engine.executors import output_grads
from lightning_pipe.engine.loss import Criterion, Loss, as_loss
from lightning_pipe.engine.messages import ASYNC, EVAL, TRAIN, LossPlan, StageSpec, StepPlan
from lightning_pipe.engine.runners import check_runner, worker_lists
from lightning_pipe.engine.shared_weights import SharedWeights
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.engine.stage_worker import StageWorker
from lightning_pipe.engine.step_result import Record, StepResult
from lightning_pipe.schedule import Schedule

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


class Coordinator:
    """Drives the stage workers through a communicator, one step at a time.

    The coordinator holds no layers: it sends microbatch inputs to the first stage, receives the
    last stage's outputs, runs the loss (the `ForwardLossModule` of the last shard, with the
    identity as its model) and sends the gradients back. Its messages go through ``stages``
    (`CoordinatorLink`: calls, posts, waits with timeouts, aborts); the steps are made here.
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
        tied: Sequence[Sequence[tuple[int, str]]] = (),
    ) -> None:
        self.communicator = communicator
        self._tied_shards = [list(holders) for holders in tied]  # (stage, name) of each weight several stages hold
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
        #: every rank's control calls (`StageProtocol`'s methods, typed) and the messages of the steps
        self.stages = CoordinatorLink(communicator, self.num_ranks, timeout)
        self._schedules: dict[tuple[int, int], Schedule] = {}
        self.last_result: StepResult | None = None

    # lifetime
    def start(self) -> Coordinator:
        self.stages.open(self.communicator.launch(self.specs, self._worker_cls))
        for spec in self.specs:  # every worker made its tensors: what they were made from (values a checkpoint
            spec.init = None  # hook gave, a stage's) is not kept here for the fit
        return self

    def close(self) -> None:
        """Stop the stages; calls posted since the last `call` are not waited for (see `post`)."""
        if self.stages.close():
            self.communicator.shutdown(max(5.0, min(self.timeout, 30.0)))

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.flush()  # a failed posted call (the last optimizer step) is raised, not lost
        finally:
            self.close()

    # the face of ``stages``: the ends of steps and the calls posted (see `CoordinatorLink`)
    @property
    def endpoint(self) -> Endpoint:
        return self.stages.endpoint

    def flush(self) -> None:
        """Wait for the posted calls and the ranks still finishing steps (`CoordinatorLink.flush`)."""
        self.stages.flush()

    def settle(self, before: int | None = None) -> None:
        """Wait for the ranks still finishing train steps (before step ``before``: `CoordinatorLink.settle`)."""
        self.stages.settle(before)

    def restart(self, specs: Sequence[StageSpec]) -> None:
        """Stop the workers and start new ones from ``specs``: the same stages placed on other ranks
        (``schedule="auto"`` moving its stages, `lightning_pipe.pipeline.stage_moves`), once the posted calls ran.
        Later steps and calls reach the new workers."""
        self.flush()
        self.close()
        self.specs = list(specs)
        self.num_ranks = len(self.specs)
        self.rank_of_stage = self.specs[0].rank_of_stage
        self.stages.num_ranks = self.num_ranks
        self._schedules.clear()
        self.start()

    def use_schedule(self, factory: Callable[[int, int, int], Schedule]) -> None:
        """From the next step on, steps run ``factory``'s schedules (``schedule="auto"``'s choice)."""
        self.schedule_factory = factory
        self._schedules.clear()

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
        step = self.begin(TRAIN, schedule.actions(), loss=loss_plan)
        try:
            self._feed(step, inputs)
            if loss_plan is not None:
                last = self.num_stages - 1
                losses = [self.stages.wait(step, MessageKind.LOSS, last, m).payload for m in range(len(inputs))]
            else:
                losses = self._losses(step, labels, criterion, scaler, optimizer, schedule)
            records, parts = self.finish(step, late=self._may_leave(inputs))
            self._backward_inputs(step, inputs)
        except BaseException:
            self.abort(step)
            raise
        settle = self.settle if self.stages.is_late(step) else None
        self.last_result = StepResult(losses=losses, records=records, schedule=schedule, parts=parts, settle=settle)
        return self.last_result

    @_share_cores
    def forward_step(self, inputs: Sequence[Any]) -> StepResult:
        """Forward only (evaluation, prediction): returns the last stage's outputs in order."""
        schedule = self.schedule(len(inputs))
        step = self.begin(EVAL, schedule.forward_actions())
        try:
            self._feed(step, inputs)
            outputs = [self._received_output(step, m, leaves=False) for m in range(len(inputs))]
            records, parts = self.finish(step)
        except BaseException:
            self.abort(step)
            raise
        self.last_result = StepResult(outputs=outputs, records=records, schedule=schedule, parts=parts)
        return self.last_result

    # the parts of a step (the steps above use them, and so does `BatchStream`)
    def begin(self, mode: str, actions: list[list[Any]], loss: LossPlan | None = None, **options: Any) -> int:
        """Send each rank its `StepPlan`: its part of ``actions`` (one list per schedule rank); the step's number."""
        if mode == ASYNC:  # one object for every rank: stages of this process hand tied weights' gradients over
            options["shared"] = SharedWeights(self.timeout)
        plans = []
        for rank, rank_actions in enumerate(worker_lists(actions, self.num_stages, self.rank_of_stage)):
            plan = StepPlan(mode, rank_actions, dataflow=self.runner == "dataflow", **options)
            if rank == self.rank_of_stage[-1]:
                plan.loss = loss
            plans.append(plan)
        return self.stages.begin(plans)

    def apply_grads(self, scale: float = 1.0) -> None:
        """The step's end: add its gradients, times ``scale``, to ``p.grad`` on every stage.

        Each copy of a tied weight (`tied`) first gets the sum of every copy's gradient of the step,
        the gradient the one shared parameter gets in the unsplit module.

        Stages that own their parameters are posted the work (`CoordinatorLink.post`): only later calls
        read their gradients, and each stage runs them after it. Stages that share the module's
        parameters have them in ``p.grad`` when this returns: the caller's optimizer reads them next.
        """
        send_each = self.communicator.parameters.sender(self.stages)
        tied = self.tied
        if tied:
            names: list[list[str]] = [[] for _ in range(self.num_ranks)]
            for holders in tied:
                for rank, name in holders:
                    names[rank].append(name)
            got = self.stages.call_each(StageProtocol.step_grads, [(own,) for own in names])
            totals: list[dict[str, torch.Tensor]] = [{} for _ in names]
            for holders in tied:
                parts = [g for g in (got[rank][name] for rank, name in holders) if g is not None]
                if not parts:
                    continue
                total = parts[0].clone()
                for g in parts[1:]:
                    total += g.to(total.device)
                for rank, name in holders:
                    totals[rank][name] = total
            send_each(StageProtocol.set_step_grads, [(own,) for own in totals])
        send_each(StageProtocol.apply_grads, [(scale,)] * self.num_ranks)

    @property
    def tied(self) -> list[list[tuple[int, str]]]:
        """Per weight of which several ranks hold a copy: the (rank, name) of each copy, the first holder first.

        Empty when the stages share the module's parameters (the local transport): then a tied weight
        is one parameter. With ``transport="rpc"`` every worker unpickles its own copy; the copies
        get the same gradient (`apply_grads`) and so make the same optimizer updates.
        """
        return self.communicator.parameters.copies(self.rank_of_stage, self._tied_shards)

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
                self.stages.wait(step, MessageKind.OUTPUT, self.num_stages - 1, m, pop=False)
        losses = []
        for m in range(len(labels)):
            scaler, loss = self.loss_of(step, m, labels[m], criterion, optimizer, scaler)
            losses.append(loss)
        return losses

    def loss_of(
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
        output, mask = self.stages.wait(step, MessageKind.OUTPUT, self.num_stages - 1, m).payload
        output = tree.to_device(output, self.device)
        return tree.as_leaves(output, mask) if leaves else output

    def finish(self, step: int, late: bool = False) -> tuple[list[list[Record]], list[list[Record]]]:
        """Each rank's action records and their parts (idle, recv, loss, compute, send), once all are done.

        ``late``: only the last stage's rank is waited for; the others' records fill in when their ends
        arrive (`settle`). Older steps' late ranks are waited for here.
        """
        waited = [self.rank_of_stage[-1]] if late else list(range(self.num_ranks))
        return self.stages.ends(step, waited)

    def abort(self, step: int) -> None:
        """Every rank drops ``step``: what it holds of it and what arrives for it later."""
        self.stages.abort(step)

    def _may_leave(self, inputs: Sequence[Any]) -> bool:
        """Whether a train step may return before the ranks other than the last stage's finished its backwards.

        Where the stages own their parameters, everything the coordinator sends them later (the optimizer
        step, a call, the next step) runs after their step, in order; so Lightning's work after the step and
        before the next overlaps with the first stages' last backwards. Not where the inputs need gradients
        (they come from the first stage's last backwards).
        """
        return self.communicator.parameters.may_leave(inputs)

    def _backward_inputs(self, step: int, inputs: Sequence[Any]) -> None:
        """Carry the first stage's input gradients into whatever produced the inputs."""
        for m, x in enumerate(inputs):
            if not any(tree.grad_mask(x)):
                continue
            grads = self.stages.wait(step, MessageKind.INPUT_GRAD, 0, m).payload
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
