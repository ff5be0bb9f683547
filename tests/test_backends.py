"""Operator backends: substitution where checkers accept, the execution trace, plans sent to other processes."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from backend_ops import (
    CALLS,
    LINEAR,
    XENT,
    batch,
    linear_checker,
    linear_impl,
    mlp,
    reference_grads,
    xent_checker,
    xent_impl,
)
from backend_ops import clean_registry as clean_registry  # autouse: each test starts from the default registry

from lightning_pipe.backends import (
    build_executables,
    default_backends,
    import_torch_tensorrt,
    register_backend,
    resolve_backends,
    substitute,
)
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.comm.transports import TRANSPORTS
from lightning_pipe.pipeline.pipeline import Pipeline


def test_operator_backend_runs_where_its_checker_accepts() -> None:
    register_backend("mylin", {LINEAR: ("my_linear", linear_checker, linear_impl)}, add_to_default=False)
    model, (x, y) = mlp(), batch()
    expected = reference_grads(model, x, y)
    with torch.no_grad():
        expected_out = copy.deepcopy(model)(x)
    with Pipeline(model, stages=2, partition=[2, 3], backend="mylin", checkpoint="except_last", timeout=30) as pipe:
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        out = pipe.forward(x, microbatches=2)
        trace = pipe.execution_trace()
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-6)
    # stage 0 (Linear 8->16) is checkpointed: forward + recompute = 2 runs per microbatch
    assert trace.count(stage=0, mode="train", op=LINEAR, impl="my_linear", backend="mylin") == 8
    assert trace.count(stage=0, op=LINEAR, impl="eager") == 0
    # stage 1: Linear 16->16 accepted, Linear 16->4 declined -> eager
    assert trace.count(stage=1, mode="train", op=LINEAR, impl="my_linear") == 4
    assert trace.count(stage=1, mode="train", op=LINEAR, impl="eager", backend="eager") == 4
    assert trace.count(stage=1, mode="eval", op=LINEAR, impl="my_linear") == 2
    assert trace.count(stage=1, mode="eval", op=LINEAR, impl="eager") == 2
    assert CALLS["my_linear"] == 8 + 4 + 2 + 2  # the implementation itself ran every counted time
    assert trace[0].backend("train") == "eager" and trace[1].backend("eval") == "eager"
    text = str(trace)
    assert "stage 1" in text and "my_linear [mylin] x4" in text and "-> eager x4" in text


def test_checkers_run_once_per_input_signature() -> None:
    register_backend("mylin", {LINEAR: ("my_linear", linear_checker, linear_impl)}, add_to_default=False)
    model, (x, y) = mlp(), batch()
    with Pipeline(model, stages=2, partition=[2, 3], backend="mylin", checkpoint="never", timeout=30) as pipe:
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        after_first = CALLS["linear_checker"]
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        assert CALLS["linear_checker"] == after_first == 3  # three linear layers, one signature each
        pipe.train_step(x[:12], y[:12], F.cross_entropy, microbatches=4)  # a new microbatch size
        assert CALLS["linear_checker"] == 6


def test_default_backend_applies_without_being_named() -> None:
    register_backend("mylin", {LINEAR: ("my_linear", linear_checker, linear_impl)})
    assert default_backends() == ["mylin", "eager"]
    model, (x, _) = mlp(), batch()
    with Pipeline(model, stages=2, partition=[2, 3], timeout=30) as pipe:
        pipe.forward(x)
        trace = pipe.execution_trace(reset=True)
        assert trace.count(impl="my_linear") == 2
        assert pipe.execution_trace().count() == 0  # reset


def test_cross_entropy_substitution_matches_eager() -> None:
    register_backend("xent", {XENT: ("my_xent", xent_checker, xent_impl)}, add_to_default=False)
    logits = torch.randn(6, 5, requires_grad=True)
    target = torch.randint(0, 5, (6,))
    expected = F.cross_entropy(logits, target)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    with substitute(["xent"]) as counts:
        loss = F.cross_entropy(logits, target)  # accepted
        summed = F.cross_entropy(logits, target, reduction="sum")  # declined: eager
        (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    torch.testing.assert_close(summed, F.cross_entropy(logits, target, reduction="sum"))
    assert counts.count(op=XENT, impl="my_xent", backend="xent") == 1
    assert counts.count(op=XENT, impl="eager") == 1
    assert CALLS["my_xent"] == 1


def test_the_loss_on_the_coordinator_uses_the_last_stage_op_backends() -> None:
    """``F.cross_entropy`` in the criterion runs as the op backend's implementation where its checker accepts."""
    register_backend("xent", {XENT: ("my_xent", xent_checker, xent_impl)}, add_to_default=False)
    model, (x, y) = mlp(), batch()
    expected = reference_grads(model, x, y)

    def smoothed(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # the checker declines smoothing
        return F.cross_entropy(logits, target, label_smoothing=0.1)

    with Pipeline(model, stages=2, partition=[2, 3], backend=["eager", "xent"], timeout=30) as pipe:
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        grads = [p.grad.clone() for p in model.parameters()]
        pipe.train_step(x, y, smoothed, microbatches=2)
        trace = pipe.execution_trace()
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)
    assert trace.count(stage=1, mode="coordinator", op=XENT, impl="my_xent", backend="xent") == 4 == CALLS["my_xent"]
    assert trace.count(stage=1, mode="coordinator", op=XENT, impl="eager") == 2
    assert "coordinator  torch.nn.functional.cross_entropy" in str(trace)


