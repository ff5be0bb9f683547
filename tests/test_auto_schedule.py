"""``schedule="auto"`` running: the first step measures, the second runs the chosen schedule's own exact step."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, dataset, loader, max_param_diff, mlp, one_thread
from test_transparency import GradCapture, fit
from torch import nn

import lightning_pipe.pipeline.schedule_chooser as auto_schedule
from lightning_pipe import Pipeline, PipeStrategy
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.comm import LocalCommunicator
from lightning_pipe.pipeline.schedule_chooser import AutoSchedule, ScheduleChooser
from lightning_pipe.pipeline.timeline import StepTimeline
from lightning_pipe.rng import derive_seed
from lightning_pipe.schedule import Kind, Schedule, placement_of
from lightning_pipe.strategy.arguments import auto_schedule_of


def _batches(steps: int, rows: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(steps)]


def _train(schedule: object, counts: list[int | str], stages: int = 2) -> tuple[list[float], object, list[object]]:
    """SGD steps of a pipeline; the losses, the module and each step's result."""
    net = mlp(depth=6)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, results = [], []
    with Pipeline(net, stages=stages, schedule=schedule, partition="uniform", checkpoint="never") as pipe:
        for (x, y), count in zip(_batches(len(counts)), counts, strict=True):
            result = pipe.train_step(x, y, F.cross_entropy, microbatches=count)
            opt.step()
            opt.zero_grad()
            losses.append(float(sum(result.losses)))
            results.append(result)
        choice = pipe.choices.schedule.choice if pipe.choices.schedule is not None else None
    return losses, (net, choice), results


def test_auto_equals_the_chosen_schedule_and_the_unsplit_run(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        auto_losses, (auto_net, choice), results = _train("auto", ["auto"] * 3)
    assert choice is not None
    chosen, count = choice.chosen.name, choice.chosen.microbatches
    placed = f"(placement {choice.chosen.placement!r})"
    assert any(f"chose {chosen!r} {placed} with {count} microbatches" in r.message for r in caplog.records)
    assert [len(r.losses) for r in results] == [4, count, count]  # the measured step: 2 microbatches per rank
    assert results[0].predicted is None and results[1].predicted == choice.chosen.predicted
    assert results[1].schedule.name == chosen
    assert any(a.kind is Kind.BACKWARD_INPUT for actions in results[0].schedule.actions() for a in actions)  # probe
    assert "predicted" in StepTimeline.from_result(results[2], 2).summary()
    # the same steps with the chosen schedule named (the probe's first step: any schedule's step is the same)
    fixed_losses, (fixed_net, _), _ = _train(chosen, [4, count, count])
    torch.testing.assert_close(torch.tensor(auto_losses), torch.tensor(fixed_losses), atol=1e-5, rtol=0)
    assert max_param_diff(auto_net, fixed_net) < 1e-5
    # and the model unsplit
    plain = mlp(depth=6)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for (x, y), piped_loss in zip(_batches(3), auto_losses, strict=True):
        loss = F.cross_entropy(plain(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.detach().item() - piped_loss) < 1e-5
    assert max_param_diff(auto_net, plain) < 1e-5


def test_trainer_with_auto_schedule_and_microbatches_equals_unsplit() -> None:
    piped, plain = Classifier(mlp(depth=6)), Classifier(mlp(depth=6))
    strategy = PipeStrategy(stages=2, microbatches="auto", schedule="auto", partition="uniform", memory_budget=10**9)
    got, want = fit(piped, strategy), fit(plain, None)
    assert len(got.grads) == len(want.grads) == 3
    for step in range(3):
        for g, w in zip(got.grads[step], want.grads[step], strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert max_param_diff(piped, plain) < 1e-5
    choice = strategy.schedule_choice
    assert choice is not None and choice.budget == 10**9
    assert len(strategy.last_step.losses) == min(choice.chosen.microbatches, 12)
    assert strategy.last_step.predicted == choice.chosen.predicted


def test_fsdp_probes_and_chooses_without_split_backward() -> None:
    options = auto_schedule_of("auto", "auto", None, "fsdp")
    assert options == AutoSchedule(microbatches=True, budget=None, split_backward=False)

    def splits(schedule: Schedule) -> bool:
        return any(a.kind is Kind.BACKWARD_INPUT for actions in schedule.actions() for a in actions)

    assert not splits(ScheduleChooser(options, 1, "parallel").probe(2, 4, 1))  # FSDP: I and W estimated from B
    assert splits(ScheduleChooser(AutoSchedule(), 1, "parallel").probe(2, 4, 1))  # zero-bubble, or another
    interleaved = ScheduleChooser(AutoSchedule(), 2, "parallel").probe(2, 4, 2)
    assert interleaved.num_stages == 4 and [interleaved.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert auto_schedule_of("1f1b", 4, None, "ddp") == "1f1b"


def test_auto_configuration_errors_name_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="pass schedule='auto'"):
        PipeStrategy(stages=2, microbatches="auto", schedule="1f1b")
    with pytest.raises(ConfigurationError, match="memory_budget is schedule='auto''s limit"):
        PipeStrategy(stages=2, schedule="1f1b", memory_budget=1000)
    with pytest.raises(ConfigurationError, match="runner='linear' runs one stage at a time"):
        Pipeline(mlp(), stages=2, schedule="auto", runner="linear")
    with pytest.raises(ConfigurationError, match="microbatches='auto' is chosen by schedule='auto'"):
        with Pipeline(mlp(), stages=2) as pipe:
            pipe.train_step(*_batches(1)[0], F.cross_entropy, microbatches="auto")


def _dropout_net() -> nn.Sequential:
    """4 stages of 2 layers: dropout (the stages' generators) and batch norm (buffers) in them."""
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.2),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3),
    )  # fmt: skip


