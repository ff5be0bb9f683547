"""`Checkpoints`: what a checkpoint written under `PipeStrategy` holds beyond Lightning's own, and where
each part comes from and goes back to.

The module's state keeps the unsplit keys (a plain Trainer loads it); where the stages own their parameters
(rpc, launched mode) their values are copied into the LightningModule first. Each optimizer's state comes
from wherever its parameters live (`StageOptimization`). The stages' generator states go under the
top-level key ``"lightning_pipe"`` (``{"random_state": Pipeline.random_state()}``), which a plain Trainer
ignores.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe.strategy.asynchronous import AsyncTraining
from lightning_pipe.strategy.building import PipelineBuilder
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.random_state import RandomStreams

CHECKPOINT_KEY = "lightning_pipe"


class Checkpoints:
    """Gathers the stages' state into a checkpoint and hands a loaded checkpoint's state to the stages.

    `PipeStrategy` calls it from Lightning's checkpoint hooks (``save_checkpoint``, ``load_checkpoint``,
    ``lightning_module_state_dict``, ``optimizer_state``, ``load_optimizer_state_dict``) and lets Lightning
    do the rest (writing the file, its checkpoint IO).
    """

    def __init__(
        self,
        builder: PipelineBuilder,
        optimization: StageOptimization,
        random: RandomStreams,
        asynchronous: AsyncTraining | None,
    ) -> None:
        self.builder = builder  # the pipeline whose stages hold the state
        self.optimization = optimization
        self.random = random
        self.asynchronous = asynchronous

    def saving(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with the stages' generator states added (when there are any to save)."""
        state = self.random.state(self.builder.pipeline)
        if state is None:
            return checkpoint
        return {**checkpoint, CHECKPOINT_KEY: {"random_state": state}}

    def loaded(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint was read: its generator states go to the stages (now or when they are built)."""
        state = checkpoint.get(CHECKPOINT_KEY, {}).get("random_state")
        if state is not None:
            self.random.load(state, self.builder.pipeline)

    def before_module_state(self) -> None:
        """Before Lightning reads the LightningModule's state: it holds the stages' current values."""
        if self.asynchronous is not None and self.asynchronous.streaming:
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
        asynchronous = self.asynchronous
        if asynchronous is not None and getattr(optimizer, "_optimizer", optimizer) is asynchronous.template:
            return asynchronous.state_dict()
        stage_params = self.optimization.stage_params
        return stage_params.state(optimizer) if stage_params is not None else None

    def load_optimizer_states(self, optimizers: list[torch.optim.Optimizer], states: list[Any]) -> None:
        """A checkpoint's ``optimizer_states``, each where its parameters live (the stages' once they exist)."""
        stage_params = self.optimization.stage_params
        if stage_params is not None:
            stage_params.load(optimizers, states)
            return
        asynchronous = self.asynchronous
        for optimizer, state in zip(optimizers, states, strict=False):
            if asynchronous is not None and optimizer is asynchronous.template:
                asynchronous.load_state_dict(state)
            else:  # torch moves each state to its parameter's device; Lightning's version would move it to one
                optimizer.load_state_dict(state)
