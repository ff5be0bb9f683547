"""``schedule="async"`` with a weight that two stages hold (a tied embedding and output head), under forced timing.

The stage threads of the local transport share that one parameter. A test here does not hope for a bad
interleaving: `LandsDuringUpdate` makes it happen. Stage 0's backward of a chosen microbatch is held (a `Gate`
module) until stage 1 is inside its optimizer step, and stage 1's step is held open (a global optimizer
hook) until stage 0's gradient of that microbatch has landed on the shared weight. That is the timing a
loaded machine produced (``test_async_schedule_weights_its_microbatches`` drifted 1.7e-3 under
``pytest -n 12``): stage 1's update cleared stage 0's fresh gradient of the shared weight, or counted it
twice. The results must not depend on it.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, max_param_diff
from torch import nn
from torch.func import functional_call
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import Pipeline, PipeStrategy
from lightning_pipe.base.errors import StageError

VOCAB, WIDTH, PER_BATCH, LR = 11, 6, 4, 0.5
SPLIT = [3, 4]  # Embedding Linear Gate | Gate Linear Tanh Linear (its weight is the embedding's)


class _Hold(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hold: Callable[[], None]) -> torch.Tensor:
        ctx.hold = hold
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.hold()
        return grad, None


class Gate(nn.Module):
    """The identity; its backward first calls ``hold`` (a plain function: weight versions copy it as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold: Callable[[], None] = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Hold.apply(x, self.hold)


def tied_model(seed: int = 0) -> nn.Sequential:
    """Token ids -> logits; the output head's weight is the embedding's (one parameter in both stages)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), Gate(),
        Gate(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB),
    )  # fmt: skip
    model[6].weight = model[0].weight
    return model


def batches(count: int, rows: int = 8, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (rows,), generator=g), torch.randint(0, VOCAB, (rows,), generator=g))
            for _ in range(count)]  # fmt: skip


class Timeline:
    """Records each stage's backwards (through its `Gate`) and optimizer steps, in order; subclasses hold them."""

    def __init__(self, model: nn.Sequential) -> None:
        self.stage_only = {0: model[1].bias, 1: model[6].bias}  # a parameter only that stage's optimizer holds
        self.tied = model[0].weight
        self.cond = threading.Condition()
        self.events: list[tuple[str, int]] = []  # ("backward <stage>", microbatch), ("update <stage>", batch)
        model[2].hold = lambda: self._backward(0)  # stage 0's last module: the start of its backward
        model[3].hold = lambda: self._backward(1)  # stage 1's first module: the end of its backward

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.events)

    def _backward(self, stage: int) -> None:
        with self.cond:
            m = self.count(f"backward {stage}")
            self.events.append((f"backward {stage}", m))
            self.cond.notify_all()
        self.hold(stage, m)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for stage, p in self.stage_only.items():
            if id(p) in held:
                with self.cond:
                    self.events.append((f"update {stage}", self.count(f"update {stage}")))
                    self.cond.notify_all()
                self.updated(stage)

    def hold(self, stage: int, microbatch: int) -> None:
        """Called in ``stage``'s backward of ``microbatch``."""

    def updated(self, stage: int) -> None:
        """Called in ``stage``'s thread right after its optimizer stepped."""

    def __enter__(self) -> Timeline:
        self._handle = register_optimizer_step_post_hook(self._after_step)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()


