"""Backends that cannot serve: tensorrt without torch_tensorrt, compilers that give up, strict, bad arguments."""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from backend_ops import LINEAR, batch, linear_checker, linear_impl, mlp, raising_checker, reference_grads
from backend_ops import clean_registry as clean_registry  # autouse: each test starts from the default registry
from torch import nn

from lightning_pipe.backends import (
    BackendUnavailableError,
    EagerCompiler,
    StageContext,
    TensorMeta,
    TensorRTCompiler,
    import_torch_tensorrt,
    register_backend,
    resolve_backends,
    unregister_backend,
)
from lightning_pipe.base.errors import ConfigurationError, StageError
from lightning_pipe.pipeline.pipeline import Pipeline


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
