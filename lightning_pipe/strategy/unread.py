"""Arguments the mode that runs does not read: each is said once, naming why and what to pass instead.

Most arguments that a mode cannot honour are refused when the strategy or the Trainer is made
(`lightning_pipe.strategy.arguments`, `lightning_pipe.strategy.layout`, `lightning_pipe.strategy.mode_choice`).
What is left here is known only once the mode runs (Lightning's ``checkpoint_io`` reaches the strategy from the
Trainer's plugins), or is a choice between two arguments given together (``weights=`` and ``ckpt_path=``): the run
goes on, and a warning says what was not read. docs/usage.md's argument table says which mode reads what.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_pipe.strategy.config import PipeConfig
from lightning_pipe.strategy.layout import LOCAL

#: what a checkpoint of each mode is written by, where it is not Lightning's ``checkpoint_io``
_WRITTEN_BY = {
    "launched": "every process writes its own stage (torch.distributed.checkpoint, or one file made of the parts)",
    "rpc": "the stage workers write their own stages during and after a fit (a folder, or one file made of it)",
}


def unread_arguments(config: PipeConfig, mode: str, checkpoint_io: Any) -> list[str]:
    """The warnings for the arguments that ``mode`` does not read (``checkpoint_io``: the strategy's, Lightning's
    default `TorchCheckpointIO` unless the user gave another)."""
    said = []
    if mode == LOCAL and config.save_distributed_checkpoint:
        said.append(
            "PipeStrategy(save_distributed_checkpoint=True) in local mode: the stages share the LightningModule's "
            "tensors and Lightning writes one file, as without PipeStrategy; a folder per stage is written where the "
            "stages live in other processes (launched or rpc mode). Leave save_distributed_checkpoint out here"
        )
    if mode in _WRITTEN_BY and checkpoint_io is not None and type(checkpoint_io) is not TorchCheckpointIO:
        said.append(
            f"PipeStrategy in {mode} mode with checkpoint_io={type(checkpoint_io).__name__}: checkpoints are not "
            f"written through it, {_WRITTEN_BY[mode]}, and read part by part where each stage lives. Leave "
            "checkpoint_io out, or run local mode (transport='local'), where Lightning writes through it"
        )
    return said


def resuming_over_weights(weights: str) -> str:
    """The warning when ``ckpt_path=`` and ``PipeStrategy(weights=...)`` are given together: the checkpoint wins."""
    return (
        f"PipeStrategy(weights={weights!r}) with ckpt_path=: the run resumes from the checkpoint, which holds the "
        "trained values of a run that started from those weights, so the weights are not read in this fit (the "
        "checkpoint's keys are checked as strict_loading says). To start from the weights, leave ckpt_path out"
    )