class LandsDuringUpdate(Timeline):
    """Stage 0's backward of microbatch ``late`` of each batch waits until stage 1 is inside its update, which
    stays open until that gradient has landed on the shared weight (or ``patience`` seconds): the timing a
    loaded machine produced. ``landed`` counts the updates during which it did."""

    def __init__(self, model: nn.Sequential, late: int = 2, patience: float = 5.0) -> None:
        super().__init__(model)
        self.late, self.patience = late, patience
        self.landed = 0

    def hold(self, stage: int, microbatch: int) -> None:
        if stage == 0 and microbatch % PER_BATCH == self.late:
            with self.cond:
                self.cond.wait_for(lambda: self.count("update 1") > microbatch // PER_BATCH, timeout=self.patience)

    def updated(self, stage: int) -> None:
        if stage != 1:
            return
        before = self.tied.grad  # kept: its id cannot be reused while we compare
        mark = _mark(before)
        until = time.monotonic() + self.patience
        while _mark(self.tied.grad) == mark and time.monotonic() < until:
            time.sleep(0.001)
        self.landed += _mark(self.tied.grad) != mark
        del before


class Stage1RunsAhead(Timeline):
    """Stage 0's last backward of each batch but the last waits until stage 1 has begun the next batch's first
    backward (with one microbatch a batch: has updated the next batch), then 50 ms more: stage 1 hands over
    the next batch's gradients, or steps and waits for stage 0's update, before stage 0 updates."""

    def __init__(self, model: nn.Sequential, per_batch: int, batches: int = 3, patience: float = 5.0) -> None:
        super().__init__(model)
        self.per_batch, self.batches, self.patience = per_batch, batches, patience

    def hold(self, stage: int, microbatch: int) -> None:
        batch, index = divmod(microbatch, self.per_batch)
        if stage != 0 or index != self.per_batch - 1 or batch == self.batches - 1:
            return
        kind, count = (
            ("update 1", batch + 2) if self.per_batch == 1 else ("backward 1", (batch + 1) * self.per_batch + 1)
        )
        with self.cond:
            self.cond.wait_for(lambda: self.count(kind) >= count, timeout=self.patience)
        time.sleep(0.05)


def _mark(grad: torch.Tensor | None) -> tuple[int, int] | None:
    return None if grad is None else (id(grad), grad._version)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def unsplit_steps(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    model = copy.deepcopy(model)
    optimizer = sgd(list(model.parameters()))
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_batch_streams_equal_the_unsplit_steps_when_stage_0_lands_during_stage_1s_update() -> None:
    """Three one-batch streams (no stale weight: each is drained) equal three unsplit SGD steps to 1e-6,
    with stage 0's gradient of microbatch 2 forced to land while stage 1 updates."""
    model, data = tied_model(), batches(3)
    expected = unsplit_steps(model, data)
    with LandsDuringUpdate(model) as timing, Pipeline(model, stages=2, schedule="async", partition=SPLIT) as pipe:
        for batch in data:
            pipe.train_async([batch], F.cross_entropy, sgd, PER_BATCH)
    assert timing.count("update 1") == 3 and timing.landed == 3  # the timing was forced at every update
    assert model[6].weight is model[0].weight
    assert max_param_diff(model, expected) < 1e-6
    assert all(p.grad is None for p in model.parameters())  # every gradient went into an update


def replay(model: nn.Sequential, data: list[tuple[torch.Tensor, torch.Tensor]], per_batch: int) -> dict[str, Any]:
    """Plain PyTorch replay of one stream over ``SPLIT``: microbatch ``m`` runs stage 0 on its weight version
    ``max(0, m - 1) // per_batch`` (1F1B: one forward ahead) and stage 1 on ``m // per_batch``; the shared
    weight is stepped once per batch with both stages' gradients, stage 1 using it one update later."""
    params = dict(model.named_parameters())  # "0.weight" is the shared weight, "6.weight" its other name
    own = [[{n: p.detach() for n, p in params.items() if n != "0.weight" and (int(n[0]) < 3) == (s == 0)}]
           for s in (0, 1)]  # fmt: skip
    tied = [params["0.weight"].detach()]
    m = 0
    for x, y in data:
        grads: dict[str, torch.Tensor] = {}
        for xs, ys in zip(x.tensor_split(per_batch), y.tensor_split(per_batch), strict=True):
            v0, v1 = max(0, m - 1) // per_batch, m // per_batch
            weights = own[0][v0] | own[1][v1] | {"0.weight": tied[v0], "6.weight": tied[max(v1 - 1, 0)]}
            leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
            logits = functional_call(model, leaves, (xs,), tie_weights=False)
            loss = F.cross_entropy(logits, ys) * len(ys) / len(y)
            for n, g in zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True):
                n = "0.weight" if n == "6.weight" else n
                grads[n] = grads[n] + g if n in grads else g
            m += 1
        for versions in own:
            versions.append({n: w - LR * grads[n] for n, w in versions[-1].items()})
        tied.append(tied[-1] - LR * grads["0.weight"])
    return own[0][-1] | own[1][-1] | {"0.weight": tied[-1]}


@pytest.mark.parametrize("timing,per_batch", [("none", 4), ("lands", 4), ("ahead", 4), ("ahead", 1)])
def test_a_stream_with_a_tied_weight_equals_its_replay_whatever_the_timing(timing: str, per_batch: int) -> None:
    """Three batches in one stream: the parameters equal the replay (the shared weight stepped once per batch
    by stage 0 with both stages' gradients of that batch) to 1e-5, whichever stage runs ahead."""
    model, data = tied_model(), batches(3)
    expected = replay(model, data, per_batch)
    timeline = {"none": Timeline, "lands": LandsDuringUpdate}.get(timing, Stage1RunsAhead)
    args = (per_batch,) if timing == "ahead" else ()
    with timeline(model, *args) as seen, Pipeline(model, stages=2, schedule="async", partition=SPLIT) as pipe:
        run = pipe.train_async(data, F.cross_entropy, sgd, per_batch)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected[name], atol=1e-5, rtol=0, msg=name)
    assert [s.updates for s in run.staleness] == [3, 3]
    assert seen.count("update 0") == seen.count("update 1") == 3
    if timing == "ahead" and per_batch == 4:  # stage 1 began batch 1's backwards before stage 0's update
        assert seen.events.index(("backward 1", 4)) < seen.events.index(("update 0", 0))
    if timing == "ahead" and per_batch == 1:  # stage 1 updated batch 1 (and waited) before stage 0 updated batch 0
        assert seen.events.index(("update 1", 1)) < seen.events.index(("update 0", 0))


class TiedLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tied_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


def test_trainer_one_batch_epochs_equal_a_plain_trainer_when_stage_0_lands_during_stage_1s_update() -> None:
    """The case that drifted under load (``test_async_schedule_weights_its_microbatches``), forced: one batch an
    epoch drains each stream, so 3 steps under schedule="async" are a plain Trainer's 3 steps."""
    x, y = batches(1)[0]
    data = DataLoader(TensorDataset(x, y), batch_size=len(x))
    plain = TiedLM()
    piped = copy.deepcopy(plain)
    L.Trainer(**QUIET, max_steps=3).fit(plain, data)
    strategy = PipeStrategy(stages=2, microbatches=PER_BATCH, schedule="async", partition=SPLIT)
    with LandsDuringUpdate(piped.model) as timing:
        L.Trainer(**QUIET, max_steps=3, strategy=strategy).fit(piped, data)
    assert timing.count("update 1") == 3 and timing.landed == 3
    assert [s.updates for s in strategy.staleness()] == [3, 3]
    assert max_param_diff(piped, plain) < 1e-6


class FailsInBackward(Timeline):
    """Stage 0's first backward fails once stage 1 has updated batches 0 and 1 (one microbatch each): stage 1
    then waits for stage 0's update of batch 0, the shared weight its next version takes."""

    def hold(self, stage: int, microbatch: int) -> None:
        if stage == 0:
            with self.cond:
                self.cond.wait_for(lambda: self.count("update 1") >= 2, timeout=5.0)
            time.sleep(0.05)
            raise RuntimeError("stage 0 broke")


@pytest.mark.timed
def test_a_stage_waiting_for_the_shared_weight_stops_when_its_owner_fails() -> None:
    """The error names stage 0 within seconds (not the 60 s timeout) and no stage thread is left waiting
    (the test guard fails on a leftover thread)."""
    model = tied_model()
    start = time.monotonic()
    with FailsInBackward(model) as timeline, pytest.raises(StageError, match="stage 0 broke") as info:
        with Pipeline(model, stages=2, schedule="async", partition=SPLIT, timeout=60) as pipe:
            pipe.train_async(batches(3), F.cross_entropy, sgd, 1)
    assert info.value.stage == 0 and info.value.microbatch == 0
    assert time.monotonic() - start < 20
    assert ("update 1", 1) in timeline.events  # stage 1 had reached the wait
