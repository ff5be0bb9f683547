"""A Lightning callback that calls the stages' runtime hooks at the matching Trainer hooks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


@dataclass
class TrainerView:
    """What a runtime hook learns about the Trainer (picklable, so it reaches remote stages too)."""

    current_epoch: int
    global_step: int
    fn: str
    stage: str

    @classmethod
    def of(cls, trainer: pl.Trainer) -> TrainerView:
        return cls(
            trainer.current_epoch,
            trainer.global_step,
            str(trainer.state.fn.value if trainer.state.fn else ""),
            str(trainer.state.stage.value if trainer.state.stage else ""),
        )


class RuntimeHooks(pl.Callback):
    """Maps Trainer hooks onto the runtime callbacks of every stage."""

    def __init__(self, runtime_hook: Callable[..., None]) -> None:
        self.runtime_hook = runtime_hook  # calls ``runtime.<name>(*args)`` on every stage (`StepDriver.runtime_hook`)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.runtime_hook("train_epoch_begin")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.runtime_hook("train_pre_step", TrainerView.of(trainer), batch_idx, batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.runtime_hook("train_post_step", TrainerView.of(trainer), batch_idx, batch, outputs)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.runtime_hook("train_validation_begin")

    def _eval_pre(self, trainer: pl.Trainer, batch: Any, batch_idx: int) -> None:
        self.runtime_hook("eval_pre_step", TrainerView.of(trainer), batch_idx, batch)

    def _eval_post(self, trainer: pl.Trainer, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.runtime_hook("eval_post_step", TrainerView.of(trainer), batch_idx, batch, outputs)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_pre(trainer, batch, batch_idx)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_post(trainer, outputs, batch, batch_idx)

    # test and predict batches run the same evaluation callbacks
    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end
    on_predict_batch_start = on_validation_batch_start
    on_predict_batch_end = on_validation_batch_end


def install(callbacks: list[pl.Callback], *wanted: pl.Callback) -> None:
    """Add each of ``wanted`` to the Trainer's ``callbacks`` unless it is there already (a fit after a fit)."""
    for callback in wanted:
        if not any(existing is callback for existing in callbacks):
            callbacks.append(callback)
