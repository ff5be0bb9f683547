"""`StageInbox`: how a stage worker waits for its inputs, and in which order its actions become ready."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING

from lightning_pipe.comm.base import Endpoint, Message, MessageKind, deadline, remaining
from lightning_pipe.engine.plan import StageSpec
from lightning_pipe.engine.split_backward import WeightGradient
from lightning_pipe.errors import PipeTimeoutError
from lightning_pipe.executors import Activation
from lightning_pipe.schedule import Action, Kind, peak_activations

Key = tuple[int, str, int, int]  # (step, kind, stage, microbatch)


#: kinds of message that belong after the step that is running when their step number is later
AFTER_STEP = frozenset({MessageKind.STEP, MessageKind.CALL, MessageKind.POST, MessageKind.ABORT})


class StepAborted(Exception):
    """The coordinator dropped the current step (or stopped the worker) while the stage waited."""


class StageInbox:
    """Mixed into `StageWorker`: the pending inputs, the waits for them and the ready-order of actions."""

    spec: StageSpec
    endpoint: Endpoint
    rank: int
    _pending: dict[Key, Message]
    _later: collections.deque[Message]  # sent after the running step, served once it ended
    _saved: dict[tuple[int, int], Activation]
    _weight_work: dict[tuple[int, int], WeightGradient]
    _asynchronous: bool
    _stop: bool

    if TYPE_CHECKING:

        def _call(self, message: Message) -> None: ...

    def _wait(self, step: int, kind: str, stage: int, microbatch: int) -> Message:
        key = (step, kind, stage, microbatch)
        until = deadline(self.spec.timeout)
        while key not in self._pending:
            what = "activation" if kind == MessageKind.ACTIVATION else "gradient"
            self._receive(step, until, f"stage {stage} waited {{}} for the {what} of microbatch {microbatch}")
        return self._pending.pop(key)

    def _receive(self, step: int, until: float, what: str) -> None:
        """Take one message from the inbox: store inputs, serve calls and posts, raise on abort, stop or timeout.

        What the coordinator sent after a synchronous step (a later step, call, post or abort: it moves on
        once the last stage is done, see `Coordinator.train_step`) waits in `_later` until this step has
        ended. An asynchronous stream serves calls as they come: the coordinator sends them between its feeds.
        """
        message = self._take(step, remaining(until))
        if message is None:
            raise PipeTimeoutError(
                what.format(f"{self.spec.timeout:.1f} s")
                + "; raise PipeStrategy(timeout=...) if a stage legitimately takes that long"
            )
        if message.kind == MessageKind.STOP:
            self._stop = True
            raise StepAborted
        if message.step > step and message.kind in AFTER_STEP and not self._asynchronous:
            self._later.append(message)
            return
        if message.kind == MessageKind.ABORT and message.step == step:
            raise StepAborted
        if message.kind in (MessageKind.CALL, MessageKind.POST):
            self._call(message)
            return
        self._pending[(message.step, message.kind, message.stage, message.microbatch)] = message

    def _take(self, step: int, timeout: float) -> Message | None:
        """The next message for a step: an abort of it set aside while the step before ran, else the inbox's next."""
        for i, message in enumerate(self._later):
            if message.step <= step:
                del self._later[i]
                return message
        return self.endpoint.recv(timeout)

    def _in_order(self, step: int, actions: list[Action]) -> Iterator[Action]:
        """The list's order (``parallel`` and ``linear`` runners), each action once its inputs arrived."""
        for action in actions:
            until = deadline(self.spec.timeout)
            while not self._ready(step, action, True, 0):
                what = "the gradient" if action.kind.is_backward else "the activation"
                self._receive(
                    step, until, f"stage {action.stage} waited {{}} for {what} of microbatch {action.microbatch}"
                )
            yield action

    def _dataflow(self, step: int, actions: list[Action]) -> Iterator[Action]:
        """The dataflow runner: yield whichever action is ready, preferring the schedule's order.

        The earliest remaining action of the list may always run; a later forward may run ahead
        only while this rank holds fewer activations than the list's own peak, so the memory plan
        still holds and no run can deadlock that the fixed order would not. Under ``schedule="async"``
        each stage keeps its list's order (only the stages of one worker interleave): which weight
        version a forward uses, and which backwards one update sums, follow that order.
        """
        remaining = list(actions)
        cap = peak_activations([actions])[0]
        until = deadline(self.spec.timeout)
        while remaining:
            action = self._next_ready(step, remaining, cap)
            if action is None:
                waiting = ", ".join(map(str, remaining[:4]))
                self._receive(step, until, f"rank {self.rank} waited {{}} for the inputs of any of {waiting}")
                continue
            remaining.remove(action)
            until = deadline(self.spec.timeout)
            yield action

    def _next_ready(self, step: int, remaining: list[Action], cap: int) -> Action | None:
        waiting: set[int] = set()  # async: stages whose earliest remaining action is not ready
        for i, action in enumerate(remaining):
            if action.stage not in waiting and self._ready(step, action, i == 0, cap):
                return action
            if self._asynchronous:
                waiting.add(action.stage)
        return None

    def _ready(self, step: int, action: Action, first: bool, cap: int) -> bool:
        key = (action.stage, action.microbatch)
        if action.kind is Kind.FORWARD:
            arrived = (step, MessageKind.ACTIVATION, *key) in self._pending
            return arrived and (first or len(self._saved) < cap)
        if action.kind is Kind.BACKWARD_WEIGHT:
            return key in self._weight_work
        return (step, MessageKind.GRAD, *key) in self._pending and key in self._saved
