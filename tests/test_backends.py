"""Backends: operator substitution with checkers, the execution trace, tensorrt fallback, errors."""

from __future__ import annotations

import copy
import logging
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.backends import (
    BackendUnavailableError,
    EagerCompiler,
    StageContext,
    TensorMeta,
    TensorRTCompiler,
    available_backends,
    build_executables,
    default_backends,
    import_torch_tensorrt,
    register_backend,
    resolve_backends,
    substitute,
    unregister_backend,
)
from lightning_pipe.errors import ConfigurationError, StageError
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.transports import TRANSPORTS

LINEAR = "torch.nn.functional.linear"
XENT = "torch.nn.functional.cross_entropy"
CALLS: dict[str, int] = {}  # how often each implementation really ran


def linear_checker(x: TensorMeta, weight: TensorMeta, bias: TensorMeta | None = None) -> bool:
    CALLS["linear_checker"] = CALLS.get("linear_checker", 0) + 1
    assert isinstance(weight, TensorMeta), "checkers see metadata, never data"
    return weight.shape[0] == 16  # only layers with 16 outputs


def linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    CALLS["my_linear"] = CALLS.get("my_linear", 0) + 1
    y = torch.matmul(x, weight.t())
    return y + bias if bias is not None else y


def xent_checker(
    logits: TensorMeta,
    target: TensorMeta,
    weight: TensorMeta | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> bool:
    """Like the seed's apex checker: the op's own signature; accepts 2-D, unweighted, mean-reduced inputs."""
    return logits.ndim == 2 and weight is None and reduction == "mean" and label_smoothing == 0.0


def xent_impl(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    CALLS["my_xent"] = CALLS.get("my_xent", 0) + 1
    keep = target != ignore_index
    picked = logits.log_softmax(-1).gather(1, target.clamp(min=0)[:, None])[:, 0]
    return -(picked * keep).sum() / keep.sum()


def raising_checker(*args: Any, **kwargs: Any) -> bool:
    raise ValueError("checker bug")


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    before = set(available_backends())
    CALLS.clear()
    yield
    for name in set(available_backends()) - before:
        unregister_backend(name)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    F.cross_entropy(ref(x), y).backward()
    return [p.grad for p in ref.parameters()]


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


def test_tensorrt_without_torch_tensorrt_declines_and_eval_runs_on_next(caplog: pytest.LogCaptureFixture) -> None:
    module, reason = import_torch_tensorrt()
    if module is not None:
        pytest.skip("torch_tensorrt imports here; this test covers machines without it")
    model, (x, _) = mlp(), batch()
    with torch.no_grad():
        expected = copy.deepcopy(model)(x)
    backend = {"train": "eager", "eval": ("tensorrt", "eager")}
    with caplog.at_level(logging.WARNING, "lightning_pipe.backends"):
        with Pipeline(model, stages=2, partition=[2, 3], backend=backend, timeout=30) as pipe:
            out = pipe.forward(x, microbatches=2)
            trace = pipe.execution_trace()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    for stage in (0, 1):
        assert trace[stage].backend("eval") == "eager"
        assert trace[stage].declined[("eval", "tensorrt")] == reason
    assert "torch_tensorrt cannot be imported" in str(reason)
    assert "tensorrt declined" in str(trace)
    assert any("backend 'tensorrt' declined" in r.getMessage() for r in caplog.records)


class _FailingImport:
    """A meta path finder that makes ``import torch_tensorrt`` raise a plain Exception, as it does without TensorRT."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch_tensorrt":
            raise Exception("Unable to find TensorRT libraries")  # noqa: TRY002
        return None


def test_tensorrt_import_failing_with_a_plain_exception_is_a_decline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_tensorrt", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingImport(), *sys.meta_path])
    import_torch_tensorrt.cache_clear()
    try:
        module, reason = import_torch_tensorrt()
    finally:
        import_torch_tensorrt.cache_clear()
    assert module is None
    assert reason is not None and "Exception: Unable to find TensorRT libraries" in reason


def test_tensorrt_checker_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker's decisions once torch_tensorrt imports: CUDA only, no training, no input grads."""
    import lightning_pipe.backends.tensorrt as trt_backend

    monkeypatch.setattr(trt_backend, "import_torch_tensorrt", lambda: (object(), None))
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    checker = TensorRTCompiler(nn.Linear(2, 2), None, None, "tensorrt", "stage0_eval", {})  # type: ignore[arg-type]
    on_cuda = (TensorMeta((4, 2), torch.float32, cuda),)
    assert checker.check(on_cuda, StageContext(0, "eval", cuda, False, False, 2)) is None
    on_cpu = (TensorMeta((4, 2), torch.float32, cpu),)
    assert "CUDA" in str(checker.check(on_cpu, StageContext(0, "eval", cpu, False, False, 2)))
    assert "2 trainable parameters" in str(checker.check(on_cuda, StageContext(0, "train", cuda, True, True, 2)))
    assert checker.check(on_cuda, StageContext(1, "train", cuda, True, True, 0)) is None  # a frozen stage
    wants_grad = (TensorMeta((4, 2), torch.float32, cuda, requires_grad=True),)
    assert "inputs need gradients" in str(checker.check(wants_grad, StageContext(1, "train", cuda, True, True, 0)))


def test_tensorrt_runs_evaluation_where_torch_tensorrt_imports() -> None:
    module, reason = import_torch_tensorrt()
    if module is None:
        pytest.skip(str(reason))
    if not torch.cuda.is_available():
        pytest.skip("torch_tensorrt imports but no CUDA device is visible")
    model, (x, _) = mlp(), batch()
    with torch.no_grad():
        expected = copy.deepcopy(model).cuda()(x.cuda())
    devices, backend = ["cuda:0", "cuda:0"], {"eval": "tensorrt"}
    with Pipeline(model, stages=2, partition=[2, 3], devices=devices, backend=backend, strict=True) as pipe:
        out = pipe.forward(x.cuda(), microbatches=2)
        trace = pipe.execution_trace()
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)
    assert trace[0].backend("eval") == trace[1].backend("eval") == "tensorrt"


def test_strict_raises_where_the_requested_backend_cannot_serve() -> None:
    model, (x, y) = mlp(), batch()
    with Pipeline(model, stages=2, partition=[2, 3], backend="tensorrt", strict=True, timeout=30) as pipe:
        with pytest.raises(StageError, match=r"backend 'tensorrt' cannot run stage 0 \(train\).*strict=False"):
            pipe.train_step(x, y, F.cross_entropy, microbatches=2)


class _GivesUp(EagerCompiler):
    """A stage backend that accepts every stage and then fails to compile it."""

    always_accepts = False

    def build(self) -> Any:
        def run(*args: Any) -> Any:
            raise BackendUnavailableError("no kernels for this stage")

        return run


class _BrokenChecker(EagerCompiler):
    always_accepts = False

    def check(self, inputs: Any, ctx: StageContext) -> str | None:
        raise RuntimeError("checker bug")


def test_a_compiler_that_gives_up_falls_back_to_the_next_backend() -> None:
    register_backend("gives_up", add_to_default=False, compiler=_GivesUp)
    model, (x, y) = mlp(), batch()
    expected = reference_grads(model, x, y)
    with Pipeline(model, stages=2, partition=[2, 3], backend=["gives_up", "eager"], timeout=30) as pipe:
        pipe.train_step(x, y, F.cross_entropy, microbatches=2)
        trace = pipe.execution_trace()
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-6)
    assert trace[0].backend("train") == "eager"
    assert trace[0].declined[("train", "gives_up")] == "no kernels for this stage"
    assert trace[1].declined == {}


