"""Compiled stages split their backward for real: ``I`` computes input gradients only, ``W`` the weights'.

The stage's compiled backward is partitioned into an input-gradient graph and a weight-gradient graph
(`lightning_pipe.backends.split_compile`); where that is impossible the stage says so once and ``I`` runs
the whole backward. Each test compiles a model of a few Linear layers on CPU (seconds each with inductor's
cache, which the module's tests share).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import Pipeline, PipeStrategy
from lightning_pipe.backends import InductorCompiler, OpCounter, StageTrace
from lightning_pipe.backends.ops import OpTable
from lightning_pipe.engine.split_backward import backward_input, backward_weight
from lightning_pipe.pipeline.timeline import StepTimeline
from lightning_pipe.schedule import Kind

WIDTH, STEPS = 8, 2


@pytest.fixture(autouse=True, scope="module")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh inductor cache for this module: its first compile is cold, the later ones reuse the graphs."""
    path = tmp_path_factory.mktemp("inductor")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
        yield path


def block(seed: int = 0) -> nn.Sequential:
    """A stage of the Trainer tests below: the same graphs, compiled once for the whole module.

    GELU saves its input, an intermediate: inductor's backward donates it, which made ``retain_graph`` fail.
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


def compiled(module: nn.Module, trace: StageTrace):  # type: ignore[no-untyped-def]
    compiler = InductorCompiler(module, OpTable([]), OpCounter(), "inductor", f"split_test{trace.stage}", {})
    compiler.attach(trace, "train")
    return compiler.build()


def eager_grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    reference = copy.deepcopy(module)
    x = x.detach().requires_grad_()
    reference(x).backward(g)
    assert x.grad is not None
    return x.grad, [p.grad for p in reference.parameters()]  # type: ignore[misc]


def test_input_action_leaves_every_weight_gradient_to_the_weight_action() -> None:
    module, trace = block(), StageTrace(0)
    run = compiled(module, trace)
    x, g = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    want_x, want_w = eager_grads(module, x, g)
    for _ in range(2):  # the second microbatch runs the graphs compiled for the first
        module.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        out = run(leaf)
        (got_x,), work = backward_input([out], [g], [leaf], module.parameters())
        assert all(p.grad is None for p in module.parameters()), "I computed weight gradients"
        assert len(work.deferred) == 1 and work.nbytes() > 0
        torch.testing.assert_close(got_x, want_x, atol=1e-6, rtol=1e-6)
        backward_weight(work)
        for p, w in zip(module.parameters(), want_w, strict=True):
            torch.testing.assert_close(p.grad, w, atol=1e-6, rtol=1e-6)
    assert trace.graphs["train"] == {"forward": 1, "backward_input": 1, "backward_weight": 1, "backward": 1}
    # a microbatch of another size (an uneven last one): Dynamo recompiles with dynamic shapes, split again
    x3, g3 = x[:3], g[:3]
    want_x3, want_w3 = eager_grads(module, x3, g3)
    module.zero_grad(set_to_none=True)
    leaf = x3.detach().requires_grad_()
    (got_x,), work = backward_input([run(leaf)], [g3], [leaf], module.parameters())
    assert all(p.grad is None for p in module.parameters()) and len(work.deferred) == 1
    backward_weight(work)
    torch.testing.assert_close(got_x, want_x3, atol=1e-6, rtol=1e-6)
    for p, w in zip(module.parameters(), want_w3, strict=True):
        torch.testing.assert_close(p.grad, w, atol=1e-6, rtol=1e-6)
    assert trace.graphs["train"] == {"forward": 2, "backward_input": 2, "backward_weight": 2, "backward": 2}
    assert trace.unsplit == {}
    # an ordinary backward through the same node (a B action) runs the whole compiled backward, a third graph
    module.zero_grad(set_to_none=True)
    run(x).backward(g)
    for p, w in zip(module.parameters(), want_w, strict=True):
        torch.testing.assert_close(p.grad, w, atol=1e-6, rtol=1e-6)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = block()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(Scale.apply(x, self.scale))  # type: ignore[no-untyped-call]


class GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner[1](self.inner[0](x))
        torch._dynamo.graph_break()
        return self.inner[2](x)


@pytest.mark.parametrize(
    ("module", "reason"),
    [(CustomFunction, "custom torch.autograd.Function"), (GraphBreak, "Dynamo breaks its graph")],
)
def test_a_stage_that_cannot_split_says_why_once_and_runs_its_backward_whole_in_i(
    module: type[nn.Module], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    stage, trace = module(), StageTrace(3)
    run = compiled(stage, trace)
    x, g = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    want_x, want_w = eager_grads(stage, x, g)
    with caplog.at_level(logging.WARNING, logger="lightning_pipe"):
        for _ in range(2):
            stage.zero_grad(set_to_none=True)
            leaf = x.detach().requires_grad_()
            (got_x,), work = backward_input([run(leaf)], [g], [leaf], stage.parameters())
            assert not work.deferred
            grads = [p.grad for p in stage.parameters()]
            backward_weight(work)  # nothing left for W
            assert [p.grad for p in stage.parameters()] == grads
            torch.testing.assert_close(got_x, want_x, atol=1e-6, rtol=1e-6)
            for p, w in zip(stage.parameters(), want_w, strict=True):
                torch.testing.assert_close(p.grad, w, atol=1e-6, rtol=1e-6)
    said = [r.getMessage() for r in caplog.records if "not split" in r.getMessage()]
    assert len(said) == 1 and reason in said[0] and said[0].startswith("stage 3 (train)"), said
    assert reason in trace.unsplit["train"]
    assert "backward_input" not in trace.graphs["train"]


# --- every schedule with compiled stages, against a plain Trainer -------------------------------------------

# (schedule, virtual stages per rank): 4 stages of one block each, so every schedule compiles the same graphs
SCHEDULES = [
    ("dualpipev", 2),  # the first here to compile into the fresh cache (it crashed even with a fresh one)
    ("1f1b", 1),
    ("zero-bubble", 1),  # after 1f1b: the cache holds 1f1b's graphs (the reported crash)
    ("gpipe", 1),
    ("interleaved-1f1b", 2),
    ("zbv", 2),
    ("interleaved-zero-bubble", 2),
    ("looped-bfs", 2),
    ("auto", 1),
]
SPLITS = ("zero-bubble", "zbv", "dualpipev", "interleaved-zero-bubble")


class Blocks(L.LightningModule):
    """Four identical blocks (`block`); ``compiled``: each block compiled by the user (``torch.compile``)."""

    def __init__(self, compiled: bool = False) -> None:
        super().__init__()
        blocks: list[nn.Module] = [block(seed) for seed in range(4)]
        if compiled:
            blocks = [torch.compile(b) for b in blocks]  # type: ignore[misc]
        self.model = nn.Sequential(*blocks)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def train(module: L.LightningModule, strategy: PipeStrategy | None) -> L.Trainer:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16 * STEPS, WIDTH, generator=g), torch.randn(16 * STEPS, WIDTH, generator=g))
    trainer = L.Trainer(**(QUIET | {"max_steps": STEPS}), **({"strategy": strategy} if strategy else {}))
    trainer.fit(module, DataLoader(data, batch_size=16))
    return trainer


@pytest.fixture(scope="module")
def plain() -> dict[str, torch.Tensor]:
    """The plain Trainer's model after the steps (eager, uncompiled)."""
    module = Blocks()
    train(module, None)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_trained_like(module: L.LightningModule, plain: dict[str, torch.Tensor], what: str) -> None:
    got = {k.replace("_orig_mod.", ""): v for k, v in module.state_dict().items()}
    assert got.keys() == plain.keys()
    for key, value in plain.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=f"{what}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "virtual"), SCHEDULES)
