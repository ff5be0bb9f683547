"""Lightning's optimizers when the stages own their parameters (``transport="rpc"``).

Lightning keeps the optimizers ``configure_optimizers`` built over the coordinator's copy of the
module; that copy does not train. Each optimizer gets a `StageOptimizers` twin that steps the stages,
and the strategy routes Lightning through here: the optimizer step (closure, ``on_before_optimizer_step``,
gradient clipping, a GradScaler), ``zero_grad``, and the optimizer state in checkpoints. LR schedulers
keep writing the original optimizer's ``param_groups``; the stages take the values at the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_pipe.base.errors import PipeError
from lightning_pipe.pipeline.optimizers import StageOptimizers

if TYPE_CHECKING:
    from lightning_pipe.pipeline.pipeline import Pipeline


class StageOptimizerView:
    """What the precision plugin steps in place of the user's optimizer.

    ``param_groups`` are the user's optimizer's (hooks see the real learning rates); with a
    GradScaler one more group holds a sentinel parameter whose gradient carries the stages' inf
    check, so the scaler's own ``found_inf`` and ``update`` work unchanged. The view unscales in
    `after_backward` (before clipping), so it tells the scaler it handles unscaling itself.
    """

    _step_supports_amp_scaling = True

    def __init__(self, template: torch.optim.Optimizer, stages: StageOptimizers, sentinel: torch.Tensor) -> None:
        self.template = template
        self.stages = stages
        self.sentinel = sentinel
        self.scaler: Any = None  # GradScaler.step sets found_inf and grad_scale (already applied) on this object

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        if self.scaler is None:
            return self.template.param_groups
        return [*self.template.param_groups, {"params": [self.sentinel], "lr": 0.0}]

    @property
    def state(self) -> Any:
        return self.template.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.template.defaults

    def after_backward(self) -> None:
        """With a GradScaler: unscale every stage's gradients and record whether any overflowed."""
        if self.scaler is None:
            return
        found = self.stages.unscale_(1.0 / float(self.scaler.get_scale()))
        self.sentinel.grad = torch.full_like(self.sentinel, float("inf") if found else 0.0)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            return loss  # an overflow on some stage: skip this step, as GradScaler does
        self.stages.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.stages.zero_grad(set_to_none)


class StageParameters:
    """The strategy's handle on optimizers whose parameters live on the stages."""

    def __init__(self) -> None:
        self.views: dict[int, StageOptimizerView] = {}
        self._pending: list[Any] | None = None  # optimizer states loaded before the stages existed
        #: a load of the states where they were saved (launched mode), waiting for the stages
        self._pending_load: Callable[[list[torch.optim.Optimizer]], None] | None = None

    def attach(
        self,
        pipeline: Pipeline,
        optimizers: list[torch.optim.Optimizer],
        device: torch.device,
        names: dict[int, str] | None = None,
    ) -> None:
        """Build each optimizer's per-stage parts; load a checkpoint's states that arrived earlier."""
        self.views = {
            id(opt): StageOptimizerView(opt, pipeline.optimizer(opt, names), torch.zeros(1, device=device))
            for opt in optimizers
        }
        if self._pending is not None:
            self.load(optimizers, self._pending)
            self._pending = None
        if self._pending_load is not None:
            load, self._pending_load = self._pending_load, None
            load(optimizers)

    def view(self, optimizer: Any) -> StageOptimizerView | None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        return self.views.get(id(optimizer))

    def optimizer_step(
        self, precision: Any, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        view: StageOptimizerView | _AwaitedView | None = self.view(optimizer)
        if view is None:  # the step builds the stages (a traced module): they are stepped once it ran
            view = _AwaitedView(self, getattr(optimizer, "_optimizer", optimizer))
        view.scaler = getattr(precision, "scaler", None)

        def closure_then_unscale() -> Any:
            result = closure()
            if result is not None:
                view.after_backward()
            return result

        return precision.optimizer_step(view, model=model, closure=closure_then_unscale, **kwargs)

    def state(self, optimizer: Any) -> dict[str, Any] | None:
        view = self.view(optimizer)
        return view.stages.state_dict() if view is not None else None

    def load(self, optimizers: list[torch.optim.Optimizer], states: list[Any]) -> None:
        if not self.views:
            self._pending = states
            return
        for optimizer, state in zip(optimizers, states, strict=False):
            view = self.view(optimizer)
            if view is not None:
                view.stages.load_state_dict(state)

    def load_where_saved(
        self, optimizers: list[torch.optim.Optimizer], load: Callable[[list[torch.optim.Optimizer]], None]
    ) -> None:
        """``load(optimizers)`` now, or once the stages exist (it reaches them through `view`)."""
        if self.views:
            load(optimizers)
        else:
            self._pending_load = load

    def fold_into_templates(self) -> None:
        """Give each user optimizer the state its stages built (before the stages go away)."""
        for view in self.views.values():
            view.template.load_state_dict(view.stages.state_dict())
        self.views = {}

    def zero_grad(self) -> None:
        for view in self.views.values():
            view.stages.zero_grad()

    @staticmethod
    def patch_clipping(precision: Any) -> None:
        """Make the precision plugin clip over every stage (global norm) for the views' optimizers."""
        if getattr(precision, "_pipe_clipping", False):
            return
        by_norm, by_value = precision.clip_grad_by_norm, precision.clip_grad_by_value

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            if isinstance(optimizer, StageOptimizerView):
                optimizer.stages.clip_grad_norm_(float(clip_val))
            else:
                by_norm(optimizer, clip_val)

        def clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
            if isinstance(optimizer, StageOptimizerView):
                optimizer.stages.clip_grad_value_(float(clip_val))
            else:
                by_value(optimizer, clip_val)

        precision.clip_grad_by_norm = clip_grad_by_norm
        precision.clip_grad_by_value = clip_grad_by_value
        precision._pipe_clipping = True


class _AwaitedView(StageOptimizerView):
    """What the precision plugin steps when the stages do not exist yet: the first training step builds them
    (a traced module is cut on its first call, inside the closure). After the closure ran, the optimizer's view
    exists and takes over; before, the user's optimizer's ``param_groups`` serve the hooks."""

    def __init__(self, parameters: StageParameters, template: torch.optim.Optimizer) -> None:
        self.parameters = parameters
        self.template = template
        self.scaler: Any = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        view = self.parameters.view(self.template)
        return view.param_groups if view is not None else self.template.param_groups

    def _view(self) -> StageOptimizerView:
        view = self.parameters.view(self.template)
        if view is None:
            raise PipeError("the training step ran but built no stages to step; the pipeline was not built")
        view.scaler = self.scaler
        return view

    def after_backward(self) -> None:
        self._view().after_backward()

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        view = self._view()
        for name in ("found_inf", "grad_scale"):  # what a GradScaler's step set on this object
            if hasattr(self, name):
                setattr(view, name, getattr(self, name))
        view.step(None)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        view = self.parameters.view(self.template)
        if view is not None:
            view.zero_grad(set_to_none)


class StageGradZeroing(pl.Callback):
    """Zeroes the stages' gradients where Lightning zeroes the optimizer's (the closure's ``zero_grad``)."""

    def __init__(self, parameters: StageParameters) -> None:
        self.parameters = parameters

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.parameters.zero_grad()
