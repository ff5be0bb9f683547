"""Lightning features keep working under PipeStrategy: each test compares with a plain Trainer run
and checks that the feature changed something, so that it fails if the strategy drops the feature."""

from __future__ import annotations

import copy
import csv
import glob
import os
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, loader, max_param_diff, mlp
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_pipe import PipeStrategy


def pipe(**kwargs: Any) -> PipeStrategy:
    return PipeStrategy(**{"stages": 2, "microbatches": 4, "partition": "uniform", **kwargs})


def run(
    module: L.LightningModule, strategy: Any = None, data: Any = None, val: Any = None, **trainer: Any
) -> L.Trainer:
    args = dict(QUIET, max_epochs=1) | trainer
    if strategy is not None:
        args["strategy"] = strategy
    t = L.Trainer(**args)
    t.fit(module, data if data is not None else loader(), val)
    return t


def test_accumulate_grad_batches() -> None:
    a, b, c = Classifier(), Classifier(), Classifier()
    run(a, pipe(), accumulate_grad_batches=2)
    run(b, None, accumulate_grad_batches=2)
    run(c, pipe())
    assert max_param_diff(a, b) < 1e-6
    assert max_param_diff(a, c) > 1e-4  # accumulation changed the result


def test_gradient_clipping_uses_global_norm() -> None:
    a, b, c = Classifier(lr=1.0), Classifier(lr=1.0), Classifier(lr=1.0)
    run(a, pipe(stages=3), gradient_clip_val=0.05)
    run(b, None, gradient_clip_val=0.05)
    run(c, pipe(stages=3))
    assert max_param_diff(a, b) < 1e-6
    assert max_param_diff(a, c) > 1e-3


class Scheduled(Classifier):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.1)}}


def test_lr_scheduler() -> None:
    a, b, c = Scheduled(), Scheduled(), Classifier()
    ta = run(a, pipe(), max_epochs=3)
    run(b, None, max_epochs=3)
    run(c, pipe(), max_epochs=3)
    assert ta.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**3)
    assert max_param_diff(a, b) < 1e-6
    assert max_param_diff(a, c) > 1e-4


