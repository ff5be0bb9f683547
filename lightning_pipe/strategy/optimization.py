"""The optimizer side of `PipeStrategy`: backward, optimizer steps and optimizer state in checkpoints.

The pipeline computes the gradients inside ``training_step``; ``backward`` puts them on ``p.grad``.
When the stages own their parameters (``transport="rpc"`` and launched mode), Lightning's optimizers
step the stages (`lightning_pipe.strategy.remote`) and checkpoints gather the stages' state under the
unsplit module's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_pipe.grads import GradStash
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.strategy.asynchronous import AsyncTraining
from lightning_pipe.strategy.remote import StageParameters

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy as _Strategy
else:
    _Strategy = object


class StageOptimization(_Strategy):
    """Mixed into `PipeStrategy`: gradients, optimizer steps and optimizer state of the stages."""

    pipeline: Pipeline | None
    _stage_params: StageParameters | None
    _async: AsyncTraining | None
    _outside: GradStash
    _trainer: Any

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._stage_params is not None:  # the stages' parts, now or once the stages are built
            self._stage_params.load(self.optimizers, checkpoint["optimizer_states"])
            return
        if self._async is not None and self._async.template is not None:
            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
                if optimizer is self._async.template:
                    self._async.load_state_dict(state)
                else:
                    optimizer.load_state_dict(state)
            return
        # torch moves each state to its parameter's device; Lightning's version would move it to one device
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            optimizer.load_state_dict(state)

    # stages that own their parameters (rpc, launched): steps and checkpoints go through them
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._stage_params is None or self._stage_params.view(optimizer) is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        return self._stage_params.optimizer_step(self.precision_plugin, optimizer, model, closure, **kwargs)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._async is not None and getattr(optimizer, "_optimizer", optimizer) is self._async.template:
            return self._async.state_dict()
        state = self._stage_params.state(optimizer) if self._stage_params is not None else None
        return state if state is not None else super().optimizer_state(optimizer)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._async is not None and self._async.stream is not None and not self._async.stream.closed:
            rank_zero_warn(
                "PipeStrategy(schedule='async'): a checkpoint in the middle of a stream holds the live weights, "
                "with the updates of batches in flight missing; checkpoints at the end of an epoch or validation "
                "see every update"
            )
        if self._stage_params is not None and self.pipeline is not None:
            self.pipeline.sync_module()
        return super().lightning_module_state_dict()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Put the gradients the pipeline computed during ``training_step`` on ``p.grad``.

        Lightning zeroes gradients between ``training_step`` and ``backward``, so the pipeline keeps
        them aside until now. The precision plugin's hooks still run (``on_before_backward``,
        ``on_after_backward``); ``LightningModule.backward`` is not called: the pipeline did the backward.
        """
        lightning_module = self.lightning_module
        assert lightning_module is not None and self.pipeline is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lightning_module)
        scale = 1.0 / self._trainer.accumulate_grad_batches
        if self._async is None:  # async: the stages stepped their own parameters
            self.pipeline.apply_grads(scale)
        self._outside.apply(scale)
        closure_loss = self.precision_plugin.post_backward(closure_loss, lightning_module)
        self.post_backward(closure_loss)
        return closure_loss
