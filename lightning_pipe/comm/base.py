"""The `Communicator`: the only way the coordinator and the stage workers talk.

Messages carry a kind (what the payload is), the step they belong to, the stage and microbatch
they concern, and the payload. Stage workers and the coordinator only see `Endpoint`s, so the same
engine code runs on every transport.
"""

from __future__ import annotations

import queue
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from lightning_pipe.comm.parameter_home import ParameterHome, StageCopies

COORDINATOR = -1


class MessageKind:
    """What a message carries."""

    STEP = "step"  # coordinator -> rank: run a step (payload: StepPlan)
    ACTIVATION = "activation"  # forward input of a stage
    OUTPUT = "output"  # last stage -> coordinator
    LOSS = "loss"  # last stage -> coordinator: a microbatch's loss, computed on the stage (payload: the loss)
    GRAD = "grad"  # gradient with respect to a stage's output
    INPUT_GRAD = "input_grad"  # first stage -> coordinator: gradient of the pipeline's input
    DONE = "done"  # rank -> coordinator: the step finished (payload: timing records of its actions and their parts)
    ERROR = "error"  # rank -> coordinator: an action failed (payload: StageError)
    ABORT = "abort"  # coordinator -> rank: drop the step
    CALL = "call"  # coordinator -> rank: run a control method (payload: (name, args))
    REPLY = "reply"  # rank -> coordinator: a control method's result
    POST = "post"  # coordinator -> rank: run a control method, reply only if it fails (payload: (name, args))
    POST_FAILED = "post_failed"  # rank -> coordinator: a posted method failed (payload: StageError; step: the post's)
    STOP = "stop"  # coordinator -> rank: leave the event loop


#: the control call every stage serves with its rank (`StageProtocol.ping`): the transports' ready ping
PING = "ping"


@dataclass
class Message:
    kind: str
    step: int = 0
    stage: int = 0
    microbatch: int = 0
    payload: Any = None
    source: int = COORDINATOR


class Endpoint(ABC):
    """One participant's view: its own inbox and a way to send to any rank or the coordinator."""

    rank: int
    #: `send_many` sends several messages as one (the coordinator then feeds a step's later inputs together)
    bundles: bool = False

    @abstractmethod
    def send(self, rank: int, message: Message) -> None:
        """Deliver ``message`` to ``rank``'s inbox (``COORDINATOR`` for the coordinator)."""

    def send_many(self, rank: int, messages: list[Message]) -> None:
        """Deliver ``messages`` to ``rank`` in order (a transport may send them as one: tensor messages of one
        kind, step and stage, of consecutive microbatches)."""
        for message in messages:
            self.send(rank, message)

    @abstractmethod
    def recv(self, timeout: float | None) -> Message | None:
        """Next message of this inbox, or None after ``timeout`` seconds."""

    def host(self, rank: int) -> str:
        """Where ``rank`` runs, for error messages."""
        return "local"

    def close(self) -> None:
        """Stop receiving: what still arrives for this endpoint is dropped (its inbox detached, where one is)."""


class QueueInbox:
    """A thread-safe inbox, woken by whoever delivers a message (the seed's I/O callback)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()

    def put(self, message: Message) -> None:
        self._queue.put(message)

    def get(self, timeout: float | None) -> Message | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def empty(self) -> bool:
        return self._queue.empty()


class Communicator(ABC):
    """Starts stage workers somewhere and connects them with the coordinator."""

    name: str = "communicator"
    #: stages share the coordinator's objects (messages pass by reference): the last stage can run the
    #: criterion itself, so a microbatch's loss costs no round trip through the coordinator
    shares_objects: bool = False
    #: where the stages keep their parameters: each its own copy (in another process; gradients, optimizer steps
    #: and checkpoints go through the stages), or `SharedParameters` where they share the module's
    parameters: ParameterHome = StageCopies()

    @abstractmethod
    def launch(self, specs: list[Any], worker_cls: Any) -> Endpoint:
        """Start ``worker_cls(specs[i], endpoint).serve()`` for each rank ``i``; return the coordinator's endpoint."""

    @abstractmethod
    def shutdown(self, timeout: float) -> None:
        """Stop every worker; returns within ``timeout`` seconds."""

    def check_alive(self) -> None:
        """Raise `TransportError` if a worker is known to be gone (called while waiting)."""


def deadline(timeout: float) -> float:
    return time.monotonic() + timeout


def remaining(until: float) -> float:
    return max(0.0, until - time.monotonic())