class DtypeProbe(Classifier):
    """Records the dtype each Linear layer produced, from whatever thread ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_hook(lambda m, i, o: self.dtypes.add(o.dtype))


def test_bf16_mixed_runs_stages_under_autocast() -> None:
    a, b = DtypeProbe(), DtypeProbe()
    run(a, pipe(), precision="bf16-mixed")
    run(b, None, precision="bf16-mixed")
    assert a.dtypes == {torch.bfloat16} == b.dtypes
    assert max_param_diff(a, b) < 1e-3  # bf16 rounding differs with the microbatch shapes


def test_bf16_true_leaves_the_default_dtype_as_it_was_and_trains_like_the_plain_trainer() -> None:
    """``precision="bf16-true"`` sets torch's default dtype (process-wide) in each step's context; with four
    microbatches whose threads overlap, the step holds it once around them all, so every microbatch's step sees
    bf16 and the fit ends with the default dtype it started with (a leaked bf16 default made the next fit's data
    and model bf16)."""
    a, b = DtypeProbe(), DtypeProbe()
    for _ in range(3):  # overlapping exits leave bf16 behind only sometimes
        run(a, pipe(), precision="bf16-true", max_steps=2)
        assert torch.get_default_dtype() == torch.float32
        run(b, None, precision="bf16-true", max_steps=2)
    assert a.dtypes == {torch.bfloat16} == b.dtypes
    assert max_param_diff(a, b) < 4e-3  # bf16 parameters (measured 9.8e-4): rounding differs with the microbatches


def scaler_plugin(init_scale: float) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def test_16_mixed_with_grad_scaler() -> None:
    """A huge initial scale overflows in float16: the step is skipped and the scale drops, as without pipe."""
    a, b, c = DtypeProbe(), DtypeProbe(), DtypeProbe()
    ta = run(a, pipe(), plugins=[scaler_plugin(2.0**60)], max_steps=3)
    tb = run(b, None, plugins=[scaler_plugin(2.0**60)], max_steps=3)
    run(c, pipe(), plugins=[scaler_plugin(1.0)], max_steps=3)
    assert a.dtypes == {torch.float16}
    scale_a = ta.precision_plugin.scaler.get_scale()  # type: ignore[attr-defined]
    scale_b = tb.precision_plugin.scaler.get_scale()  # type: ignore[attr-defined]
    assert scale_a == scale_b < 2.0**60
    assert max_param_diff(a, b) < 1e-4
    assert max_param_diff(a, c) > 1e-4  # the skipped steps made a difference


def test_checkpoint_resume_with_other_stage_count_and_plain_trainer(tmp_path: Any) -> None:
    data = loader()
    full = Classifier()
    run(full, None, data, max_epochs=4)

    first = Classifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    run(first, pipe(stages=2), data, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt])
    state = torch.load(ckpt.last_model_path, weights_only=False)["state_dict"]
    assert set(state) == set(Classifier().state_dict())  # the unsplit model's keys

    resumed = Classifier()
    t = L.Trainer(**(QUIET | dict(max_epochs=4)), strategy=pipe(stages=4))
    t.fit(resumed, data, ckpt_path=ckpt.last_model_path)
    assert max_param_diff(resumed, full) < 1e-6

    plain_resumed = Classifier()
    L.Trainer(**(QUIET | dict(max_epochs=4))).fit(plain_resumed, data, ckpt_path=ckpt.last_model_path)
    assert max_param_diff(plain_resumed, full) < 1e-6

    # and the other way round: a plain checkpoint resumed under the pipeline
    plain_first = Classifier()
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "plain", save_last=True)
    run(plain_first, None, data, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt2])
    piped_resumed = Classifier()
    L.Trainer(**(QUIET | dict(max_epochs=4)), strategy=pipe(stages=3)).fit(
        piped_resumed, data, ckpt_path=ckpt2.last_model_path
    )
    assert max_param_diff(piped_resumed, full) < 1e-6


def test_early_stopping_sees_logged_validation_metric() -> None:
    stop_a = EarlyStopping("val_loss", min_delta=10.0, patience=1)
    stop_b = EarlyStopping("val_loss", min_delta=10.0, patience=1)
    ta = run(Classifier(), pipe(), loader(), loader(), max_epochs=20, callbacks=[stop_a])
    tb = run(Classifier(), None, loader(), loader(), max_epochs=20, callbacks=[stop_b])
    assert ta.current_epoch == tb.current_epoch < 20
    assert stop_a.stopped_epoch == stop_b.stopped_epoch > 0


def test_progress_bar_shows_the_step_loss() -> None:
    ta = run(Classifier(), pipe(), loader(), loader(), enable_progress_bar=True)
    tb = run(Classifier(), None, loader(), loader(), enable_progress_bar=True)
    for key in ("train_loss", "val_loss"):
        assert key in ta.progress_bar_metrics
        assert ta.progress_bar_metrics[key] == pytest.approx(tb.progress_bar_metrics[key], abs=1e-6)


def read_csv_metric(path: str, key: str) -> list[float]:
    with open(glob.glob(os.path.join(path, "**", "metrics.csv"), recursive=True)[0]) as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def test_csv_logger_records_mean_over_microbatches(tmp_path: Any) -> None:
    run(Classifier(), pipe(microbatches=4), logger=CSVLogger(tmp_path / "pipe"), log_every_n_steps=1)
    run(Classifier(), None, logger=CSVLogger(tmp_path / "plain"), log_every_n_steps=1)
    got, want = (
        read_csv_metric(str(tmp_path / "pipe"), "train_loss"),
        read_csv_metric(str(tmp_path / "plain"), "train_loss"),
    )
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, abs=1e-6)


def test_tensorboard_logger(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(Classifier(), pipe(), logger=TensorBoardLogger(tmp_path), log_every_n_steps=1)
    events = glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(events[0])
    acc.Reload()
    assert len(acc.Scalars("train_loss")) == 4


class LogsInputMean(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.log("x_mean", x.mean(), on_step=True)
        self.log_dict({"rows": float(len(x))}, on_step=True)
        return F.cross_entropy(self.model(x), y)


def test_self_log_is_mean_over_microbatches(tmp_path: Any) -> None:
    """Uneven microbatches (16 rows in 3) are weighted by rows: the batch mean, as without the pipeline."""
    run(LogsInputMean(), pipe(microbatches=3), logger=CSVLogger(tmp_path / "pipe"), log_every_n_steps=1)
    run(LogsInputMean(), None, logger=CSVLogger(tmp_path / "plain"), log_every_n_steps=1)
    got, want = read_csv_metric(str(tmp_path / "pipe"), "x_mean"), read_csv_metric(str(tmp_path / "plain"), "x_mean")
    assert got == pytest.approx(want, abs=1e-6)
    rows = read_csv_metric(str(tmp_path / "pipe"), "rows")
    assert rows == pytest.approx([(6 * 6 + 5 * 5 + 5 * 5) / 16] * 4)  # each microbatch's value, row-weighted


def test_validate_test_predict() -> None:
    module, plain = Classifier(), copy.deepcopy(Classifier())
    trainer = L.Trainer(**QUIET, strategy=pipe(stages=3, microbatches=4))
    reference = L.Trainer(**QUIET)
    got_val, want_val = trainer.validate(module, loader()), reference.validate(plain, loader())
    assert got_val[0]["val_loss"] == pytest.approx(want_val[0]["val_loss"], abs=1e-6)
    assert trainer.test(module, loader())[0]["test_acc"] == pytest.approx(
        reference.test(plain, loader())[0]["test_acc"]
    )
    got, want = trainer.predict(module, loader(batch_size=10)), reference.predict(plain, loader(batch_size=10))
    assert [p.shape for p in got] == [p.shape for p in want]
    assert all(torch.equal(p, q) for p, q in zip(got, want, strict=True))


def test_strategy_name_is_registered() -> None:
    trainer = L.Trainer(**QUIET, strategy="pipe")
    assert isinstance(trainer.strategy, PipeStrategy)


def test_pipelined_module_keeps_its_forward_after_fit() -> None:
    module = Classifier(mlp())
    run(module, pipe())
    x = torch.randn(4, 8)
    assert "forward" not in module.model.__dict__
    assert module.model(x).shape == (4, 3)