BALANCE = [2, 2, 3, 2]  # stage 1 holds the dropout (layer 3), stage 2 the batch norm


class _Drawn(nn.Module):
    """The unsplit model's dropout, drawing its masks from ``generator`` as torch's dropout does on the CPU."""

    def __init__(self, p: float, generator: torch.Generator) -> None:
        super().__init__()
        self.p, self.generator = p, generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x * torch.empty_like(x).bernoulli_(1 - self.p, generator=self.generator).div_(1 - self.p)


def _unsplit_dropout_net(seed: int) -> nn.Sequential:
    """`_dropout_net` unsplit, its dropout drawing from the generator stage 1 starts from (the run's ``seed`` and the
    stage's index: docs/internals.md), one microbatch after another as the stage does: the plain model's draws."""
    net = _dropout_net()
    net[3] = _Drawn(0.2, torch.Generator().manual_seed(derive_seed(seed, 1, "cpu")))
    return net


def _momentum_steps(schedule: object, steps: int = 3) -> tuple[nn.Module, list[float], Pipeline, dict[str, int]]:
    net = _dropout_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # state after step 1 that must carry over
    losses = []
    with Pipeline(net, 4, schedule=schedule, partition=BALANCE, virtual_stages=2, checkpoint="never", seed=5) as pipe:
        for x, y in _batches(steps):
            result = pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            opt.step()
            opt.zero_grad()
            losses.append(float(sum(result.losses)))
        runs = dict(pipe.execution_trace()[0].runs.get("train", {}))  # stage 0's forwards per backend
    return net, losses, pipe, runs