def test_backend_plan_travels_by_pickle_to_other_processes() -> None:
    """RPC workers get the plan inside their StageSpec: names, op maps and compiler classes, nothing compiled."""
    register_backend("mylin", {LINEAR: ("my_linear", linear_checker, linear_impl)}, add_to_default=False)
    plan = pickle.loads(pickle.dumps(resolve_backends([("mylin", "inductor"), "tensorrt"], 2, strict=True)))
    assert plan.strict and plan.chain(0, "train").names == ["mylin", "inductor", "eager"]
    assert plan.chain(1, "eval").names == ["tensorrt", "eager"]
    model = mlp()
    shard = type("Shard", (), {"index": 0, "module": model})()
    executables, traces = build_executables([shard], resolve_backends("mylin", 1), {0: torch.device("cpu")})
    with torch.no_grad():
        executables[(0, "eval")](batch()[0])
    assert traces[0].count(impl="my_linear") == 2 and traces[0].count(impl="eager") == 1


def test_strategy_backend_per_mode_and_its_trace() -> None:
    import lightning as L
    from helpers import QUIET, Classifier, dataset, loader

    from lightning_pipe import PipeStrategy

    register_backend("mylin", {LINEAR: ("my_linear", linear_checker, linear_impl)}, add_to_default=False)
    register_backend("xent", {XENT: ("my_xent", xent_checker, xent_impl)}, add_to_default=False)
    backend = {"train": ("mylin", "xent"), "eval": ("tensorrt",)}
    strategy = PipeStrategy(
        microbatches=2, devices=["cpu", "cpu"], partition=[2, 3], backend=backend, checkpoint="except_last"
    )
    trainer = L.Trainer(**QUIET, strategy=strategy, max_steps=2, limit_val_batches=1, val_check_interval=2)
    trainer.fit(Classifier(mlp()), loader(dataset(rows=32, classes=4), 16), loader(dataset(rows=16, classes=4), 16))
    trainer.predict(trainer.lightning_module, loader(dataset(rows=16, classes=4), 16))
    trace = strategy.execution_trace()  # kept after fit's and predict's pipelines closed
    assert trace[0].backend("train") == "eager"
    # stage 0 is checkpointed: 2 steps x 2 microbatches x (forward + recompute)
    assert trace.count(stage=0, mode="train", impl="my_linear") == 8
    assert trace.count(stage=1, mode="train", impl="my_linear") == trace.count(stage=1, mode="train", impl="eager")
    assert trace.count(mode="eval", impl="my_linear") == 0  # eval's chain does not name mylin
    # the loss in training_step (the user's code, run by the coordinator) used the xent backend
    assert trace.count(stage=1, mode="coordinator", op=XENT, impl="my_xent") == 4 == CALLS["my_xent"]
    if import_torch_tensorrt()[0] is None:
        assert trace[1].backend("eval") == "eager" and ("eval", "tensorrt") in trace[1].declined
        assert trace[1].runs["eval"]["eager"] == 3 * 2  # sanity check, validation, predict: 2 microbatches each
    with pytest.raises(ConfigurationError, match="unknown backend 'nope'; available: eager, inductor, mylin"):
        PipeStrategy(backend=["eager", "nope"])


@pytest.mark.skipif("rpc" not in TRANSPORTS, reason="transport='rpc' is not available in this checkout")
def test_backends_and_trace_over_rpc() -> None:
    """Stage processes get the plan by pickle, import the op backend's functions and report their traces."""
    register_backend("mylin", {LINEAR: ("my_linear", linear_checker, linear_impl)}, add_to_default=False)
    model, (x, y) = mlp(), batch()
    plain = copy.deepcopy(model)
    with torch.no_grad():
        expected_loss = F.cross_entropy(plain(x), y).item()
    backend = {"train": "mylin", "eval": ("tensorrt", "mylin")}
    with Pipeline(model, stages=2, partition=[2, 3], backend=backend, transport="rpc", timeout=60) as pipe:
        result = pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        out = pipe.forward(x)
        trace = pipe.execution_trace()
    assert float(sum(result.losses)) == pytest.approx(expected_loss, abs=1e-5)
    torch.testing.assert_close(out, plain(x).detach(), rtol=0, atol=1e-6)
    assert trace.count(stage=0, mode="train", impl="my_linear") == 4  # checkpoint="auto" on cpu: no recompute
    assert trace.count(stage=1, mode="train", impl="my_linear") == trace.count(stage=1, mode="train", impl="eager") == 4
    assert trace.count(mode="eval", impl="my_linear") == 2 and trace[1].backend("eval") == "eager"
    if import_torch_tensorrt()[0] is None:
        assert ("eval", "tensorrt") in trace[0].declined
