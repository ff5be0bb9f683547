"""``self.model = torch.compile(self.model)`` under PipeStrategy, and failed fits that leave the module as it was.

The pipeline splits the original module and compiles each stage with inductor, keeping the options given to
torch.compile; a fit that fails anywhere after setup started restores what the strategy set on the module.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, dataset, loader, max_param_diff, mlp
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pipe import Pipeline, PipeStrategy, PyTorchRuntime
from lightning_pipe.backends import InductorCompiler, OpCounter, get_backend
from lightning_pipe.backends.compiled import unwrap_compiled
from lightning_pipe.backends.ops import OpTable
from lightning_pipe.base.errors import ConfigurationError

X = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))


def pipe(**kwargs: Any) -> PipeStrategy:
    return PipeStrategy(**{"stages": 2, "microbatches": 4, "devices": ["cpu", "cpu"], "timeout": 240, **kwargs})


def fit(module: L.LightningModule, strategy: Any = None, steps: int = 3, **trainer: Any) -> L.Trainer:
    args: dict[str, Any] = dict(QUIET, max_steps=steps) | trainer
    if strategy is not None:
        args["strategy"] = strategy
    t = L.Trainer(**args)
    t.fit(module, loader(dataset(rows=64), batch_size=16))
    return t


# what torch.compile was asked for reaches the stages
def test_unwrap_keeps_the_torch_compile_options() -> None:
    model = mlp()
    compiled = unwrap_compiled(torch.compile(model, mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False))
    assert compiled is not None and compiled.module is model
    settings = {"max_autotune": True, "coordinate_descent_tuning": True}  # what the mode stands for
    assert compiled.options == {"fullgraph": True, "dynamic": False, "options": settings}
    plan = compiled.plan(None, 2)
    for stage in range(2):
        for mode in ("train", "eval"):
            chain = plan.chain(stage, mode)
            assert chain.requested == ["inductor"] and chain.names[0] == "inductor"
            backend = chain.backends[0]
            assert backend.options == compiled.options
            inductor = InductorCompiler(model, OpTable([]), OpCounter(), backend.name, "test", backend.options)
            assert inductor.dynamo_options == {"fullgraph": True, "dynamic": False}
            assert inductor.inductor_config == settings
    assert get_backend("inductor").options == {}  # the registry is left alone
    assert unwrap_compiled(model) is None
    disabled = unwrap_compiled(torch._dynamo.disable(model))
    assert disabled is not None and disabled.module is model and disabled.options is None
    assert disabled.plan(None, 2).chain(0, "train").names == ["eager"]


def test_inductor_stage_backend_takes_a_mode() -> None:
    """``backend`` options with a mode: torch.compile would pass ``mode`` to a custom backend, which fails."""
    model = nn.Linear(4, 3)
    options = {"mode": "max-autotune-no-cudagraphs"}
    compiler = InductorCompiler(model, OpTable([]), OpCounter(), "inductor", "test", options)
    assert compiler.inductor_config == {"max_autotune": True, "coordinate_descent_tuning": True}
    assert compiler.dynamo_options == {}
    with pytest.raises(ConfigurationError, match="either mode"):
        InductorCompiler(model, OpTable([]), OpCounter(), "inductor", "test", {"mode": "default", "options": {"a": 1}})


def test_other_dynamo_backends_are_refused_naming_the_alternative() -> None:
    """A failure in setup: the module keeps its compiled forward and still trains on a plain Trainer."""
    piped, plain = Classifier(torch.compile(mlp(), backend="eager")), Classifier(torch.compile(mlp(), backend="eager"))
    forward = piped.model.__dict__["forward"]
    with pytest.raises(ConfigurationError, match=r"torch\.compile\(Sequential, backend='eager'\).*backend='inductor'"):
        fit(piped, pipe())
    assert piped.model.__dict__["forward"] is forward and "log" not in piped.__dict__
    fit(piped, None, steps=2)
    fit(plain, None, steps=2)
    assert max_param_diff(piped, plain) < 1e-6
    with pytest.raises(ConfigurationError, match="backend='inductor'"):
        Pipeline(torch.compile(mlp(), backend="eager"), stages=2)


# a failed fit leaves the module as it was
class FailingClassifier(Classifier):
    """Raises in ``training_step`` at ``fail_at`` (after that many steps), or in ``on_fit_start``."""

    def __init__(self, model: nn.Module, fail_at: int | None = None, fail_on_start: bool = False) -> None:
        super().__init__(model)
        self.fail_at, self.fail_on_start = fail_at, fail_on_start

    def on_fit_start(self) -> None:
        if self.fail_on_start:
            raise RuntimeError("boom in on_fit_start")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)


class BrokenRuntime(PyTorchRuntime):
    """Fails to place the stage: the pipeline's construction fails inside the strategy's setup."""

    def move_module(self, module: nn.Module) -> nn.Module:
        raise RuntimeError("boom placing the stage")


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
@pytest.mark.parametrize("failure", ["training_step", "on_fit_start", "building the stages"])
def test_failed_fit_leaves_the_module_unchanged(compiled: bool, failure: str) -> None:
    """Same failure on a plain Trainer with the uncompiled twin: same parameters, outputs, and later training.

    The compiled module's stages run with backend="eager" here: what is restored does not depend on how the
    stages ran, and the test stays fast (test_compiled_module_trains_like_the_uncompiled_pipeline compiles).
    """
    fail_at = 2 if failure == "training_step" else None
    fail_on_start = failure == "on_fit_start"
    inner = mlp()
    reference = FailingClassifier(copy.deepcopy(inner), fail_at, fail_on_start)
    module = FailingClassifier(torch.compile(inner) if compiled else inner, fail_at, fail_on_start)
    before = dict(module.model.__dict__)
    options: dict[str, Any] = {"backend": "eager"} if compiled else {}
    if failure == "building the stages":
        module.example_input_array = X  # the pipeline is built in setup, on this example
        options["runtime"] = BrokenRuntime("cpu")
    with pytest.raises(Exception, match="boom"):
        fit(module, pipe(**options))
    if failure != "building the stages":
        with pytest.raises(RuntimeError, match="boom"):
            fit(reference, None)
    # exactly the attributes it had: a compiled module keeps its own compiled forward, a plain one has none
    assert module.model.__dict__.keys() == before.keys()
    assert all(module.model.__dict__[k] is v for k, v in before.items())
    assert ("forward" in module.model.__dict__) == compiled and "log" not in module.__dict__
    assert max_param_diff(module, reference) < 1e-6  # trained as far as the plain run got, no further
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):  # the same gradients left over
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(module.model(X), reference.model(X), atol=1e-6, rtol=0)
    # and it runs on a plain Trainer afterwards
    module.fail_at = reference.fail_at = None
    module.fail_on_start = reference.fail_on_start = False
    trainer = L.Trainer(**QUIET)
    got = trainer.predict(module, loader(dataset(rows=16), batch_size=8))
    want = trainer.predict(reference, loader(dataset(rows=16), batch_size=8))
    assert got is not None and want is not None
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_plan_restores_the_compiled_forward() -> None:
    module = Classifier(torch.compile(mlp()))
    forward = module.model.__dict__["forward"]
    memory = pipe(checkpoint="never").plan(module, next(iter(loader(dataset(rows=16), batch_size=16))), verbose=False)
    assert len(memory.stages) == 2
    assert module.model.__dict__["forward"] is forward and "log" not in module.__dict__


@pytest.mark.slow
def test_compiled_module_trains_like_the_uncompiled_pipeline(tmp_path: Any) -> None:
    """Stages compiled with inductor equal eager stages (1e-5); the checkpoint loads into a plain Trainer.

    Compiles 2 stages (train) and, on the plain Trainer, the whole module (eval): ~30-60 s cold on 2 busy
    cores, much less with inductor's cache.
    """
    inner = mlp()
    compiled = Classifier(torch.compile(copy.deepcopy(inner), fullgraph=True))
    eager = Classifier(copy.deepcopy(inner))
    forward = compiled.model.__dict__["forward"]

    class Backends(L.Callback):
        options: list[dict[str, Any]] = []

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            plan = trainer.strategy.pipeline.backend  # type: ignore[attr-defined]
            self.options = [plan.chain(s, "train").backends[0].options for s in range(2)]

    seen = Backends()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = fit(compiled, pipe(), enable_checkpointing=True, callbacks=[ckpt, seen])
    fit(eager, pipe())
    assert max_param_diff(compiled, eager) < 1e-5
    assert max_param_diff(compiled, Classifier(inner)) > 1e-3  # it trained
    trace = trainer.strategy.execution_trace()  # type: ignore[attr-defined]
    # 3 steps x 4 microbatches, each forward once (checkpoint="auto" does not recompute on cpu)
    assert [trace[s].runs["train"] for s in range(2)] == [{"inductor": 3 * 4}] * 2
    assert seen.options == [{"fullgraph": True, "dynamic": None}] * 2
    assert compiled.model.__dict__["forward"] is forward

    # the checkpoint holds the LightningModule's own keys: those of the same compiled module on a plain Trainer
    state = torch.load(ckpt.last_model_path, weights_only=False)["state_dict"]
    fresh = Classifier(torch.compile(mlp(seed=7), fullgraph=True))
    assert set(state) == set(fresh.state_dict()) and any("_orig_mod." in k for k in state)
    val = loader(dataset(rows=32, seed=3), batch_size=16)
    got = L.Trainer(**QUIET).validate(fresh, val, ckpt_path=ckpt.last_model_path, verbose=False)
    want = L.Trainer(**QUIET).validate(eager, val, verbose=False)
    assert max_param_diff(fresh, eager) < 1e-5
    assert got[0]["val_loss"] == pytest.approx(want[0]["val_loss"], abs=1e-5)
