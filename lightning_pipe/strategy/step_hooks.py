"""`StepHooksStrategy`: Lightning's hooks of a step: the steps, ``backward``, the optimizer step, the batch.

Lightning calls these on the strategy itself for every batch. Each step runs through the pipeline,
microbatch by microbatch (`StepDriver`); ``backward`` puts the gradients the pipeline computed on the
parameters, and the optimizer step goes where the parameters live (`StageOptimization`). `PipeStrategy`
extends this with the pipeline's setup and teardown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from lightning_pipe.strategy.model_state import ModelStateStrategy
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.steps import StepDriver


class StepHooksStrategy(ModelStateStrategy):
    """A `ModelStateStrategy` whose steps run as pipelines: ``steps`` runs them, ``optimization`` owns the
    gradients and the optimizer steps; the other arguments go to `ModelStateStrategy`."""

    def __init__(self, *args: Any, steps: StepDriver, optimization: StageOptimization, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = steps
        self.optimization = optimization

    # steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run("training_step", args, kwargs, self.precision_plugin.train_step_context)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run("validation_step", args, kwargs, self.precision_plugin.val_step_context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run("test_step", args, kwargs, self.precision_plugin.test_step_context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run("predict_step", args, kwargs, self.precision_plugin.predict_step_context)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Put the gradients the pipeline computed during ``training_step`` on ``p.grad``.

        Lightning zeroes gradients between ``training_step`` and ``backward``, so the pipeline keeps
        them aside until now. The precision plugin's hooks still run (``on_before_backward``,
        ``on_after_backward``); ``LightningModule.backward`` is not called: the pipeline did the backward.
        """
        lightning_module, pipeline = self.lightning_module, self.builder.pipeline
        assert lightning_module is not None and pipeline is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lightning_module)
        self.optimization.apply_grads(pipeline, 1.0 / lightning_module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if not self.optimization.steps_stages(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        return self.optimization.optimizer_step(self.precision_plugin, optimizer, model, closure, **kwargs)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        return super().batch_to_device(batch, device or self.root_device, dataloader_idx)