def test_every_schedule_with_inductor_stages_trains_like_a_plain_trainer(
    schedule: str, virtual: int, plain: dict[str, torch.Tensor]
) -> None:
    """Local mode, 4 stages; dualpipev compiles into a fresh cache, the others find graphs compiled before."""
    module = Blocks()
    strategy = PipeStrategy(
        stages=4, virtual_stages=virtual, microbatches=4, schedule=schedule, backend="inductor", strict=True,
        checkpoint="never", devices=["cpu"] * 4, timeout=240,
    )  # fmt: skip
    trainer = train(module, strategy)
    assert_trained_like(module, plain, schedule)
    trace = trainer.strategy.execution_trace()  # type: ignore[attr-defined]
    for s in range(4):
        graphs = trace[s].graphs["train"]
        assert trace[s].unsplit == {} and graphs["forward"] == 1, (s, graphs)
        # the first stage has no input gradient: its backward is one graph; the others split theirs
        assert graphs.keys() == (
            {"forward", "backward"} if s == 0 else {"forward", "backward_input", "backward_weight", "backward"}
        )


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_submodules_the_user_compiled_train_like_a_plain_trainer_under_the_v_schedules(
    schedule: str, plain: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    """``torch.compile`` on a submodule: its compiled backward runs whole in I (said once per stage), no crash."""
    module = Blocks(compiled=True)
    strategy = PipeStrategy(
        stages=4, virtual_stages=2, microbatches=4, schedule=schedule, checkpoint="never", devices=["cpu"] * 4,
        timeout=240,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lightning_pipe"):
        trainer = train(module, strategy)
    assert_trained_like(module, plain, schedule)
    said = [r.getMessage() for r in caplog.records if "torch.compile'd submodules" in r.getMessage()]
    assert sorted(m.split(":")[0] for m in said) == [f"stage {s}" for s in range(4)], said
    trace = trainer.strategy.execution_trace()  # type: ignore[attr-defined]
    assert all("torch.compile'd submodules" in trace[s].unsplit["train"] for s in range(4))


@pytest.mark.slow
def test_the_timeline_shows_i_and_w_of_compiled_stages_as_separate_measured_spans() -> None:
    """zbv with inductor stages through the `Pipeline`: each I and W action has its own compute span."""
    model = nn.Sequential(*[block(seed) for seed in range(4)])
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    with Pipeline(model, stages=4, virtual_stages=2, schedule="zbv", backend="inductor", timeout=240) as pipe:
        result = pipe.train_step(x, y, F.mse_loss, microbatches=4)
        trace = pipe.execution_trace()
    timeline = StepTimeline.from_result(result)
    timings = [t for rank in timeline.ranks for t in rank]
    halves = {
        kind: [t for t in timings if t.action.kind is kind] for kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
    }
    assert all(len(found) == 4 * 4 for found in halves.values())  # every stage and microbatch
    for found in halves.values():
        assert all("compute" in t.parts and t.part("compute") > 0 for t in found)
    assert all(trace[s].graphs["train"].get("backward_weight") == 1 for s in (1, 2, 3))


@pytest.mark.slow
def test_every_schedule_with_inductor_stages_launched_trains_like_the_unsplit_model(tmp_path: Path) -> None:
    """Launched mode, one pipeline of 2 processes (tests/launched_train.py, 3 steps each): every schedule with
    inductor stages, dualpipev first into the fresh cache, zero-bubble after 1f1b; user-compiled Linear layers
    under zbv and dualpipev."""
    from launching import forked_ranks
    from test_launched import SCRIPT, assert_ok, check_trained, coordinators

    cases = [
        "s2-sgd-dualpipev-v2-m4-ind", "s2-sgd-1f1b-ind", "s2-sgd-zero_bubble-ind", "s2-sgd-gpipe-ind",
        "s2-sgd-interleaved_1f1b-v2-m4-ind", "s2-sgd-zbv-v2-m4-ind", "s2-sgd-interleaved_zero_bubble-v2-m4-ind",
        "s2-sgd-looped_bfs-v2-m4-ind", "s2-sgd-auto-v2-m4-ind", "s2-sgd-zbv-v2-m4-sub", "s2-sgd-dualpipev-v2-m4-sub",
    ]  # fmt: skip
    run = forked_ranks(SCRIPT, ["--devices", "2", "--cases", ",".join(cases), "--out", str(tmp_path)], 2, timeout=900)
    assert_ok(run)
    for name in cases:
        check_trained(tmp_path, name, coordinators(name, processes=2))
    assert run.output.count("torch.compile'd submodules") == 2 * 4  # each sub case: once per stage
