"""``PipeStrategy(schedule="async")``: a Trainer trains through the asynchronous stream (no flush between
batches, per-stage optimizers, weight stashing) and the weights equal a plain replay of the same versions."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, mlp
from test_async import reference_2bw
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError

SPLIT = [2, 2, 3]  # mlp(depth=4): Linear Tanh | Linear Tanh | Linear Tanh Linear


def separable(rows: int, seed: int) -> TensorDataset:
    """Three classes that a small MLP separates: the argmax of a fixed linear map of the inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(99))
    return TensorDataset(x, (x @ w).argmax(-1))


def accuracy(model: torch.nn.Module, ds: TensorDataset) -> float:
    with torch.no_grad():
        x, y = ds.tensors
        return float((model(x).argmax(-1) == y).float().mean())


def fit(module: L.LightningModule, schedule: str, train: DataLoader, val: DataLoader | None = None,
        **trainer: Any) -> L.Trainer:  # fmt: skip
    strategy = PipeStrategy(stages=3, microbatches=4, schedule=schedule, partition=SPLIT)
    t = L.Trainer(**(dict(QUIET, max_epochs=1, strategy=strategy) | trainer))
    t.fit(module, train, val)
    return t


def test_weights_equal_a_replay_of_the_stashed_versions() -> None:
    """One epoch is one stream: the final parameters equal the plain PyTorch 2BW replay of tests/test_async.py
    (same versions per microbatch, SGD per stage after each batch); Lightning's optimizer did not step them again."""
    ds = separable(96, seed=1)
    batches = list(DataLoader(ds, batch_size=16))
    module = Classifier(mlp(depth=4), lr=0.3)
    expected = reference_2bw(module.model, SPLIT, batches, per_batch=4, lr=0.3)
    t = fit(module, "async", DataLoader(ds, batch_size=16), limit_val_batches=0)
    for (name, p), q in zip(module.model.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=name)
    stats = t.strategy.staleness()
    assert [s.stage for s in stats] == [0, 1, 2]
    assert [s.updates for s in stats] == [6, 6, 6]
    assert [s.microbatches for s in stats] == [24, 24, 24]
    # stage s runs 3 - s - 1 forwards ahead: with 4 microbatches per batch, staleness <= 1, 0 on the last stage
    assert [s.max for s in stats] == [1, 1, 0]
    assert [s.stale for s in stats] == [10, 5, 0]  # the first (2 - s) microbatches of batches 1..5


def test_converges_like_1f1b_and_validation_sees_the_final_weights() -> None:
    """3 epochs on separable data: async reaches 1f1b's accuracy within 3 points; the last validation's
    loss is the final weights' loss (the stream drained before it); staleness is at most 1."""
    train, val = separable(512, seed=1), separable(256, seed=2)
    results = {}
    for schedule in ("1f1b", "async"):
        module = Classifier(mlp(depth=4), lr=0.2)
        t = fit(module, schedule, DataLoader(train, batch_size=32, shuffle=False), DataLoader(val, batch_size=64),
                max_epochs=3)  # fmt: skip
        results[schedule] = (accuracy(module.model, val), t)
        with torch.no_grad():
            x, y = val.tensors
            final = sum(F.cross_entropy(module.model(x[i : i + 64]), y[i : i + 64]) for i in range(0, 256, 64)) / 4
        assert float(t.callback_metrics["val_loss"]) == pytest.approx(float(final), rel=1e-5)
    sync_acc, async_acc = results["1f1b"][0], results["async"][0]
    print(f"val accuracy: 1f1b {sync_acc:.3f}, async {async_acc:.3f}")
    assert sync_acc > 0.85
    assert async_acc >= sync_acc - 0.03
    stats = results["async"][1].strategy.staleness()
    print("staleness per stage (mean, max):", [(round(s.mean, 3), s.max) for s in stats])
    assert [s.updates for s in stats] == [48, 48, 48]  # 16 batches x 3 epochs, one stream per epoch
    assert max(s.max for s in stats) == 1 and stats[-1].max == 0


class Scheduled(Classifier):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.0), "interval": "step"},
        }


