"""`StageOptimization`: backward's gradients, Lightning's optimizer steps and the optimizer state.

The pipeline computes the gradients inside ``training_step``; ``backward`` puts them on ``p.grad``.
When the stages own their parameters (``transport="rpc"`` and launched mode), Lightning's optimizers
step the stages (`lightning_pipe.strategy.modes.rpc_optimizers`), clipping and a GradScaler included. With
``schedule="async"`` the stages step their own optimizers (`lightning_pipe.strategy.async_training`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_pipe.checkpoint.resume import optimizer_layouts
from lightning_pipe.engine.grads import GradStash
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.strategy.modes.rpc_optimizers import StageGradZeroing, StageParameters
from lightning_pipe.strategy.process_stage import swap_parameters


class StageOptimization:
    """Where the optimizers' parameters live, and Lightning's optimizer calls routed there.

    `PipeStrategy` calls it from ``setup``, ``backward``, ``optimizer_step`` and teardown; the step driver
    sets the gradients of the parameters outside the pipelined module aside during a training step
    (`set_aside`); `lightning_pipe.strategy.checkpoints` reads the optimizer state where it says it lives.
    """

    def __init__(self) -> None:
        #: with stages that own their parameters (not "local"): Lightning's optimizers, stepped on the stages
        self.stage_params: StageParameters | None = None
        self.outside = GradStash()  # parameters outside the pipelined module (before/after the call)
        #: launched mode: the optimizers' parameters that are the pipelined module's, by id, with their names there
        self.stage_names: dict[int, str] | None = None
        #: each optimizer's parameters by their LightningModule key, per group (what checkpoints store by position)
        self.layouts: list[list[list[str]]] = []

    def setup(self, outside: Iterable[nn.Parameter]) -> None:
        """At each setup: the parameters outside the pipelined module."""
        self.outside = GradStash(outside)

    def step_stages(self) -> None:
        """At each setup where the stages own their parameters: Lightning's optimizers step them on the stages (kept
        once made: a loaded state may wait there for the stages)."""
        if self.stage_params is None:
            self.stage_params = StageParameters()

    def install(self, callbacks: list[pl.Callback], precision: Any) -> None:
        """Stages that own their parameters: zero their gradients with Lightning's, clip over all of them."""
        if self.stage_params is None:
            return
        if not any(isinstance(cb, StageGradZeroing) and cb.parameters is self.stage_params for cb in callbacks):
            callbacks.append(StageGradZeroing(self.stage_params))
        StageParameters.patch_clipping(precision)

    def name_parameters(
        self, lightning_module: nn.Module, pipelined: nn.Module, optimizers: list[torch.optim.Optimizer]
    ) -> None:
        """At setup: each optimizer's parameters by their key (what checkpoints store by position) and, for those of
        the pipelined module, by their name there (building the stages may replace them: made real from meta,
        sharded by FSDP)."""
        self.layouts = optimizer_layouts(lightning_module, optimizers)
        names = {id(p): name for name, p in pipelined.named_parameters()}
        self.stage_names = {id(p): names[id(p)] for o in optimizers for g in o.param_groups for p in g["params"]
                            if id(p) in names}  # fmt: skip

    def adopt_built(self, optimizers: list[torch.optim.Optimizer], pipelined: nn.Module) -> None:
        """A pipeline was built in local mode, its stages the LightningModule's modules: parameters they made real
        replace their meta ones in the optimizers."""
        names = self.stage_names or {}
        current = dict(pipelined.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [current.get(names.get(id(p), ""), p) for p in group["params"]]

    def step_on_stages(
        self, pipeline: Pipeline, optimizers: list[torch.optim.Optimizer], device: torch.device, by_name: bool
    ) -> None:
        """A pipeline was built whose stages own their parameters (rpc, launched): each optimizer gets its
        per-stage parts (``by_name``: found by their names in the pipelined module, launched mode)."""
        if self.stage_params is not None and optimizers:
            self.stage_params.attach(pipeline, optimizers, device, (self.stage_names or {}) if by_name else None)

    def stand_in(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Launched mode: the optimizers keep only meta stand-ins of the stages' parameters (this process's own
        stage included: its stage optimizer steps it)."""
        for optimizer in optimizers:
            swap_parameters(optimizer, self.stage_names or {})

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """During a training step: the outside parameters' new gradients wait for `apply_grads`."""
        self.outside.begin()
        try:
            yield
        finally:
            self.outside.end()

    def apply_outside(self, scale: float) -> None:
        """In ``backward``: the step's gradients of the parameters outside the pipelined module, times ``scale``,
        onto ``p.grad`` (the stages' come from `Training.apply_grads`)."""
        self.outside.apply(scale)

    def drop_grads(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Free the gradients Lightning is about to zero (the first step of an accumulation window), on the
        stages (where they own their parameters) and here."""
        if self.stage_params is not None and self.stage_params.views:
            self.stage_params.zero_grad()
        else:
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)

    def steps_stages(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` (or the LightningOptimizer around it) is stepped on the stages: it has their
        parts, or the stages do not exist yet (the step builds them: a traced module is cut on its first call)."""
        params = self.stage_params
        return params is not None and (params.view(optimizer) is not None or not params.views)

    def optimizer_step(
        self, precision: Any, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Lightning's optimizer step of an optimizer whose parameters live on the stages."""
        assert self.stage_params is not None
        return self.stage_params.optimizer_step(precision, optimizer, model, closure, **kwargs)

    def fold(self, pipeline: Pipeline | None, has_values: bool = True) -> None:
        """Before the stages stop: the LightningModule and its optimizers end up trained, as usual (rpc), where the
        module has values to take them (``has_values``: one built on meta keeps none, this process holds no stage)."""
        if self.stage_params is None or not self.stage_params.views or pipeline is None:
            return
        if not has_values:  # a model built on meta: the workers wrote their stages for checkpoints after the fit
            self.forget_stages()
            return
        pipeline.sync_module()
        self.stage_params.fold_into_templates()

    def forget_stages(self) -> None:
        """After an error: the stages may be gone, nothing to gather from them."""
        if self.stage_params is not None:
            self.stage_params.views = {}
