"""`CoordinatorLink`: the coordinator's side of the endpoint: control calls and posts, steps, waits, stage errors.

A control call names the method of `StageProtocol` itself (``stages.call(StageProtocol.grad_norm, 2.0)``), so a
type checker checks its arguments and its result, and go-to-definition lands on the method the worker runs; the
wire carries the method's name. `CoordinatorLink.call` waits for every rank's result; `CoordinatorLink.post`
sends and goes on (a rank runs what it was sent in order; a failure is raised at the coordinator's next wait).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from lightning_pipe.base.errors import PipeTimeoutError, StageError
from lightning_pipe.comm.base import Communicator, Endpoint, Message, MessageKind, deadline, remaining
from lightning_pipe.engine.stage_protocol import StageProtocol
from lightning_pipe.engine.step_result import Record

Key = tuple[str, int, int]  # (kind, stage, microbatch)
P = ParamSpec("P")
R = TypeVar("R")
Method = Callable[Concatenate[StageProtocol, P], R]  # a control call: a method of `StageProtocol`
_POLL = 1.0  # seconds between liveness checks while waiting


@dataclass
class LateRanks:
    """A train step's ranks that the coordinator did not wait for: their records fill in as their ends arrive."""

    records: list[Any]  # the step's per-rank lists, shared with its `StepResult`
    parts: list[Any]
    waiting: set[int]