def _unsplit_momentum_steps(seed: int = 5, steps: int = 3) -> tuple[nn.Module, list[float]]:
    """`_momentum_steps` by hand on the unsplit model: each step's 4 microbatches one after the other (batch norm
    sees the same rows), each loss a quarter of the step's, then the SGD step."""
    net = _unsplit_dropout_net(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with one_thread():
        for x, y in _batches(steps):
            total = 0.0
            for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
                loss = F.cross_entropy(net(xm), ym) / 4
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
    return net, losses


def _v_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A V schedule wins, whatever this machine measures: the decision sees only the V's schedules."""
    real = auto_schedule.choose

    def only_v(costs: object, factories: dict[str, object], *args: object, **kwargs: object) -> object:
        return real(costs, {n: f for n, f in factories.items() if placement_of(f) == "v"}, *args, **kwargs)

    monkeypatch.setattr(auto_schedule, "choose", only_v)


def test_auto_moves_its_stages_to_a_schedule_placed_otherwise_exactly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Built round-robin, moved to the V before the second step: the parameters, momentum, batch norm statistics and
    dropout streams move with the stages, so the run equals the unsplit model stepped by hand on the same
    microbatches, its dropout drawing from stage 1's stream."""
    _v_wins(monkeypatch)
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        auto_net, auto_losses, pipe, runs = _momentum_steps(AutoSchedule(placement="loop"))  # built round-robin
    choice = pipe.choices.schedule.choice if pipe.choices.schedule is not None else None
    assert choice is not None and choice.chosen.placement == "v"
    assert pipe.coordinator.rank_of_stage == [0, 1, 1, 0]  # moved: stage r and 2R-1-r on rank r
    logged = "\n".join(r.message for r in caplog.records)
    assert f"chose {choice.chosen.name!r} (placement 'v')" in logged
    assert "the stages moved from placement 'loop' to 'v' before this step" in logged
    assert runs == {"eager": 3 * 4}  # the old workers' trace kept with the new ones'
    plain_net, plain_losses = _unsplit_momentum_steps()
    torch.testing.assert_close(torch.tensor(auto_losses), torch.tensor(plain_losses), atol=1e-5, rtol=0)
    assert max_param_diff(auto_net, plain_net) < 1e-5
    for (name, a), b in zip(auto_net.named_buffers(), plain_net.buffers(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    # the oracle is not vacuous: masks drawn from another stream train another model
    assert max_param_diff(_unsplit_momentum_steps(seed=6)[0], plain_net) > 1e-3


def test_auto_builds_where_the_unit_costs_say_and_stages_owning_parameters_stay() -> None:
    assert ScheduleChooser(AutoSchedule(), 2, "parallel", ranks=2, microbatches=8).placement == "v"
    assert ScheduleChooser(AutoSchedule(), 2, "parallel", ranks=2, microbatches=2).placement == "loop"
    auto = PipeStrategy(stages=4, virtual_stages=2, microbatches=8, schedule="auto")
    assert auto.builder.selection.rank_placement == "v"
    from lightning_pipe.comm.parameter_home import STAGES_STAY, StageCopies
    from lightning_pipe.pipeline.stage_moves import moves_of

    owning = SimpleNamespace(parameters=StageCopies())  # as rpc's and launched mode's communicators
    moves = moves_of(owning, None, ["cpu"] * 4, 2, lambda placement: None)  # type: ignore[arg-type]
    assert moves.placements == [] and moves.why_not == STAGES_STAY
    local = moves_of(LocalCommunicator(), ["cpu", "meta"], ["cpu", "meta", "cpu", "meta"], 2, lambda placement: None)
    assert local.placements == ["loop"] and "another device" in local.why_not  # one device per rank: stages stay


class _Momentum(Classifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def test_trainer_moves_the_stages_keeping_lightnings_optimizer_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a Trainer, moved to the V after the measured step: equal to a plain Trainer (no PipeStrategy)
    accumulating the same 4 microbatches a step (batch norm sees the same rows), the unsplit model's dropout drawing
    from stage 1's stream: gradients of every step, parameters and batch norm statistics after 3."""
    _v_wins(monkeypatch)
    L.seed_everything(7, verbose=False)  # the run's seed: the stages' streams start from it
    strategy = PipeStrategy(schedule=AutoSchedule(placement="loop"), stages=4, virtual_stages=2, microbatches=4,
                            partition=BALANCE, checkpoint="never")  # fmt: skip
    moved = _Momentum(_dropout_net())
    got = fit(moved, strategy)  # 3 steps of 12 rows
    choice = strategy.schedule_choice
    assert choice is not None and choice.chosen.placement == "v"
    assert any("moved from placement 'loop' to 'v'" in note for note in choice.notes)
    plain = _Momentum(_unsplit_dropout_net(7))
    capture = GradCapture()
    trainer = L.Trainer(**QUIET, max_steps=3, accumulate_grad_batches=4, callbacks=[capture])
    with one_thread():
        trainer.fit(plain, loader(dataset(rows=48), batch_size=3))
    assert len(got.grads) == len(capture.grads) == 3
    for step in range(3):
        for g, w in zip(got.grads[step], capture.grads[step], strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert max_param_diff(moved, plain) < 1e-5
    for (name, a), b in zip(moved.named_buffers(), plain.buffers(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
