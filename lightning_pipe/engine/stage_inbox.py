"""`StageInbox`: how a stage worker waits for its inputs, and in which order its actions become ready."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from lightning_pipe.base.errors import PipeTimeoutError
from lightning_pipe.comm.base import Endpoint, Message, MessageKind, deadline, remaining
from lightning_pipe.schedule import Action, peak_activations

Key = tuple[int, str, int, int]  # (step, kind, stage, microbatch)
#: whether an action's inputs are here: ``(step, action, first, cap)``, see `StageInbox.dataflow`
Ready = Callable[[int, Action, bool, int], bool]


#: kinds of message that belong after the step that is running when their step number is later
AFTER_STEP = frozenset({MessageKind.STEP, MessageKind.CALL, MessageKind.POST, MessageKind.ABORT})


class StepAborted(Exception):
    """The coordinator dropped the current step (or stopped the worker) while the stage waited."""


class StageInbox:
    """A stage worker's messages: the inputs that arrived, the waits for them, what waits for the next step.

    A CALL or POST that arrives while a step waits is handed to ``serve`` (the worker's call dispatch).
    The worker sets ``asynchronous`` for each step: an asynchronous stream serves calls as they come.
    """

    def __init__(self, endpoint: Endpoint, rank: int, timeout: float, serve: Callable[[Message], None]) -> None:
        self.endpoint = endpoint
        self.rank = rank
        self.timeout = timeout
        self.asynchronous = False  # the running step is an asynchronous stream
        self.stopped = False  # a STOP arrived while a step waited
        self._serve = serve
        self._pending: dict[Key, Message] = {}
        self._later: collections.deque[Message] = collections.deque()  # sent after the running step
        self._aborted = -1  # inputs of steps up to this one are dropped

    def next(self, timeout: float) -> Message | None:
        """Between steps: what arrived during the last step and belongs after it first, else the endpoint's next."""
        return self._later.popleft() if self._later else self.endpoint.recv(timeout)

    def store(self, message: Message) -> None:
        """Keep an input (an activation or a gradient) until its action takes it; one of an aborted step is dropped."""
        if message.step > self._aborted:
            self._pending[(message.step, message.kind, message.stage, message.microbatch)] = message

    def arrived(self, step: int, kind: str, stage: int, microbatch: int) -> bool:
        return (step, kind, stage, microbatch) in self._pending

    def forget(self, step: int) -> None:
        """Drop the inputs of ``step`` and every step before it, and any that arrive for them later."""
        self._aborted = max(self._aborted, step)
        self._pending = {k: v for k, v in self._pending.items() if k[0] > step}

    def wait(self, step: int, kind: str, stage: int, microbatch: int) -> Message:
        """The input ``kind`` of ``stage`` for ``microbatch``, once it arrived (raises after the timeout)."""
        key = (step, kind, stage, microbatch)
        until = deadline(self.timeout)
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
                what.format(f"{self.timeout:.1f} s")
                + "; raise PipeStrategy(timeout=...) if a stage legitimately takes that long"
            )
        if message.kind == MessageKind.STOP:
            self.stopped = True
            raise StepAborted
        if message.step > step and message.kind in AFTER_STEP and not self.asynchronous:
            self._later.append(message)
            return
        if message.kind == MessageKind.ABORT and message.step == step:
            raise StepAborted
        if message.kind in (MessageKind.CALL, MessageKind.POST):
            self._serve(message)
            return
        self._pending[(message.step, message.kind, message.stage, message.microbatch)] = message

    def _take(self, step: int, timeout: float) -> Message | None:
        """The next message for a step: an abort of it set aside while the step before ran, else the inbox's next."""
        for i, message in enumerate(self._later):
            if message.step <= step:
                del self._later[i]
                return message
        return self.endpoint.recv(timeout)

    def in_order(self, step: int, actions: list[Action], ready: Ready) -> Iterator[Action]:
        """The list's order (``parallel`` and ``linear`` runners), each action once its inputs arrived."""
        for action in actions:
            until = deadline(self.timeout)
            while not ready(step, action, True, 0):
                what = "the gradient" if action.kind.is_backward else "the activation"
                self._receive(
                    step, until, f"stage {action.stage} waited {{}} for {what} of microbatch {action.microbatch}"
                )
            yield action

    def dataflow(self, step: int, actions: list[Action], ready: Ready) -> Iterator[Action]:
        """The dataflow runner: yield whichever action is ready, preferring the schedule's order.

        The earliest remaining action of the list may always run; a later forward may run ahead
        only while this rank holds fewer activations than the list's own peak (``cap``, which
        ``ready`` compares with what is held), so the memory plan still holds and no run can deadlock
        that the fixed order would not. Under ``schedule="async"`` each stage keeps its list's order
        (only the stages of one worker interleave): which weight version a forward uses, and which
        backwards one update sums, follow that order.
        """
        remaining = list(actions)
        cap = peak_activations([actions])[0]
        until = deadline(self.timeout)
        while remaining:
            action = self._next_ready(step, remaining, cap, ready)
            if action is None:
                waiting = ", ".join(map(str, remaining[:4]))
                self._receive(step, until, f"rank {self.rank} waited {{}} for the inputs of any of {waiting}")
                continue
            remaining.remove(action)
            until = deadline(self.timeout)
            yield action

    def _next_ready(self, step: int, remaining: list[Action], cap: int, ready: Ready) -> Action | None:
        waiting: set[int] = set()  # async: stages whose earliest remaining action is not ready
        for i, action in enumerate(remaining):
            if action.stage not in waiting and ready(step, action, i == 0, cap):
                return action
            if self.asynchronous:
                waiting.add(action.stage)
        return None
