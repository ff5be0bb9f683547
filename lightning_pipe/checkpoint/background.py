"""`CheckpointWrites`: a process's checkpoint write, and what follows it; `BackgroundWrites`: while training goes on.

``PipeStrategy(async_checkpoint=True)``: a save copies its tensors to CPU memory and returns; the write runs in a
thread (DCP's ``async_save`` for a sharded folder, a thread of this process for one file). What must follow the write
(`then`: publish it, remove the checkpoint it replaces) runs when it completes, in order; the next save and the end of
``fit`` `wait` for it and raise its error there. A sharded part's copy is made in a thread too: what changes the saved
tensors next waits for it (`staged`), what changes sooner is copied at the save (`hold`); a save that a stage of this
process makes later is the write in flight from the moment it is asked for (`expect`). A synchronous save goes
through the same steps with a write that is already complete (docs/internals.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_pipe.base.errors import PipeError, PipeTimeoutError
from lightning_pipe.checkpoint.sharded import OptimizerPart, RandomStates, save_sharded, save_sharded_in_background
from lightning_pipe.checkpoint.staging import Staging
from lightning_pipe.weights.sources import PathLike

#: how long the next save or the end of fit waits for a write in flight (a collective's own timeout, 30 minutes
#: for the strategy's process groups, ends a write whose peer is gone before this does)
WRITE_TIMEOUT = timedelta(minutes=40)


class CheckpointWriteError(PipeError):
    """A checkpoint written in the background failed; raised at the next save or at the end of fit."""


class _Write:
    """One write and the steps that follow it (in order, once it completed, if it succeeded)."""

    def __init__(self, written: Future[Any], path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.steps: list[Callable[[], None]] = []
        self.written = False
        self.error: BaseException | None = None
        self.done = threading.Event()
        written.add_done_callback(self._on_written)

    def _on_written(self, written: Future[Any]) -> None:
        error = written.exception()
        with self.lock:
            self.written, steps, self.steps = True, self.steps, []
        self.error = error
        self._run(steps)
        self.done.set()

    def _run(self, steps: list[Callable[[], None]]) -> None:
        for step in steps:
            if self.error is not None:
                return  # the write or an earlier step failed: what follows it (a removal) must not run
            try:
                step()
            except BaseException as error:  # noqa: BLE001 - raised to the caller by `wait`
                self.error = error

    def then(self, step: Callable[[], None]) -> None:
        with self.lock:
            if not self.written:
                self.steps.append(step)
                return
        self.done.wait()  # the steps queued before run first
        self._run([step])


class CheckpointWrites:
    """This process's checkpoint writes, synchronous: each is complete when its save returns; then its steps run.

    `BackgroundWrites` runs them in the background instead; `writes_for` chooses, once.
    """

    #: whether a save returns before its part is written (the coordinator then need not wait for its processes)
    in_background: ClassVar[bool] = False

    def __init__(self) -> None:
        self._current: _Write | None = None
        self._expected: Future[Any] | None = None  # the write in flight that a stage of this process starts
        self._staged: Future[Any] | None = None  # the copy of the write in flight, made in the background

    def connect(self, group: Callable[[], Any]) -> None:
        """The processes joined: ``group`` makes the process group for writes in the background (unused here)."""

    def stage(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What the write of ``checkpoint`` reads: the checkpoint itself (it is written before training goes on)."""
        return checkpoint

    def hold(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """What the write reads of ``tensors``, which training changes before the next optimizer step: as they are
        (the write is complete before training goes on)."""
        return tensors

    def save_sharded(self, path: PathLike, model: dict[str, Any], optimizers: list[OptimizerPart],
                     extra: dict[str, Any] | None, random: RandomStates | None = None) -> None:  # fmt: skip
        """This process's part of the folder ``path`` (`lightning_pipe.checkpoint.sharded.save_sharded`);
        ``random``: its stages' generator states."""
        try:
            save_sharded(path, model, optimizers, extra, random=random)
        except BaseException as error:
            self.not_begun(error)
            raise
        written: Future[Any] = Future()
        written.set_result(None)
        self._begun(written, Path(path))

    def expect(self, path: PathLike) -> None:
        """A save that a stage of this process starts later (one posted to it): the write in flight from now on, so
        what `then` adds follows it; the stage's `save_sharded` fulfils it (`before_save` does not wait for it)."""
        written: Future[Any] = Future()
        self.started(written, Path(path))
        self._expected = written

    def before_save(self) -> None:
        """Before this process's part of a save: the write before it done (not one that this save fulfils)."""
        if self._expected is None:
            self.wait()

    def staged(self) -> None:
        """Before training changes the saved tensors (an optimizer step, a state loaded): the copy made."""
        staged, self._staged = self._staged, None
        if staged is not None:  # a copy that failed fails the write: raised at the next `wait`
            futures.wait([staged], timeout=WRITE_TIMEOUT.total_seconds())

    def _begun(self, written: Future[Any], path: Path) -> None:
        """This process's part of the save of ``path`` began (``written``: its write)."""
        expected, self._expected = self._expected, None
        if expected is None:
            self.started(written, path)
            return

        def fulfil(done: Future[Any]) -> None:
            error = done.exception()
            if error is None:
                expected.set_result(done.result())
            else:
                expected.set_exception(error)

        written.add_done_callback(fulfil)

    def not_begun(self, error: BaseException) -> None:
        """This process's part of a save failed before its write began: the write expected of it fails too."""
        expected, self._expected = self._expected, None
        if expected is not None:
            expected.set_exception(error)

    def run(self, write: Callable[[], None], path: Path) -> None:
        """Run ``write`` (of the checkpoint at ``path``)."""
        write()
        self.completed(path)

    def started(self, written: Future[Any], path: Path) -> None:
        """A write of the checkpoint at ``path`` began (``written`` completes when it is written)."""
        self._current = _Write(written, path)

    def completed(self, path: Path) -> None:
        """A write of ``path`` that already completed: its steps run at once."""
        written: Future[Any] = Future()
        written.set_result(None)
        self.started(written, path)

    def then(self, step: Callable[[], None]) -> None:
        """Run ``step`` after the write in flight and the steps before it (now, where none is in flight)."""
        current = self._current
        if current is None:
            step()
        else:
            current.then(step)

    def wait(self) -> None:
        """Until the write in flight and its steps are done; its error, raised once."""
        current, self._current = self._current, None
        if current is None:
            return
        if not current.done.wait(WRITE_TIMEOUT.total_seconds()):
            raise PipeTimeoutError(
                f"the checkpoint {current.path} was still being written after {WRITE_TIMEOUT}; its write in the "
                "background hangs (a process of the run gone?)"
            )
        if current.error is not None:
            raise CheckpointWriteError(
                f"writing the checkpoint {current.path} failed: {type(current.error).__name__}: {current.error}; "
                "the checkpoint that was at that path before is still there"
            ) from current.error

    def finish(self, error: BaseException | None = None) -> None:
        """A fit ends: its last write done and published (`wait`), or after ``error`` left to finish (`abandon`);
        then what the writes kept between saves is released (`release`)."""
        try:
            if error is None:
                self.wait()
            else:
                self.abandon()
        finally:
            self.release()

    def release(self) -> None:
        """Release what the writes keep from one save to the next (nothing here)."""

    def abandon(self) -> None:
        """After a failed fit: the write in flight is left to finish by itself (a peer it waits for may be gone);
        it is published only if it completes."""
        self._current = self._expected = None


class BackgroundWrites(CheckpointWrites):
    """Writes in the background (``async_checkpoint``): a save copies its tensors to CPU memory and returns; a thread
    writes them (DCP's ``async_save`` for a sharded folder, over ``group``: a gloo group that nothing else uses, so
    its collectives never interleave with another thread's on one group). A sharded folder's copy is made in a thread
    too, into the buffers of the save before it (`Staging`), kept until `release`; `staged` waits for it."""

    in_background = True

    def __init__(self) -> None:
        super().__init__()
        self.group: Any = None
        self.staging = Staging()

    @override
    def connect(self, group: Callable[[], Any]) -> None:
        self.group = group()

    @override
    def stage(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with a copy of each tensor in CPU memory, which training goes on without touching."""
        staged: dict[str, Any] = _copied(checkpoint)
        return staged

    @override
    def hold(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``tensors`` (small: buffers, the coordinator's own tensors), made now."""
        copied: dict[str, Any] = _copied(tensors)
        return copied

    @override
    def save_sharded(self, path: PathLike, model: dict[str, Any], optimizers: list[OptimizerPart],
                     extra: dict[str, Any] | None, random: RandomStates | None = None) -> None:  # fmt: skip
        try:
            written, self._staged = save_sharded_in_background(
                path, model, optimizers, extra, self.group, self.staging.stager(), random
            )
        except BaseException as error:
            self.not_begun(error)
            raise
        self._begun(written, Path(path))

    @override
    def release(self) -> None:
        self.staging.close()

    @override
    def run(self, write: Callable[[], None], path: Path) -> None:
        """Run ``write`` (of the checkpoint at ``path``) in a thread of its own."""
        written: Future[Any] = Future()

        def run() -> None:
            try:
                write()
            except BaseException as error:  # noqa: BLE001 - raised to the caller by `wait`
                written.set_exception(error)
            else:
                written.set_result(None)

        self.started(written, path)
        # not a daemon: the interpreter waits for a write in flight before it exits
        threading.Thread(target=run, name=f"lightning_pipe-checkpoint {path.name}").start()


def writes_for(in_background: bool) -> CheckpointWrites:
    """``PipeStrategy(async_checkpoint=...)``'s writes: in the background, or synchronous."""
    return BackgroundWrites() if in_background else CheckpointWrites()


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists, tuples) copied to CPU memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _copied(v)) for k, v in value.items())  # an OrderedDict stays one
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_copied(v) for v in value)
    return value