def test_unknown_backend_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown backend 'nope'; available: eager, inductor, tensorrt"):
        Pipeline(mlp(), stages=2, backend="nope")
    with pytest.raises(ConfigurationError, match="unknown backend 'nope'"):
        Pipeline(mlp(), stages=2, backend={"eval": ["eager", "nope"]})


def test_bad_backend_arguments_are_rejected_before_any_work() -> None:
    with pytest.raises(ConfigurationError, match=r"3 entries but stages=2"):
        resolve_backends(["eager", "eager", "inductor"], 2)
    with pytest.raises(ConfigurationError, match=r"unknown mode\(s\) 'predict'; use the keys train, eval"):
        resolve_backends({"predict": "eager"}, 2)
    with pytest.raises(ConfigurationError, match="must be .implementation name, checker, implementation"):
        register_backend("bad", {LINEAR: linear_impl})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="'torch.nn.functional.nope' does not name a PyTorch operation"):
        register_backend("bad", {"torch.nn.functional.nope": ("x", linear_checker, linear_impl)})
    with pytest.raises(ConfigurationError, match="cannot be removed"):
        unregister_backend("eager")
    # a plan for every stage serves (virtual) stages beyond those it was built for; a per-stage one does not
    assert resolve_backends("inductor", 2).chain(5, "eval").names == ["inductor", "eager"]
    with pytest.raises(ConfigurationError, match=r"chains for stages \[0, 1\] but stage 3"):
        resolve_backends(["eager", "inductor"], 2).chain(3, "train")


def test_a_raising_op_checker_is_reported_with_the_backend_name() -> None:
    register_backend("flaky", {LINEAR: ("flaky_linear", raising_checker, linear_impl)}, add_to_default=False)
    model, (x, _) = mlp(), batch()
    with Pipeline(model, stages=2, partition=[2, 3], backend="flaky", timeout=30) as pipe:
        with pytest.raises(StageError, match=r"checker of backend 'flaky' for torch.nn.functional.linear .*bug"):
            pipe.forward(x)


def test_a_raising_stage_checker_is_reported_with_the_backend_name() -> None:
    register_backend("broken", add_to_default=False, compiler=_BrokenChecker)
    model, (x, _) = mlp(), batch()
    with Pipeline(model, stages=2, partition=[2, 3], backend="broken", timeout=30) as pipe:
        with pytest.raises(StageError, match=r"checker of backend 'broken' raised for stage 0 \(eval\).*checker bug"):
            pipe.forward(x)


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