def test_lr_scheduler_reaches_the_stage_optimizers() -> None:
    """StepLR(gamma=0) each step: the stages built SGD with momentum from configure_optimizers and take
    the scheduler's lr=0 from the second batch on, so the weights move only on the first batch."""
    ds = separable(64, seed=3)
    once, many = Scheduled(mlp(depth=4)), Scheduled(mlp(depth=4))
    fit(once, "async", DataLoader(ds, batch_size=16), limit_val_batches=0, max_steps=1)
    t = fit(many, "async", DataLoader(ds, batch_size=16), limit_val_batches=0)
    optimizers = [o for o, _ in t.strategy.steps.training.stage_optimizers]
    assert len(optimizers) == 3 and all(type(o) is torch.optim.SGD for o in optimizers)
    assert all(o.param_groups[0]["momentum"] == 0.5 and o.param_groups[0]["lr"] == 0.0 for o in optimizers)
    start = mlp(depth=4)
    assert any(not torch.equal(p, q) for p, q in zip(many.parameters(), start.parameters(), strict=True))
    # max_steps=1: the stream held only the first batch; the weights after it are the same
    for p, q in zip(many.parameters(), once.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_async_needs_the_local_transport() -> None:
    with pytest.raises(ConfigurationError, match="transport='local'"):
        PipeStrategy(stages=2, schedule="async", transport="rpc")


def test_stage_parameters_are_not_stepped_by_lightning() -> None:
    """Lightning's optimizer holds placeholders for the stage parameters, the same number per group."""
    module = Classifier(mlp(depth=4), lr=0.1)
    ds = separable(32, seed=4)
    t = fit(module, "async", DataLoader(ds, batch_size=16), limit_val_batches=0)
    (optimizer,) = t.optimizers
    params = optimizer.param_groups[0]["params"]
    assert len(params) == len(list(module.parameters()))
    assert all(p.numel() == 0 and p.grad is None for p in params)
    assert copy.deepcopy(optimizer.state_dict())["param_groups"][0]["params"] == list(range(len(params)))


class StopAfter(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            trainer.should_stop = True


def test_stopping_in_the_middle_of_a_stream_ends_cleanly() -> None:
    """Lightning stops after 2 of the 4 batches planned for the stream: a warning, no hang, and a
    validation afterwards sees the module's weights."""
    module = Classifier(mlp(depth=4), lr=0.1)
    ds = separable(64, seed=5)
    with pytest.warns(UserWarning, match="2 of the 4 batches"):
        t = fit(module, "async", DataLoader(ds, batch_size=16), callbacks=[StopAfter()])
    assert t.global_step == 2
    (metrics,) = t.validate(module, DataLoader(ds, batch_size=16), verbose=False)
    assert metrics["val_acc"] == pytest.approx(accuracy(module.model, ds), abs=1e-6)


class Momentum(Classifier):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def test_checkpoint_resume_carries_the_stage_optimizers_state(tmp_path: Any) -> None:
    """2 epochs straight equal 1 epoch, a checkpoint, and a resumed second epoch: the stages' momentum
    buffers are in the checkpoint at the stage parameters' indices and reach the new stage optimizers."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ds = separable(64, seed=6)
    straight, first, resumed = Momentum(mlp(depth=4)), Momentum(mlp(depth=4)), Momentum(mlp(depth=4))
    fit(straight, "async", DataLoader(ds, batch_size=16), limit_val_batches=0, max_epochs=2)
    saver = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    fit(first, "async", DataLoader(ds, batch_size=16), limit_val_batches=0, enable_checkpointing=True,
        callbacks=[saver])  # fmt: skip
    state = torch.load(saver.last_model_path, weights_only=False)["optimizer_states"][0]
    assert sorted(state["state"]) == list(range(len(list(first.parameters()))))
    assert all(v["momentum_buffer"].abs().sum() > 0 for v in state["state"].values())
    t = L.Trainer(**(dict(QUIET, max_epochs=2, limit_val_batches=0) | {"strategy": PipeStrategy(
        stages=3, microbatches=4, schedule="async", partition=SPLIT)}))  # fmt: skip
    t.fit(resumed, DataLoader(ds, batch_size=16), ckpt_path=saver.last_model_path)
    for p, q in zip(resumed.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
