"""Random draws under `PipeStrategy` beyond the stages' forwards: checkpoints, fits, and the user's step code.

A Lightning checkpoint written under `PipeStrategy` holds the stages' generator states under the
top-level key ``"lightning_pipe"`` (``{"random_state": Pipeline.random_state()}``), which a plain
Trainer ignores; ``ckpt_path=`` restores them, so a resumed run draws the dropout masks the
uninterrupted run draws. Between two fits with the same strategy the stages go on where they stopped,
as torch's default generator does in a plain run.

The user's step code runs once per microbatch, in threads whose parts before and after the pipelined
call interleave as the pipeline's timing allows; each microbatch's code draws from a generator of its
own (seeded from the run's seed, the step and the microbatch), so its draws do not depend on that timing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lightning_pipe.pipeline import Pipeline
from lightning_pipe.rng import RandomRouting, StageGenerators, derive_seed, run_seed
from lightning_pipe.strategy.asynchronous import AsyncTraining

CHECKPOINT_KEY = "lightning_pipe"


class StageRandomState(Strategy):
    """Mixed into `PipeStrategy` (before Lightning's strategy): the stages' generator states in checkpoints."""

    pipeline: Pipeline | None
    _async: AsyncTraining | None
    _trainer: Any
    #: generator states for the next pipeline built: from a loaded checkpoint or the last fit
    _random_state: dict[str, Any] | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        state = self.stage_random_state()
        if state is not None:
            checkpoint = {**checkpoint, CHECKPOINT_KEY: {"random_state": state}}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(CHECKPOINT_KEY, {}).get("random_state")
        if state is not None:
            self._random_state = state
            if self.pipeline is not None:
                self.restore_random_state(self.pipeline)
        return checkpoint

    def stage_random_state(self) -> dict[str, Any] | None:
        """The stages' generator states now; before the stages are built, the ones they will get.

        None in the middle of an asynchronous stream: it owns the stages (and such a checkpoint misses the
        updates of batches in flight anyway).
        """
        if self.pipeline is None or not self.pipeline.built:
            return self._random_state
        if self._async is not None and self._async.stream is not None and not self._async.stream.closed:
            return None
        return self.pipeline.random_state()

    def restore_random_state(self, pipeline: Pipeline) -> None:
        """Give newly built stages the saved generator states (they start from the run's seed without)."""
        if self._random_state is not None and pipeline.built:
            pipeline.load_random_state(self._random_state)

    def keep_random_state(self) -> None:
        """Before the stages stop: keep their states for the next fit with this strategy."""
        self._random_state = self.stage_random_state()

    def step_random(
        self, context: Callable[[], AbstractContextManager[Any]], name: str, args: tuple[Any, ...], index: int
    ) -> Callable[[], AbstractContextManager[Any]]:
        """``context`` plus: microbatch ``index``'s step code draws from its own generator (entered in its thread).

        The seed names the step by what a resumed run restores: the epoch, the global step, the batch
        (and dataloader) index of ``args``.
        """
        trainer = self._trainer
        where = [name, trainer.current_epoch, trainer.global_step, *(a for a in args[1:] if isinstance(a, int))]
        generators = StageGenerators(derive_seed(run_seed(), "step", *where), index, self.root_device)

        @contextmanager
        def drawing() -> Iterator[None]:
            with context(), RandomRouting(generators):
                yield

        return drawing
