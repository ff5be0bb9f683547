"""Compiled stages split their backward for real: ``I`` computes input gradients only, ``W`` the weights'.

The stage's compiled backward is partitioned into an input-gradient graph and a weight-gradient graph
(`lightning_pipe.backends.split_compile`); where that is impossible the stage says so once and ``I`` runs
the whole backward. Each test compiles a model of a few Linear layers on CPU (seconds each with inductor's
cache, which the module's tests share).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from lightning_pipe.backends import InductorCompiler, OpCounter, StageTrace
from lightning_pipe.backends.ops import OpTable
from lightning_pipe.engine.split_backward import backward_input, backward_weight


def block(width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))


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
    x, g = torch.randn(6, 8), torch.randn(6, 8)
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
    assert trace.graphs["train"] == {"forward": 1, "backward_input": 1, "backward_weight": 1}
    assert trace.unsplit == {}
    # an ordinary backward through the same node runs I then W at once
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
        return self.inner(Scale.apply(x, self.scale))


class GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner[0](x)
        torch._dynamo.graph_break()
        return self.inner[2](self.inner[1](x))


@pytest.mark.parametrize(
    ("module", "reason"),
    [(CustomFunction, "custom torch.autograd.Function"), (GraphBreak, "Dynamo breaks its graph")],
)
def test_a_stage_that_cannot_split_says_why_once_and_runs_its_backward_whole_in_i(
    module: type[nn.Module], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    stage, trace = module(), StageTrace(3)
    run = compiled(stage, trace)
    x, g = torch.randn(6, 8), torch.randn(6, 8)
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
