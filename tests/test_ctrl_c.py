"""Ctrl-C at any point of a fit or a `Pipeline` step: the run stops within seconds, leaves no thread or
process behind, and the next fit in the same process works (local and rpc mode; launched mode in
test_launched_exits.py).

Each test installs Python's SIGINT handler for its own duration (`ctrl_c.sigint_raises`): the suite
may run with SIGINT ignored (a background job of a script, ``nohup``). Lightning turns a
KeyboardInterrupt in ``fit`` into ``SystemExit(1)`` after its graceful shutdown; a `Pipeline` lets it
through.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from ctrl_c import CtrlCAt, Interrupts, press_ctrl_c, sigint_raises
from helpers import QUIET, Classifier, dataset, loader
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from processes import leftover_processes
from torch import nn

from lightning_pipe import Pipeline, PipeStrategy
from lightning_pipe.strategy.session import TAKE_WAIT, Driver, DriverThreads, current_driver

STOPPED_WITHIN = 10.0  # seconds from the Ctrl-C to fit's return ("a few seconds", on a loaded 2-core machine)
STEPS = 3

pytestmark = pytest.mark.timed  # bounds waits by the clock: alone under xdist (tests/machine_share.py)


@pytest.fixture(autouse=True)
def interrupts() -> Iterator[Interrupts]:
    with sigint_raises() as handler:
        yield handler


class CtrlCBetweenSteps(Callback):
    """Presses Ctrl-C after training batch ``batch`` (while armed)."""

    def __init__(self, batch: int) -> None:
        self.batch, self.armed = batch, False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.armed and trainer.global_step == self.batch:
            self.armed = False
            press_ctrl_c([])


def net(trigger: CtrlCAt) -> Classifier:
    torch.manual_seed(0)
    return Classifier(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), trigger, nn.Linear(16, 3)))


def fit(module: Classifier, transport: str, callbacks: list[Callback], tmp_path: Path | None = None) -> L.Trainer:
    strategy = PipeStrategy(stages=2, microbatches=4, partition=[2, 2], transport=transport, timeout=60)
    options: dict[str, Any] = dict(QUIET, max_steps=STEPS, strategy=strategy, callbacks=callbacks)
    if tmp_path is not None:  # a checkpoint after every step
        options["enable_checkpointing"] = True
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1))
    trainer = L.Trainer(**options)
    trainer.fit(module, loader(dataset(rows=64), 16))
    return trainer


def interrupted_fit(module: Classifier, transport: str, callbacks: list[Callback], interrupts: Interrupts,
                    tmp_path: Path | None = None) -> None:  # fmt: skip
    """A fit that Ctrl-C stops: within seconds, no process left, and SIGINT raises again afterwards."""
    with pytest.raises(SystemExit):
        fit(module, transport, callbacks, tmp_path)
    assert interrupts.times, "the Ctrl-C was never pressed"
    stopped = interrupts.since_last()
    assert stopped < STOPPED_WITHIN, f"fit returned {stopped:.1f} s after the Ctrl-C"
    assert leftover_processes() == [], "worker processes left behind"
    assert signal.getsignal(signal.SIGINT) is interrupts, "Ctrl-C no longer raises after the interrupted fit"


def next_fit_works(module: Classifier, transport: str) -> None:
    before = [p.detach().clone() for p in module.parameters()]
    trainer = fit(module, transport, [])
    assert trainer.global_step == STEPS and not trainer.interrupted
    assert any(not torch.equal(p, q) for p, q in zip(module.parameters(), before, strict=True))
    assert leftover_processes() == []


# local mode: each point in a test of its own


@pytest.mark.parametrize(
    "when, call", [("build", 1), ("forward", 1), ("forward", 3)], ids=["building", "first-step", "mid-step"]
)
def test_ctrl_c_in_a_local_fit_stops_it_and_the_next_fit_works(when: str, call: int, interrupts: Interrupts) -> None:
    trigger = CtrlCAt(when, os.getpid(), call)
    module = net(trigger)
    trigger.armed = True
    interrupted_fit(module, "local", [], interrupts)
    trigger.armed = False
    next_fit_works(module, "local")


def test_ctrl_c_between_local_steps(interrupts: Interrupts) -> None:
    between = CtrlCBetweenSteps(batch=1)
    module = net(CtrlCAt("never", os.getpid()))
    between.armed = True
    interrupted_fit(module, "local", [between], interrupts)
    next_fit_works(module, "local")


def test_ctrl_c_while_a_local_checkpoint_is_written(interrupts: Interrupts, tmp_path: Path) -> None:
    trigger = CtrlCAt("state", os.getpid())
    module = net(trigger)
    trigger.armed = True
    interrupted_fit(module, "local", [], interrupts, tmp_path)
    trigger.armed = False
    next_fit_works(module, "local")


def test_ctrl_c_after_earlier_local_fits(interrupts: Interrupts) -> None:
    """A notebook: a fit, then a fit stopped by Ctrl-C mid-step, then another Ctrl-C at the next build, then a fit."""
    trigger = CtrlCAt("forward", os.getpid(), call=3)
    module = net(trigger)
    fit(module, "local", [])
    trigger.armed = True
    interrupted_fit(module, "local", [], interrupts)
    trigger.when, trigger.armed = "build", True
    interrupted_fit(module, "local", [], interrupts)
    trigger.armed = False
    assert len(interrupts.times) == 2
    next_fit_works(module, "local")


# transport="rpc": every point in one process, one fit after another (each fit starts its worker processes)


@pytest.mark.slow
def test_ctrl_c_at_every_point_of_rpc_fits_after_an_earlier_fit(interrupts: Interrupts, tmp_path: Path) -> None:
    """A fit; then fits that Ctrl-C stops while building, in the first step, between steps and while a checkpoint
    is written (each one builds and steps after the Ctrl-C before it); then a fit that works. Mid-step in a later
    step: `test_rpc_faults.py::test_ctrl_c_mid_step_stops_every_worker` (one rpc fit less here)."""
    trigger = CtrlCAt("never", os.getpid())
    module = net(trigger)
    fit(module, "rpc", [])
    for when, call in [("build", 1), ("forward", 1)]:
        trigger.when, trigger.call, trigger.armed = when, call, True
        interrupted_fit(module, "rpc", [], interrupts)
    trigger.when, trigger.armed = "never", False
    between = CtrlCBetweenSteps(batch=1)
    between.armed = True
    interrupted_fit(module, "rpc", [between], interrupts)
    trigger.when, trigger.armed = "state", True
    interrupted_fit(module, "rpc", [], interrupts, tmp_path)
    assert len(interrupts.times) == 4
    trigger.armed = False
    next_fit_works(module, "rpc")


# a Pipeline without Lightning (transport="rpc" mid-step: test_rpc_faults.py)


@pytest.mark.parametrize(
    "transport, when, call",
    [("local", "build", 1), ("local", "forward", 3), pytest.param("rpc", "build", 1, marks=pytest.mark.slow)],
    ids=["local-building", "local-mid-step", "rpc-building"],
)
def test_ctrl_c_in_a_pipeline(transport: str, when: str, call: int, interrupts: Interrupts) -> None:
    """The KeyboardInterrupt leaves the ``with Pipeline(...)`` block, which stops the stages; the next one works."""
    trigger = CtrlCAt(when, os.getpid(), call)
    model = nn.Sequential(nn.Linear(8, 8), trigger, nn.Linear(8, 3))
    x, y = torch.randn(16, 8), torch.zeros(16, dtype=torch.long)
    trigger.armed = True
    with pytest.raises(KeyboardInterrupt):
        with Pipeline(model, stages=2, partition=[1, 2], transport=transport, timeout=60) as pipe:
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
    assert interrupts.since_last() < STOPPED_WITHIN
    assert leftover_processes() == []
    trigger.armed = False
    with Pipeline(model, stages=2, partition=[1, 2], transport=transport, timeout=60) as pipe:
        losses = pipe.train_step(x, y, F.cross_entropy, microbatches=4).losses
    assert len(losses) == 4 and all(torch.isfinite(torch.as_tensor(loss)) for loss in losses)
    assert leftover_processes() == []


# a hand-off that Ctrl-C can interrupt: the main thread waits in `Thread.start` for a microbatch's thread


@pytest.mark.parametrize("started", [True, False], ids=["thread-started", "thread-never-started"])
def test_ctrl_c_while_a_microbatch_thread_starts(started: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver is not lost: abandoning it ends at once (its thread took it) or after `TAKE_WAIT` (none
    did), and no thread is left waiting for a driver that never comes."""
    start = threading.Thread.start

    def interrupted(thread: threading.Thread) -> None:
        if started:
            start(thread)
        raise KeyboardInterrupt  # as the handler raises it in `Thread.start`'s wait

    def step() -> None:
        driver = current_driver()
        assert driver is not None
        driver.call((), {})  # the pipelined call: waits for its output

    threads = DriverThreads()
    driver = Driver(step, 0, contextlib.nullcontext, timeout=60, threads=threads)
    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        driver.start()
    monkeypatch.undo()
    begin = time.monotonic()
    driver.abandon()
    assert time.monotonic() - begin < TAKE_WAIT + 5
    assert driver.ended.is_set() == started
    threads.close()  # the conftest fixture fails the test if a microbatch thread is left
