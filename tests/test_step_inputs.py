"""The pipeline starts on microbatch 0 while later microbatches' steps still run up to their call;
the user's step code still runs one microbatch at a time, in order, with weighted ``self.log``."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, dataset, loader, mlp
from torch import nn

from lightning_pipe import PipeStrategy
from lightning_pipe.strategy.session import Driver, DriverThreads, StepInputs


class _Signal(nn.Module):
    """Sets ``event`` whenever the first stage computes (the pipeline has started a microbatch)."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__()
        self.event = event

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.event.set()
        return x


class WaitsForThePipeline(Classifier):
    """Microbatch 1's step waits (bounded) for the first stage to have started microbatch 0."""

    def __init__(self) -> None:
        self.started = threading.Event()
        super().__init__(nn.Sequential(_Signal(self.started), *mlp()))
        self.seen: list[bool] = []
        self.microbatch = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.started.clear()
        self.microbatch = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.microbatch == 1:  # eagerly started steps would wait here in vain: nothing fed yet
            self.seen.append(self.started.wait(timeout=5))
        self.microbatch += 1
        return F.cross_entropy(self.model(x), y)


def test_first_stage_starts_before_later_microbatches_reach_their_call() -> None:
    model = WaitsForThePipeline()
    strategy = PipeStrategy(stages=2, microbatches=4, partition=[3, 5])
    trainer = L.Trainer(strategy=strategy, max_steps=3, **QUIET)
    trainer.fit(model, loader(batch_size=16))
    assert model.seen == [True, True, True]


class OneAtATime(Classifier):
    """Slow code before the call; records how many microbatches' code runs at once, and the order."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.most = 0
        self.order: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def _enter(self, part: str, index: int) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.order.append((part, index))

    def _leave(self) -> None:
        with self._lock:
            self.running -= 1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        index = int(x[0, -1].item())  # the microbatch's index, written into the data
        self._enter("before", index)
        time.sleep(0.02)  # long enough for microbatch 0's loss to be due meanwhile
        self._leave()
        out = self.model(x)
        self._enter("after", index)
        loss = F.cross_entropy(out, y)
        self.log("marker", float(index))
        self._leave()
        return loss


def test_user_code_runs_one_microbatch_at_a_time_in_order(tmp_path: Any) -> None:
    data = dataset(rows=32)
    rows = torch.arange(32, dtype=torch.float32) // 4  # microbatch index of each row (4 rows each, 8 mbs)
    data.tensors[0][:, -1] = rows
    model = OneAtATime()
    logged: list[float] = []

    class Catch(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            logged.append(float(trainer.callback_metrics["marker"]))

    strategy = PipeStrategy(stages=2, microbatches=8, partition=[3, 4])
    trainer = L.Trainer(strategy=strategy, max_steps=1, callbacks=[Catch()], **QUIET)
    trainer.fit(model, loader(data, batch_size=32))
    assert model.most == 1
    befores = [i for part, i in model.order if part == "before"]
    afters = [i for part, i in model.order if part == "after"]
    assert befores == list(range(8)) and afters == list(range(8))
    # some microbatch's loss ran before the last microbatch reached its call: the steps overlapped the pipeline
    assert model.order.index(("after", 0)) < model.order.index(("before", 7))
    # self.log is the mean over microbatches weighted by rows (equal here): mean of 0..7
    assert logged == [pytest.approx(3.5)]


def test_step_inputs_makes_each_input_once_in_order() -> None:
    made: list[int] = []

    def make(i: int) -> int:
        made.append(i)
        return i * 10

    inputs = StepInputs(4, make, [0])
    assert len(inputs) == 4
    assert inputs[2] == 20 and made == [1, 2]
    assert list(inputs) == [0, 10, 20, 30] and made == [1, 2, 3]
    assert inputs[-1] == 30 and inputs[1:3] == [10, 20]
    with pytest.raises(IndexError):
        inputs[4]


def test_error_before_a_later_microbatchs_call_aborts_the_running_step() -> None:
    class FailsOnce(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.microbatch = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.microbatch += 1
            if self.microbatch == 4:  # the first step's last microbatch, after the pipeline started
                raise ValueError("bad microbatch")
            return F.cross_entropy(self.model(x), y)

    model = FailsOnce()
    strategy = PipeStrategy(stages=2, microbatches=4, partition=[3, 4])
    with pytest.raises(ValueError, match="bad microbatch"):
        L.Trainer(strategy=strategy, max_steps=1, **QUIET).fit(model, loader(batch_size=16))
    # nothing is left running (the autouse fixture checks threads); the model trains on afterwards
    trainer = L.Trainer(strategy=PipeStrategy(stages=2, microbatches=4, partition=[3, 4]), max_steps=2, **QUIET)
    trainer.fit(model, loader(batch_size=16))
    assert trainer.global_step == 2


def test_driver_threads_are_kept_between_steps_and_end_on_close() -> None:
    threads = DriverThreads()
    seen: list[int] = []

    def step() -> int:
        seen.append(threading.get_ident())
        return len(seen)

    for _ in range(3):  # three steps of one microbatch: one thread runs them all
        driver = Driver(step, 0, contextlib.nullcontext, timeout=10.0, threads=threads)
        assert driver.start() == ("return", len(seen))
        driver.abandon()
    assert len(seen) == 3 and len(set(seen)) == 1
    threads.close()
    deadline = time.monotonic() + 10
    while any(t.ident == seen[0] for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.ident == seen[0] for t in threading.enumerate()), "close ends the idle threads"
