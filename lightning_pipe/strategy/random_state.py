"""`RandomStreams`: random draws under `PipeStrategy` beyond the stages' forwards: across checkpoints and
fits, and in the user's step code.

A Lightning checkpoint written under `PipeStrategy` holds the stages' generator states
(`lightning_pipe.strategy.checkpoints`), which a plain Trainer ignores; ``ckpt_path=`` restores them, so a
resumed run draws the dropout masks the uninterrupted run draws. Between two fits with the same strategy the
stages go on where they stopped, as torch's default generator does in a plain run.

The user's step code runs once per microbatch, in threads whose parts before and after the pipelined
call interleave as the pipeline's timing allows; each microbatch's code draws from a generator of its
own (seeded from the run's seed, the step and the microbatch), so its draws do not depend on that timing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.rng import RandomRouting, StageGenerators, derive_seed, run_seed
from lightning_pipe.strategy.training import Training


class RandomStreams:
    """The stages' generator states between pipelines, and the generators of the user's step code.

    `PipeStrategy` calls it when a pipeline is built (`restore`), before it stops (`keep`), for each
    microbatch's step (`step_context`); `lightning_pipe.strategy.checkpoints` saves and loads `state`.
    """

    def __init__(self, training: Training) -> None:
        self.training = training  # an open stream (schedule="async") owns the stages: their states are not read then
        #: generator states for the next pipeline built: from a loaded checkpoint or the last fit
        self.saved: dict[str, Any] | None = None
        self.seed: int | None = None  # the run's seed, decided once per fit by the strategy (None: `run_seed`)

    def state(self, pipeline: Pipeline | None) -> dict[str, Any] | None:
        """The stages' generator states now; before the stages are built, the ones they will get.

        None in the middle of an asynchronous stream: it owns the stages (and such a checkpoint misses the
        updates of batches in flight anyway).
        """
        if pipeline is None or not pipeline.built:
            return self.saved
        if self.training.streaming:
            return None
        return pipeline.random_state()

    def load(self, state: dict[str, Any], pipeline: Pipeline | None) -> None:
        """A checkpoint's states: for the stages now (if built) and for every pipeline built later."""
        self.saved = state
        if pipeline is not None:
            self.restore(pipeline)

    def restore(self, pipeline: Pipeline) -> None:
        """Give newly built stages the saved generator states (they start from the run's seed without)."""
        if self.saved is not None and pipeline.built:
            pipeline.load_random_state(self.saved)

    def keep(self, pipeline: Pipeline | None) -> None:
        """Before the stages stop: keep their states for the next fit with this strategy."""
        self.saved = self.state(pipeline)

    def step_context(
        self,
        context: Callable[[], AbstractContextManager[Any]],
        trainer: pl.Trainer,
        device: torch.device,
        name: str,
        args: tuple[Any, ...],
        index: int,
    ) -> Callable[[], AbstractContextManager[Any]]:
        """``context`` plus: microbatch ``index``'s step code draws from its own generator (entered in its thread).

        The seed names the step by what a resumed run restores: the epoch, the global step, the batch
        (and dataloader) index of ``args``.
        """
        where = [name, trainer.current_epoch, trainer.global_step, *(a for a in args[1:] if isinstance(a, int))]
        generators = StageGenerators(derive_seed(run_seed(self.seed), "step", *where), index, device)

        @contextmanager
        def drawing() -> Iterator[None]:
            with context(), RandomRouting(generators):
                yield

        return drawing
