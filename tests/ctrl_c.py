"""Ctrl-C as a terminal sends it, at chosen points of a run; stage worker processes import this module.

A test that sends SIGINT relies on Python's handler (SIGINT raises KeyboardInterrupt in the main
thread), which a process has only where SIGINT had its default disposition when it started: a
background job of a non-interactive shell, ``nohup`` and some CI runners start the tests with SIGINT
ignored. `sigint_raises` installs the handler for the test's duration and puts back the one it found.
Processes started meanwhile get SIGINT's default disposition (a handler does not survive ``exec``),
so a launched run started by the test takes Ctrl-C as in a terminal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import torch
from torch import nn


class Interrupts:
    """Python's own SIGINT handler (`signal.default_int_handler`: raise KeyboardInterrupt), noting when each came."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.times.append(time.monotonic())
        signal.default_int_handler(signum, frame)  # type: ignore[arg-type]

    def since_last(self) -> float:
        """Seconds since the last SIGINT arrived."""
        assert self.times, "no SIGINT arrived"
        return time.monotonic() - self.times[-1]


@contextlib.contextmanager
def sigint_raises() -> Iterator[Interrupts]:
    """SIGINT raises KeyboardInterrupt in this process within the block, whatever handler was there before."""
    handler = Interrupts()
    found = signal.signal(signal.SIGINT, handler)
    try:
        yield handler
    finally:
        # None: a handler that was not installed from Python; the default is the nearest we can restore
        signal.signal(signal.SIGINT, found if found is not None else signal.SIG_DFL)


def press_ctrl_c(pids: list[int]) -> None:
    """SIGINT to each of ``pids`` and this process, as a terminal's Ctrl-C reaches its whole foreground group."""
    for pid in dict.fromkeys([*pids, os.getpid()]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)


class CtrlCAt(nn.Module):
    """The identity in a stage; once ``armed``, presses Ctrl-C (`press_ctrl_c` to ``pid``, the coordinator's
    process, and to the process it runs in) when ``when`` happens:

    - ``"build"``: the stage is placed on its device (the pipeline is being built);
    - ``"forward"``: its ``call``-th training forward after arming (``call=1``: the first step; more: mid-step);
    - ``"state"``: its state is read (a checkpoint being written gathers the stages' state).

    It disarms itself after pressing; in another process (transport="rpc") it is a copy, so the test
    sets ``armed`` on its own object for each fit.
    """

    def __init__(self, when: str, pid: int, call: int = 1) -> None:
        super().__init__()
        self.when, self.pid, self.call = when, pid, call
        self.armed, self.calls = False, 0
        self.scale = nn.Parameter(torch.ones(()))  # a stage needs something to train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.when == "forward" and self.armed and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.call:
                self._press()
        return x * self.scale

    def _apply(self, fn: object, recurse: bool = True) -> CtrlCAt:  # type: ignore[override]
        if self.when == "build":
            self._press()
        return super()._apply(fn, recurse)  # type: ignore[arg-type]

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if self.when == "state":
            self._press()
        return super().state_dict(*args, **kwargs)  # type: ignore[arg-type]

    def _press(self) -> None:
        if self.armed:
            self.armed, self.calls = False, 0
            press_ctrl_c([self.pid])
