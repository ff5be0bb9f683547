"""`Checkpoints`: what a checkpoint written under `PipeStrategy` holds, where each part comes from and goes to.

The module's state keeps the unsplit keys (a plain Trainer loads it). The stages' generator states and
``schedule="auto"``'s choice go under the top-level key ``"lightning_pipe"`` (``{"random_state":
Pipeline.random_state(), "schedule": {"schedule": name, "placement": ..., "microbatches": M}}``), which a plain
Trainer ignores. Two ways, by where the state lives:

- one process holds the model (local mode, a model with values): Lightning reads and writes the whole checkpoint;
- memory follows the stage (launched and rpc mode, a sharded folder, a model built on meta): a checkpoint is opened
  rather than loaded (`Resume`): each stage reads its own tensors when it is built and its own optimizer state;
  launched mode writes a sharded folder, every process its own part (`modes.launched_checkpoints`), rpc mode the
  same folder, each worker its stage (`modes.rpc_checkpoints`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_pipe.checkpoint.reader import OURS
from lightning_pipe.checkpoint.resume import Resume, optimizer_layouts
from lightning_pipe.engine import StageProtocol
from lightning_pipe.strategy.building import PipelineBuilder
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.random_state import RandomStreams
from lightning_pipe.strategy.training import Training
from lightning_pipe.weights import StageInit, aliases_of, is_distributed_checkpoint, on_meta, open_source
from lightning_pipe.weights.keys import WEIGHTS_FIX, compare_keys

CHECKPOINT_KEY = OURS


class Checkpoints:
    """Gathers the stages' state into a checkpoint and hands a loaded checkpoint's state to the stages.

    `PipeStrategy` calls it from Lightning's checkpoint hooks (``save_checkpoint``, ``load_checkpoint``,
    ``lightning_module_state_dict``, ``optimizer_state``, ``load_model_state_dict``, ``load_optimizer_state_dict``)
    and from ``setup`` (`stage_init`: how the stages make their tensors).
    """

    def __init__(
        self,
        builder: PipelineBuilder,
        optimization: StageOptimization,
        random: RandomStreams,
        training: Training,
        weights: str | None = None,
        weights_only: bool | None = None,
    ) -> None:
        self.builder = builder  # the pipeline whose stages hold the state
        self.optimization = optimization
        self.random = random
        self.training = training  # schedule="async": its stream holds an optimizer's state
        self.weights = weights  # pretrained weights of the pipelined module (PipeStrategy(weights=...))
        self.weights_only = weights_only  # how ``weights``, a torch.save file, is opened (None: torch's default)
        self.resume: Resume | None = None  # the checkpoint this fit starts from, opened (memory follows the stage)

    # reading
    def opens_itself(self, path: Any, lightning_module: nn.Module | None) -> bool:
        """Whether ``path``, read where one process holds the model, is still opened and read part by part (else
        Lightning loads it whole): a sharded folder, or a model on meta."""
        on_meta_now = lightning_module is not None and on_meta(lightning_module)
        return is_distributed_checkpoint(path) or on_meta_now

    def open(self, path: Any, weights_only: bool | None, optimizers: int) -> dict[str, Any]:
        """Open ``path`` for this fit; what Lightning restores itself (its tensors are read where they live)."""
        self.close()
        self.resume = Resume(path, weights_only)
        checkpoint = self.resume.for_lightning(optimizers)
        self.loaded(checkpoint)
        return checkpoint

    def hooks_ran(self, checkpoint: dict[str, Any]) -> None:
        """Lightning ran the checkpoint hooks (``on_load_checkpoint``): what they left in the opened checkpoint's
        ``state_dict`` is what its keys, the stages and the optimizers' states are read by."""
        if self.resume is not None:
            self.resume.edited(checkpoint.get("state_dict", {}))

    def check_keys(self, lightning_module: nn.Module, checkpoint: dict[str, Any], strict: bool) -> None:
        """Lightning's strict loading for every way a checkpoint is read (Lightning loads it, or it is opened): the
        checkpoint's keys against the LightningModule's, before any tensor is read; raises naming them
        (``strict``), else says once how many tensors start from their initial values."""
        if self.resume is not None:
            stored, where = self.resume.model().keys(), f"the checkpoint {self.resume.path}"
        else:
            stored, where = checkpoint.get("state_dict", {}).keys(), "the checkpoint"
        report = compare_keys(lightning_module.state_dict(keep_vars=True), stored)
        report.check(strict, where)
        _say_once(report.lenient(where))

    def stage_init(self, prefix: str, seed: int, pipelined: nn.Module, strict: bool) -> StageInit:
        """How the stages make their tensors: from the opened checkpoint, the pretrained weights, or the seed
        (``strict``: the LightningModule's ``strict_loading``; the weights' keys are checked here first)."""
        if self.resume is not None:
            return self.resume.stage_init(prefix, seed, strict)
        if self.weights is not None:
            self._check_weights(pipelined, strict)
            return StageInit(path=self.weights, seed=seed, strict=strict, weights_only=self.weights_only)
        return StageInit(seed=seed, overwrite=False)

    def _check_weights(self, pipelined: nn.Module, strict: bool) -> None:
        """``weights=``'s keys (from its metadata) against the pipelined module's, as `check_keys` does."""
        assert self.weights is not None
        source = open_source(self.weights, self.weights_only)
        try:
            report = compare_keys(pipelined.state_dict(keep_vars=True), source.keys(), aliases_of(pipelined))
            where = source.describe()
        finally:
            source.close()
        report.check(strict, where, WEIGHTS_FIX)
        _say_once(report.lenient(where))

    def load_outside(self, lightning_module: nn.Module, pipelined: nn.Module, device: torch.device, seed: int) -> None:
        """The LightningModule's tensors outside the pipeline: the checkpoint's, or made real by the seed."""
        if self.resume is not None:
            self.resume.load_outside(lightning_module, pipelined, device, seed)
        elif on_meta(lightning_module):
            from lightning_pipe.weights import materialize

            inside = {id(m) for m in pipelined.modules()}
            materialize(lightning_module, device, None, seed, skip=inside)

    def load_optimizers(
        self, optimizers: list[torch.optim.Optimizer], states: list[Any], lightning_module: nn.Module
    ) -> None:
        """A checkpoint's optimizer states where one process holds the model: whole, assembled from an opened
        checkpoint (each where its parameters live: the stages' once they exist)."""
        resume = self.resume
        if resume is None:
            self.load_optimizer_states(optimizers, states)
            return
        layouts = self._checked_layouts(resume, optimizers, lightning_module)
        self.load_optimizer_states(optimizers, resume.optimizer_states(layouts))

    def _checked_layouts(
        self, resume: Resume, optimizers: list[torch.optim.Optimizer], lightning_module: nn.Module
    ) -> list[list[list[str]]]:
        """The optimizers' layouts (each one's parameters by key, per group), their groups checked against the
        opened checkpoint's."""
        layouts = self.optimization.layouts or optimizer_layouts(lightning_module, optimizers)
        resume.set_layouts(layouts)
        resume.check_groups(layouts, strict=getattr(lightning_module, "strict_loading", True))
        return layouts

    def load_stage_optimizers(
        self, optimizers: list[torch.optim.Optimizer], states: list[Any], lightning_module: nn.Module
    ) -> None:
        """A checkpoint's optimizer states where the stages own their parameters (launched and rpc mode): each stage
        reads its own state from the opened checkpoint, nothing is gathered."""
        resume = self.resume
        if resume is None:
            self.load_optimizer_states(optimizers, states)
            return
        layouts = self._checked_layouts(resume, optimizers, lightning_module)
        stage_params = self.optimization.stage_params
        assert stage_params is not None, "launched and rpc mode: the stages own their parameters"
        pipelined = self.builder.pipelined
        assert pipelined is not None
        prefix, aliases = self.builder.prefix(lightning_module), aliases_of(pipelined)

        def load(optimizers: list[torch.optim.Optimizer]) -> None:
            for index, (optimizer, layout) in enumerate(zip(optimizers, layouts, strict=True)):
                view = stage_params.view(optimizer)
                if view is None:
                    continue
                hparams = resume.groups(index)
                keys = [k for group in layout for k in group]
                outside = {p: resume.optimizer_state(index, keys[p]) for p in view.stages.outside_positions()}
                names = resume.stage_aliases(prefix, aliases, [k[len(prefix) :] for k in keys if k.startswith(prefix)])

                def on_stages(
                    groups: list[dict[str, Any]], layout: list[list[str]] = layout, names: dict = names
                ) -> None:
                    pipeline = self.builder.pipeline
                    assert pipeline is not None
                    pipeline.coordinator.stages.call(
                        StageProtocol.load_optimizer_from, resume.path, prefix, layout, groups, names
                    )

                view.stages.load_where_saved(on_stages, hparams, {p: s for p, s in outside.items() if s})

        stage_params.load_where_saved(optimizers, load)

    def load_optimizer_states(self, optimizers: list[torch.optim.Optimizer], states: list[Any]) -> None:
        """Whole optimizer states, each where its parameters live (the stages' once they exist)."""
        stage_params = self.optimization.stage_params
        if stage_params is not None:
            stage_params.load(optimizers, states)
            return
        for optimizer, state in zip(optimizers, states, strict=False):
            if self.training.holds(optimizer):
                self.training.load_state_dict(state)
            else:  # torch moves each state to its parameter's device; Lightning's version would move it to one
                optimizer.load_state_dict(state)

    def close(self) -> None:
        """The fit took what it needs from the opened checkpoint (at teardown)."""
        if self.resume is not None:
            resume, self.resume = self.resume, None
            resume.close()

    # writing
    def saving(
        self, checkpoint: dict[str, Any], random: Callable[[Callable[[], Any]], Any] | None = None
    ) -> dict[str, Any]:
        """``checkpoint`` with the stages' generator states and ``schedule="auto"``'s choice added (those there are);
        ``random``: the mode's say on the generator states, given how to ask the stages for them
        (`lightning_pipe.strategy.modes.mode.TrainingStateIO.random_state`; None: ask them)."""
        ask = functools.partial(self.random.state, self.builder.pipeline)
        ours = {"random_state": ask() if random is None else random(ask), "schedule": self.builder.chosen()}
        ours = {k: v for k, v in ours.items() if v is not None}
        return {**checkpoint, CHECKPOINT_KEY: ours} if ours else checkpoint

    def loaded(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint was read: its generator states go to the stages (now or when they are built), its
        ``schedule="auto"`` choice to the pipeline this fit builds."""
        ours = checkpoint.get(CHECKPOINT_KEY, {})
        if ours.get("random_state") is not None:
            self.random.load(ours["random_state"], self.builder.pipeline)
        if ours.get("schedule") is not None:
            self.builder.selection.resume_choice(ours["schedule"])

    def before_module_state(self) -> None:
        """Before Lightning reads the LightningModule's state: it holds the stages' current values."""
        if self.training.streaming:
            rank_zero_warn(
                "PipeStrategy(schedule='async'): a checkpoint in the middle of a stream holds the live weights, "
                "with the updates of batches in flight missing; checkpoints at the end of an epoch or validation "
                "see every update"
            )
        pipeline = self.builder.pipeline
        if self.optimization.stage_params is not None and pipeline is not None:
            pipeline.sync_module()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any] | None:
        """``optimizer``'s state where the stages hold it; None where Lightning's own reading is right."""
        if self.training.holds(optimizer):
            return self.training.state_dict()
        stage_params = self.optimization.stage_params
        return stage_params.state(optimizer) if stage_params is not None else None


def _say_once(said: str | None) -> None:
    """A warning of the run's first process (rank zero), once: what strict_loading=False did not read."""
    if said is not None:
        rank_zero_warn(said)
