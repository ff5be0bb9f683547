"""`CoordinatorMessages`: the coordinator's side of the endpoint: calls and posts, waits, stage errors, aborts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_pipe.comm.base import Communicator, Endpoint, Message, MessageKind, deadline, remaining
from lightning_pipe.errors import PipeTimeoutError, StageError

Key = tuple[str, int, int]  # (kind, stage, microbatch)
_POLL = 1.0  # seconds between liveness checks while waiting


class CoordinatorMessages:
    """Base of `Coordinator`: sends to the ranks and waits for their messages, each wait with a timeout."""

    communicator: Communicator
    timeout: float
    num_ranks: int
    _endpoint: Endpoint | None
    _step: int
    _pending: dict[Key, Message]
    _posted: bool  # calls were posted since the last reply of every rank
    _raised_posts: int  # failures of calls posted up to this step number are raised already (or dropped)

    @property
    def endpoint(self) -> Endpoint:
        if self._endpoint is None:
            raise RuntimeError("the pipeline is not started; call start() or use it as a context manager")
        return self._endpoint

    def call(self, name: str, *args: Any, each: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """Run ``StageWorker.call_<name>(*args)`` on every rank; returns their results in rank order.

        With ``each``, rank ``r`` gets ``*args, *each[r]``: what only that rank needs. A rank runs it
        after everything posted to it before (`post`), and a posted call that failed is raised here.
        """
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

    def post(self, name: str, *args: Any, each: Sequence[tuple[Any, ...]] | None = None) -> None:
        """Send ``StageWorker.call_<name>(*args)`` to every rank without waiting for it (same arguments as `call`).

        Each rank runs what the coordinator sends it in order, so a later call or step sees the
        posted call's effect. A rank answers only if the call failed; the coordinator raises that
        `StageError` (the rank, the call, its traceback) at its next wait of any kind: a call's
        reply, a step's messages. Only the first failure of the calls posted until then is raised.
        `close` does not wait for posted calls: a failure that arrives later is not raised (`flush`
        waits for them, as leaving a ``with`` block without an error does).
        """
        self._send_call(MessageKind.POST, name, args, each)
        self._posted = True

    def flush(self) -> None:
        """Wait until every rank ran the calls posted so far; raises the first that failed."""
        if self._posted:
            self.call("ping")

    def _send_call(self, kind: str, name: str, args: tuple[Any, ...], each: Sequence[tuple[Any, ...]] | None) -> int:
        self._step += 1
        for rank in range(self.num_ranks):
            rank_args = args + tuple(each[rank]) if each is not None else args
            self.endpoint.send(rank, Message(kind, self._step, payload=(name, rank_args)))
        return self._step

    def _wait(self, step: int, kind: str, stage: int, microbatch: int, pop: bool = True) -> Message:
        key = (kind, stage, microbatch)
        while key not in self._pending:
            self._store(self._next(step, _describe(kind, stage, microbatch)))
        return self._pending.pop(key) if pop else self._pending[key]

    def _store(self, message: Message) -> None:
        if message.kind == MessageKind.DONE:
            self._pending[(message.kind, -1, message.source)] = message
        else:
            self._pending[(message.kind, message.stage, message.microbatch)] = message

    def _next(self, step: int, what: str) -> Message:
        """Next message of this step; raises a stage's error, or a timeout naming what was awaited."""
        until = deadline(self.timeout)
        while True:
            message = self.endpoint.recv(min(_POLL, remaining(until)))
            if message is None:
                self.communicator.check_alive()
                if remaining(until) <= 0:
                    raise PipeTimeoutError(
                        f"the coordinator waited {self.timeout:.1f} s for {what}; "
                        "raise PipeStrategy(timeout=...) if a stage legitimately takes that long"
                    )
                continue
            if message.kind == MessageKind.POST_FAILED:  # whatever step this is: a posted call failed
                if message.step > self._raised_posts:  # else posted before a failure that was raised
                    self._raised_posts = self._step
                    raise message.payload
                continue
            if message.step != step:
                continue  # left over from an aborted step
            if message.kind == MessageKind.ERROR:
                error: StageError = message.payload
                raise error
            return message

    def _abort(self, step: int) -> None:
        if self._endpoint is None:
            return
        for rank in range(self.num_ranks):
            self._endpoint.send(rank, Message(MessageKind.ABORT, step))
        self._pending.clear()


def _describe(kind: str, stage: int, microbatch: int) -> str:
    if kind == MessageKind.DONE:
        return f"rank {microbatch} to finish the step"
    if kind == MessageKind.OUTPUT:
        return f"the output of microbatch {microbatch} from the last stage ({stage})"
    if kind == MessageKind.INPUT_GRAD:
        return f"the input gradient of microbatch {microbatch} from stage 0"
    return f"{kind} of microbatch {microbatch} from stage {stage}"