class CoordinatorLink:
    """Every rank's `StageProtocol` and steps: sends to the ranks, waits for their messages, each with a timeout.

    Owns what the coordinator's messages need: the endpoint (between `open` and `close`), the numbers
    of steps and calls (one sequence: a rank serves them in that order), the messages of the running
    step that arrived before they were waited for, the calls posted and not yet answered for, and the
    ranks that train steps did not wait for (`LateRanks`).
    """

    def __init__(self, communicator: Communicator, num_ranks: int, timeout: float) -> None:
        self.communicator = communicator
        self.num_ranks = num_ranks
        self.timeout = timeout
        self._endpoint: Endpoint | None = None
        self._step = 0
        self._pending: dict[Key, Message] = {}
        self._posted = False  # calls were posted since the last reply of every rank
        self._raised_posts = 0  # failures of calls posted up to this step number are raised already (or dropped)
        self._late: dict[int, LateRanks] = {}  # by step: ranks still finishing a step the coordinator returned from

    # lifetime
    def open(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint

    def close(self) -> bool:
        """Forget the endpoint, the posted calls and the late ranks; whether the link was open."""
        self._posted = False
        self._late.clear()
        was_open, self._endpoint = self._endpoint is not None, None
        return was_open

    @property
    def endpoint(self) -> Endpoint:
        if self._endpoint is None:
            raise RuntimeError("the pipeline is not started; call start() or use it as a context manager")
        return self._endpoint

    # control calls
    def call(self, method: Method[P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run ``method(*args)`` on every rank; their results in rank order.

        A rank runs it after everything posted to it before (`post`), and a posted call that failed is raised here.
        """
        return self._call(_name(method), _positional(method, args, kwargs), None)

    def call_each(self, method: Callable[..., R], per_rank: Sequence[tuple[Any, ...]], *args: Any) -> list[R]:
        """Run ``method(*args, *per_rank[r])`` on each rank ``r``: what only that rank needs."""
        return self._call(_name(method), args, per_rank)

    def post(self, method: Method[P, Any], *args: P.args, **kwargs: P.kwargs) -> None:
        """Send ``method(*args)`` to every rank without waiting for it.

        Each rank runs what the coordinator sends it in order, so a later call or step sees the
        posted call's effect. A rank answers only if the call failed; the coordinator raises that
        `StageError` (the rank, the call, its traceback) at its next wait of any kind: a call's
        reply, a step's messages. Only the first failure of the calls posted until then is raised.
        `close` does not wait for posted calls: a failure that arrives later is not raised (`flush`
        waits for them, as leaving a ``with`` block without an error does).
        """
        self._post(_name(method), _positional(method, args, kwargs), None)

    def post_each(self, method: Callable[..., Any], per_rank: Sequence[tuple[Any, ...]], *args: Any) -> None:
        """Send ``method(*args, *per_rank[r])`` to each rank ``r`` without waiting for it."""
        self._post(_name(method), args, per_rank)

    def ping(self) -> list[int]:
        """Every rank's number, once it ran everything sent to it before."""
        return self.call(StageProtocol.ping)

    def _call(self, name: str, args: tuple[Any, ...], each: Sequence[tuple[Any, ...]] | None) -> list[Any]:
        step = self._send_call(MessageKind.CALL, name, args, each)
        results: list[Any] = [None] * self.num_ranks
        for _ in range(self.num_ranks):
            message = self._next(step, f"the reply to {name!r}")
            while message.kind != MessageKind.REPLY:
                message = self._next(step, f"the reply to {name!r}")
            ok, value = message.payload
            if not ok:
                raise value
            results[message.source] = value
        self._posted = False  # every rank ran the posted calls before this one: their failures were raised
        return results

    def _post(self, name: str, args: tuple[Any, ...], each: Sequence[tuple[Any, ...]] | None) -> None:
        self._send_call(MessageKind.POST, name, args, each)
        self._posted = True

    def flush(self) -> None:
        """Wait until every rank ran the calls posted so far and finished its steps; raises the first that failed."""
        self.settle()
        if self._posted:
            self.ping()

    def _send_call(self, kind: str, name: str, args: tuple[Any, ...], each: Sequence[tuple[Any, ...]] | None) -> int:
        """With ``each``, rank ``r`` gets ``*args, *each[r]``."""
        self._step += 1
        for rank in range(self.num_ranks):
            rank_args = args + tuple(each[rank]) if each is not None else args
            self.endpoint.send(rank, Message(kind, self._step, payload=(name, rank_args)))
        return self._step

    # steps
    def begin(self, plans: Sequence[Any]) -> int:
        """Number a new step and send rank ``r`` its plan ``plans[r]``; messages of earlier steps are dropped."""
        self._step += 1
        self._pending.clear()
        for rank, plan in enumerate(plans):
            self.endpoint.send(rank, Message(MessageKind.STEP, self._step, payload=plan))
        return self._step

    def wait(self, step: int, kind: str, stage: int, microbatch: int, pop: bool = True) -> Message:
        """The message ``kind`` of ``stage`` for ``microbatch`` in ``step``; raises a stage's error or a timeout."""
        key = (kind, stage, microbatch)
        while key not in self._pending:
            self._store(self._next(step, _describe(kind, stage, microbatch)))
        return self._pending.pop(key) if pop else self._pending[key]

    def ends(self, step: int, waited: Sequence[int]) -> tuple[list[list[Record]], list[list[Record]]]:
        """Each rank's action records and their parts (idle, recv, loss, compute, send), once it is done.

        Only the ranks ``waited`` are waited for; the others' records fill in when their ends arrive
        (`settle`). Older steps' late ranks are waited for here.
        """
        records: list[Any] = [[] for _ in range(self.num_ranks)]
        parts: list[Any] = [[] for _ in range(self.num_ranks)]
        for rank in waited:
            records[rank], parts[rank] = self.wait(step, MessageKind.DONE, -1, rank).payload
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

    def is_late(self, step: int) -> bool:
        """Whether ranks of ``step`` are still finishing it (`ends` did not wait for them)."""
        return step in self._late

    def settle(self, before: int | None = None) -> None:
        """Wait for the ends of the ranks that train steps (before step ``before``: all) did not wait for.

        Raises a late rank's error: a stage that failed after the coordinator moved on (see
        `Coordinator.train_step`) is raised here or at the coordinator's next wait of any kind.
        """
        until = deadline(self.timeout)
        while self._endpoint is not None:
            steps = [step for step in self._late if before is None or step < before]
            if not steps:
                return
            step = min(steps)
            rank = min(self._late[step].waiting)
            message = self._receive(until, f"rank {rank} to finish step {step}")
            if message is not None and message.step == self._step:
                self._store(message)  # a message of the running step

    def abort(self, step: int) -> None:
        """Tell every rank to drop ``step`` (and the steps before it)."""
        if self._endpoint is None:
            return
        for rank in range(self.num_ranks):
            self._endpoint.send(rank, Message(MessageKind.ABORT, step))
        self._pending.clear()

    # receiving
    def _late_end(self, message: Message) -> None:
        """A late rank's end of its step: its records, or its error (raised)."""
        late = self._late[message.step]
        if message.kind == MessageKind.ERROR:
            del self._late[message.step]
            error: StageError = message.payload
            error.add_note(
                f"(rank {message.source} failed in step {message.step} after train_step had returned: a step waits "
                "for the last stage only; the others' failures are raised at the coordinator's next wait)"
            )
            self.abort(self._step)  # the failed rank runs posted calls again (it skipped those sent before this)
            raise error
        late.records[message.source], late.parts[message.source] = message.payload
        late.waiting.discard(message.source)
        if not late.waiting:
            del self._late[message.step]

    def _store(self, message: Message) -> None:
        if message.kind == MessageKind.DONE:
            self._pending[(message.kind, -1, message.source)] = message
        else:
            self._pending[(message.kind, message.stage, message.microbatch)] = message

    def _next(self, step: int, what: str) -> Message:
        """Next message of this step; raises a stage's error, or a timeout naming what was awaited."""
        until = deadline(self.timeout)
        while True:
            message = self._receive(until, what)
            if message is None or message.step != step:
                continue  # taken care of, or left over from an aborted step
            if message.kind == MessageKind.ERROR:
                error: StageError = message.payload
                raise error
            return message

    def _receive(self, until: float, what: str) -> Message | None:
        """One message, or None for a message taken care of here (or none yet): posted calls' failures are
        raised, late ranks' ends recorded (their errors raised); a timeout names ``what`` was awaited."""
        message = self.endpoint.recv(min(_POLL, remaining(until)))
        if message is None:
            self.communicator.check_alive()
            if remaining(until) <= 0:
                raise PipeTimeoutError(
                    f"the coordinator waited {self.timeout:.1f} s for {what}; "
                    "raise PipeStrategy(timeout=...) if a stage legitimately takes that long"
                )
            return None
        if message.kind == MessageKind.POST_FAILED:  # whatever step this is: a posted call failed
            if message.step > self._raised_posts:  # else posted before a failure that was raised
                self._raised_posts = self._step
                raise message.payload
            return None
        if message.kind in _ENDS and message.step in self._late:
            self._late_end(message)
            return None
        return message


_ENDS = (MessageKind.DONE, MessageKind.ERROR)


def _describe(kind: str, stage: int, microbatch: int) -> str:
    if kind == MessageKind.DONE:
        return f"rank {microbatch} to finish the step"
    if kind == MessageKind.OUTPUT:
        return f"the output of microbatch {microbatch} from the last stage ({stage})"
    if kind == MessageKind.INPUT_GRAD:
        return f"the input gradient of microbatch {microbatch} from stage 0"
    return f"{kind} of microbatch {microbatch} from stage {stage}"


def _name(method: Callable[..., Any]) -> str:
    name = method.__name__
    if getattr(StageProtocol, name, None) is not method:
        raise TypeError(f"{method!r} is not a control call of StageProtocol")
    return name


def _positional(method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's arguments in order (the wire carries positional arguments only)."""
    if not kwargs:
        return args
    bound = inspect.signature(method).bind(None, *args, **kwargs)
    return tuple(bound.args[1:])
