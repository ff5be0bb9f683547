"""`Lifecycle`: what a fit (or validate, test, predict) sets up around the user's objects, and what its end undoes.

The strategy's ``setup`` runs Lightning's own steps (the accelerator, the precision plugin, the optimizers) and
hands the rest here: the parts learn the fit's optimizers and Trainer, the pipelined module's ``forward`` goes to
the step driver, the callbacks join the Trainer. ``teardown`` and ``on_exception`` end it: the stages' state kept
for the next fit and the checkpoints after it, the user's objects as they were, the stages stopped, and in
launched mode the serving ranks released.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.strategy.hooks import RuntimeHooks, install
from lightning_pipe.strategy.interrupts import CtrlC
from lightning_pipe.strategy.model_state import ModelState
from lightning_pipe.strategy.modes.mode import Mode
from lightning_pipe.strategy.patch import Patches
from lightning_pipe.strategy.random_state import RandomStreams
from lightning_pipe.strategy.steps import StepDriver, StepSetting
from lightning_pipe.strategy.trace_callback import PipeTrace
from lightning_pipe.strategy.unread import resuming_over_weights


class Lifecycle:
    """Starts and ends a fit over the strategy's parts: ``state`` (the model's, with the builder and optimization),
    ``steps``, ``random``; ``pipe_trace``: the user's timeline callback, if any."""

    def __init__(
        self, state: ModelState, steps: StepDriver, random: RandomStreams, pipe_trace: PipeTrace | None
    ) -> None:
        self.state = state
        self.steps = steps
        self.random = random
        self.pipe_trace = pipe_trace
        self.runtime_hooks = RuntimeHooks(steps.runtime_hook)  # the stages' runtime callbacks at Lightning's hooks
        self.patches = Patches()  # attributes set on the user's objects for this fit, restored exactly
        self.ctrl_c = CtrlC()  # Ctrl-C works again after a fit it stopped
        self._said_resuming = False  # that ckpt_path= wins over weights= is said once

    def begin(self, module: pl.LightningModule) -> None:
        """At the start of the strategy's setup: the fit can run (automatic optimization; stages sharded with FSDP,
        known once ``configure_model`` ran, run what they can: `ScheduleSelection.stages_sharded`), and Ctrl-C's
        handler is remembered."""
        self.ctrl_c.remember()
        if not module.automatic_optimization:
            raise ConfigurationError(
                "PipeStrategy runs the backward inside the pipeline and supports automatic optimization only; "
                "set self.automatic_optimization = True"
            )
        sharded = self.state.stage.sharded  # launched mode with R > 1: data_parallel="fsdp" or the module's own
        if sharded is not None:
            self.state.builder.selection.stages_sharded(sharded)
        self.state.builder.selection.say_left_out()  # schedule="auto": the schedules FSDP leaves out, and why

    def resuming(self) -> None:
        """``ckpt_path=`` is read for this fit (Lightning reads it before setup): it resumes a run that started from
        ``PipeStrategy(weights=...)``, so the checkpoint's values win and the weights are not read in this fit (said
        once; a later fit without ``ckpt_path`` reads them again)."""
        checkpoints = self.state.checkpoints
        if checkpoints.weights is None:
            return
        if not self._said_resuming:
            self._said_resuming = True
            rank_zero_warn(resuming_over_weights(checkpoints.weights))
        self.patches.set(checkpoints, "weights", None)  # restored when the fit ends (`shutdown`)

    def start(self, trainer: pl.Trainer, mode: Mode, precision: Any, device: torch.device) -> None:
        """At the end of the strategy's setup (the optimizers made): the parts learn the fit, the pipelined module's
        calls go to the step driver, the callbacks join the Trainer; the pipeline is built where it can be now."""
        state, builder, optimization = self.state, self.state.builder, self.state.optimization
        module, pipelined = state.module, builder.pipelined
        assert pipelined is not None
        mode.prepare_optimization(builder.outside(module))
        optimization.name_parameters(module, pipelined, state.host.optimizers)
        self.steps.setup(StepSetting(module, trainer, device, getattr(precision, "scaler", None)))
        self.patches.set(pipelined, "forward", self.steps.forward)
        mode.install(self.patches)
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        install(callbacks, self.runtime_hooks, *([self.pipe_trace] if self.pipe_trace is not None else []))
        optimization.install(callbacks, precision)
        builder.build_early(getattr(module, "example_input_array", None))

    def end(self, mode: Mode) -> None:
        """At teardown: what the next fit and the checkpoints after this one need of the stages, then `shutdown`."""
        builder = self.state.builder
        try:
            mode.end_fit()  # its last checkpoint written and published before fit returns
            builder.keep_trace()  # execution_trace() after this fit/validate/test/predict
            self.steps.end_stream()
            self.random.keep(builder.pipeline)
            mode.keep_stages()  # rpc mode, a model built on meta: its trained stages, for checkpoints
        finally:
            self.shutdown(mode)

    def abort(self, mode: Mode, error: BaseException) -> None:
        """After ``error``: the stages may be gone, nothing to gather from them nor to drain."""
        self.state.optimization.forget_stages()
        mode.end_fit(error)  # a checkpoint still being written is published only if it completes
        self.steps.training.abort()
        self.shutdown(mode, error)

    def shutdown(self, mode: Mode, error: BaseException | None = None) -> None:
        try:
            self.steps.end_stream()
            self.state.checkpoints.close()
            mode.fold_back()  # where one process holds the model: the stages' trained values
        finally:  # whatever failed above: the user's objects as they were, the stages stopped
            self.patches.restore()
            self.steps.close()
            try:
                self.state.builder.close()
            finally:
                mode.release(error)  # launched mode: the serving ranks return from this fit
