"""Running an unmodified Lightning step once per microbatch around the pipeline.

Each microbatch's step runs in a driver thread that stops at the pipelined call, so all inputs reach the
pipeline before the first output is needed; the pipeline starts on microbatch 0 as soon as its step reaches
the call (`StepInputs`). One driver runs user code at a time, in microbatch order before the call and after
it, so ``self.log`` and other side effects happen as in a plain loop. The threads are kept between steps
(`DriverThreads`). An example step: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from lightning_pipe.base.errors import PipeError, PipeTimeoutError
from lightning_pipe.strategy.outputs import weighted_mean
from lightning_pipe.strategy.patch import Patches

_current = threading.local()
TAKE_WAIT = 2.0  # seconds a driver handed to a thread may wait for it (a new thread: while it starts)
JOIN_WAIT = 10.0  # seconds `DriverThreads.close` waits for the idle threads it ends


class _Abandon(BaseException):
    """Raised inside a driver thread to unwind user code when the step is abandoned."""


class MissingCall(PipeError):
    """The step finished without calling the pipelined module."""


class DriverThreads:
    """Threads that run drivers, one driver at a time each, kept for the next step until `close`.

    A thread whose driver never ends (abandoned while the user's code blocks) is simply not reused.
    `close` joins every thread it ends: a daemon thread still alive when the interpreter exits is stopped
    where it next takes the GIL, and inside torch's C++ that aborts the process ("terminate called
    without an active exception").
    """

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep  # False: each thread ends with its driver
        self._idle: list[tuple[queue.SimpleQueue[Driver | None], threading.Thread]] = []
        self._lock = threading.Lock()
        self._generation = 0  # counts closes: a thread started before the last close ends after its driver

    def run(self, driver: Driver) -> None:
        with self._lock:
            idle = self._idle.pop() if self._idle else None
        if idle is not None:
            idle[0].put(driver)
            return
        jobs: queue.SimpleQueue[Driver | None] = queue.SimpleQueue()
        jobs.put(driver)  # before the thread starts: a Ctrl-C in `Thread.start`'s wait leaves the driver to it
        args = (jobs, self._generation)
        threading.Thread(target=self._serve, args=args, name="lightning_pipe-microbatch", daemon=True).start()

    def close(self, timeout: float = JOIN_WAIT) -> None:
        """End the idle threads and join them (a later `run` starts new ones); a thread still running a
        driver ends after it (not waited for: its user code may block)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._generation += 1
        for jobs, _ in idle:
            jobs.put(None)
        until = time.monotonic() + timeout
        for _, thread in idle:
            thread.join(max(0.0, until - time.monotonic()))

    def _serve(self, jobs: queue.SimpleQueue[Driver | None], generation: int) -> None:
        thread = threading.current_thread()
        while (driver := jobs.get()) is not None:
            driver.taken.set()
            thread.name = f"lightning_pipe-microbatch-{driver.index}"
            try:
                driver.run()
            finally:
                with self._lock:
                    kept = self.keep and generation == self._generation
                    if kept:  # idle again before the driver counts as ended: the next step reuses this thread
                        self._idle.append((jobs, thread))
                driver.ended.set()
            if not kept:
                return


class Driver:
    """One microbatch's step in a thread of its own (`DriverThreads`), resumed by the caller like a coroutine."""

    def __init__(
        self,
        fn: Callable[[], Any],
        index: int,
        context: Callable[[], AbstractContextManager[Any]],
        timeout: float,
        turn: threading.Lock | None = None,
        threads: DriverThreads | None = None,
    ) -> None:
        self.index = index
        self._threads = threads if threads is not None else DriverThreads(keep=False)
        self._turn = turn if turn is not None else threading.Lock()  # held while this step's user code runs
        self._fn = fn
        self._context = context
        self._timeout = timeout
        self._to_driver: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._to_caller: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._grad = torch.is_grad_enabled()
        self._inference = torch.is_inference_mode_enabled()
        self._started = False
        self.taken = threading.Event()  # a thread took it
        self.ended = threading.Event()  # its thread left the step
        self.calls = 0
        self.finished = False
        self.result: Any = None

    # caller side
    def start(self) -> tuple[str, Any]:
        """Run until the step calls the pipelined module (``("call", (args, kwargs))``) or returns."""
        with self._turn:
            self._started = True
            self._threads.run(self)
            return self._wait()

    def resume(self, value: Any) -> tuple[str, Any]:
        """Hand the pipeline's output to the step and run it to its next call or its end."""
        with self._turn:
            self._to_driver.put(("value", value))
            return self._wait()

    def abandon(self) -> None:
        """Unwind a driver that is waiting inside the pipelined call; joins its thread.

        A driver that no thread took within `TAKE_WAIT` seconds is not waited for: a Ctrl-C interrupted its
        hand-off before the thread started. Should a thread take it later, it stops at its pipelined call.
        """
        if not self._started:
            return
        if not self.ended.is_set() and not self.finished:
            self._to_driver.put(("abandon", None))
        if self.taken.wait(min(self._timeout, TAKE_WAIT)):
            self.ended.wait(self._timeout)

    def _wait(self) -> tuple[str, Any]:
        try:
            kind, value = self._to_caller.get(timeout=self._timeout)
        except queue.Empty:
            raise PipeTimeoutError(
                f"microbatch {self.index}'s step did not reach the pipelined call or its end within "
                f"{self._timeout:.1f} s"
            ) from None
        if kind == "raise":
            self.finished = True
            raise value
        if kind == "return":
            self.finished = True
            self.result = value
        return kind, value

    # driver side
    def run(self) -> None:
        """The step, in a thread of `DriverThreads` (which sets `ended` after it)."""
        _current.driver = self
        try:
            with torch.inference_mode(self._inference) if self._inference else _nothing():
                with torch.set_grad_enabled(self._grad), self._context():
                    result = self._fn()
            self._to_caller.put(("return", result))
        except _Abandon:
            self._to_caller.put(("return", None))
        except BaseException as exc:  # handed to the caller, re-raised there with this traceback
            self._to_caller.put(("raise", exc.with_traceback(sys.exc_info()[2])))
        finally:
            _current.driver = None

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Inside the step: hand the pipelined call to the caller and wait for its output."""
        self.calls += 1
        self._to_caller.put(("call", (args, kwargs)))
        kind, value = self._to_driver.get()
        if kind == "abandon":
            raise _Abandon
        return value


def current_driver() -> Driver | None:
    """The driver whose thread is running, if the pipelined module is called from a step."""
    return getattr(_current, "driver", None)


def capture_call(
    lightning_module: Any, pipelined: Any, batch: Any, timeout: float
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run ``training_step`` on ``batch`` until it calls ``pipelined``; return that call's arguments."""

    def capture(*args: Any, **kwargs: Any) -> Any:
        driver = current_driver()
        assert driver is not None
        return driver.call(args, kwargs)

    driver = Driver(lambda: lightning_module.training_step(batch, 0), 0, contextlib.nullcontext, timeout)
    patches = Patches()  # a driver of its own (once per plan): a thread of its own
    patches.set(pipelined, "forward", capture)
    patches.set(lightning_module, "log", lambda *args, **kwargs: None)
    try:
        kind, value = driver.start()
    finally:
        driver.abandon()
        patches.restore()
    if kind == "return":
        raise MissingCall("training_step returned without calling the pipelined module; nothing to plan")
    args, kwargs = value
    return args, kwargs


class StepInputs(Sequence[Any]):
    """The pipeline's inputs of a step, ``make(i)`` of each taken when the pipeline first needs it.

    Feeding the pipeline in order, the first stage computes microbatch 0 while the later
    microbatches' steps still run up to their pipelined call.
    """

    def __init__(self, count: int, make: Callable[[int], Any], made: Sequence[Any] = ()) -> None:
        self._count = count
        self._make = make
        self._made = list(made)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        position = index + self._count if index < 0 else index
        if not 0 <= position < self._count:
            raise IndexError(f"microbatch {index} of {self._count}")
        while len(self._made) <= position:
            self._made.append(self._make(len(self._made)))
        return self._made[position]


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class LogRecorder:
    """Collects ``self.log`` calls of each microbatch and logs each name once, weighted by microbatch."""

    def __init__(self, log: Callable[..., Any], weights: Sequence[float]) -> None:
        self._log = log
        self._weights = weights  # each microbatch's share of the batch (rows, or microbatch_weight)
        self._calls: dict[str, list[tuple[Any, float, dict[str, Any]]]] = {}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("PipeStrategy: pass self.log options by keyword (prog_bar=True, on_epoch=True, ...)")
        driver = current_driver()
        weight = self._weights[driver.index] if driver is not None else 1.0
        self._calls.setdefault(name, []).append((value, weight, kwargs))

    def flush(self) -> None:
        """Log the weighted mean of each name's values (a metric object is logged once, as is)."""
        for name, calls in self._calls.items():
            values = [v for v, _, _ in calls]
            kwargs = calls[-1][2]
            if all(_is_number(v) for v in values):
                self._log(name, weighted_mean([_as_tensor(v) for v in values], [w for _, w, _ in calls]), **kwargs)
            else:
                self._log(name, values[-1], **kwargs)
        self._calls.clear()


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().float().reshape(())
    return torch.tensor(float(value))
