"""`StageLosses`: the losses of a step on the rank that holds the last stage (where stages share the coordinator's
objects, `LossPlan`), taken the way the coordinator would take them, and sent to it with the rank's end.

A microbatch's loss is taken in one of two ways, with the same losses and gradients:

- after its forward, its gradient with respect to the stage's output a message to the stage's backward (the
  forward-loss module, as the coordinator computes it);
- in its backward, where one backward then goes through the loss and the stage: a gradient of the output taken
  apart costs a second pass of autograd's engine, on the stage that most often paces the pipeline.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_pipe.base import tree
from lightning_pipe.comm.base import Message, MessageKind
from lightning_pipe.engine.executors import BackwardModule, ForwardLossModule, detached, output_grads
from lightning_pipe.engine.loss import backpropagates_plainly
from lightning_pipe.engine.messages import TRAIN, LossPlan, StepPlan
from lightning_pipe.engine.stage_inbox import StageInbox
from lightning_pipe.schedule import Action, Kind


class LossFailed(Exception):
    """The user's criterion failed: ``error`` is its own exception, which the coordinator raises as it is."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class StageLosses:
    """The losses of one step on the last stage's rank: which backwards take their own (`in_backward`), the
    others after their forwards (`after_forward`), and the messages that carry them all (`messages`)."""

    def __init__(self, inbox: StageInbox, shards: dict[int, Any]) -> None:
        self.inbox = inbox
        self.shards = shards
        self.plan: LossPlan | None = None  # set when this rank computes the step's losses
        self.messages: list[Message] = []  # this step's losses, sent with the rank's end (one wake-up)
        self._outputs: dict[int, Any] = {}  # outputs awaiting their loss, by microbatch
        self._in_backward: set[tuple[int, int]] = set()

    def begin(self, plan: StepPlan, last: int, apart: bool, early: Action | None) -> None:
        """A new step's losses; ``last``: the last stage's index; ``early``: the backward this rank runs as I then W
        (`StageActions._early_input_grad`); ``apart``: every loss is taken after its forward (the stage's forward is
        recomputed in its backward, or FSDP shards the stage: one backward from the loss raised the peak of the
        512 MiB test's last-stage processes from at most 0.35 of their training state to 0.44, not explained yet).

        A backward takes its own loss with the default executors, a criterion whose gradient is ``loss.backward()``,
        in a synchronous step whose losses follow their forwards (not gpipe's, after every forward), for a whole
        backward (not I and W).
        """
        self.plan, self.messages, self._outputs, self._in_backward = plan.loss, [], {}, set()
        loss, shard = plan.loss, self.shards.get(last)
        if loss is None or loss.after_all_forwards or plan.mode != TRAIN or shard is None or apart:
            return
        plain = type(shard.forward_loss) is ForwardLossModule and type(shard.backward) is BackwardModule
        if plain and backpropagates_plainly(loss.criterion):
            whole = [a for a in plan.actions if a.stage == last and a.kind is Kind.BACKWARD and a != early]
            self._in_backward = {(a.stage, a.microbatch) for a in whole}

    def forget(self) -> None:
        self._outputs.clear()
        self._in_backward.clear()

    def in_backward(self, s: int, m: int) -> bool:
        """Whether the backward of microbatch ``m`` of stage ``s`` takes its loss (it waits for no gradient)."""
        return (s, m) in self._in_backward

    def after_forward(self, step: int, s: int, m: int, outputs: Any, mask: list[bool]) -> bool:
        """The forward of the last stage's microbatch ``m`` ended: whether losses were taken now (else its backward
        takes it, or a later forward: gpipe's losses follow the last forward)."""
        plan = self.plan
        assert plan is not None
        if (s, m) in self._in_backward:
            if all(type(x) is torch.Tensor for x in tree.tensors(outputs)):
                return False
            self._in_backward.discard((s, m))  # a DTensor's loss is taken apart from the stage
        self._outputs[m] = (tree.detach(outputs), mask)
        if plan.after_all_forwards and len(self._outputs) < len(plan.labels):
            return False
        for m in sorted(self._outputs):
            self._take(step, s, m, *self._outputs.pop(m))
        return True

    def of_backward(self, step: int, s: int, m: int, outputs: Any) -> Any:
        """The loss of microbatch ``m`` from the stage's ``outputs`` (still in autograd's graph), for its backward to
        backpropagate (`backpropagate`)."""
        plan = self.plan
        assert plan is not None
        loss_module: ForwardLossModule = self.shards[s].forward_loss  # the default one (`begin`)
        try:
            loss = loss_module.loss(plan.head, tree.to_device(outputs, plan.device), plan.labels[m], plan.criterion)
        except Exception as exc:  # the user's step code failed: raise its own exception, not a StageError
            raise LossFailed(exc) from exc
        self.messages.append(Message(MessageKind.LOSS, step, s, m, detached(loss)))
        return loss

    def backpropagate(self, s: int, loss: Any) -> None:
        """The backward of a loss from `of_backward` (scaled by the step's GradScaler): through the stage too."""
        plan = self.plan
        assert plan is not None
        self.shards[s].forward_loss.backpropagate(loss, plan.criterion, plan.scaler)

    def _take(self, step: int, s: int, m: int, outputs: Any, mask: list[bool]) -> None:
        """The loss of a detached output, as the coordinator would take it: the gradient with respect to the output
        becomes the stage's pending gradient, the loss a message to the coordinator."""
        plan = self.plan
        assert plan is not None
        leaves = tree.as_leaves(tree.to_device(outputs, plan.device), mask)
        loss_module = self.shards[s].forward_loss
        try:
            plan.scaler, grads, loss = output_grads(
                loss_module, plan.head, plan.optimizer, leaves, plan.labels[m], plan.criterion, plan.device, plan.scaler
            )
        except Exception as exc:  # the user's step code failed: raise its own exception, not a StageError
            raise LossFailed(exc) from exc
        self.inbox.store(Message(MessageKind.GRAD, step, s, m, grads))
        self.messages.append(Message(MessageKind.LOSS, step, s, m, loss))
