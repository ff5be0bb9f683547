"""Arguments the mode that runs does not read: each is said once, naming why and what to pass instead.

Most arguments that a mode cannot honour are refused when the strategy or the Trainer is made
(`lightning_pipe.strategy.arguments`, `lightning_pipe.strategy.layout`, `lightning_pipe.strategy.modes.mode_choice`).
What is left here is known only once the mode runs (Lightning's ``checkpoint_io`` reaches the strategy from the
Trainer's plugins; each mode's `Mode.unread` says which warnings apply to it), or is a choice between two arguments
given together (``weights=`` and ``ckpt_path=``): the run goes on, and a warning says what was not read.
docs/usage.md's argument table says which mode reads what.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_pipe.strategy.pipe_config import PipeConfig


def folder_in_local_mode(config: PipeConfig) -> str | None:
    """Local mode: ``save_distributed_checkpoint=True`` is not read (Lightning writes one file)."""
    if not config.save_distributed_checkpoint:
        return None
    return (
        "PipeStrategy(save_distributed_checkpoint=True) in local mode: the stages share the LightningModule's "
        "tensors and Lightning writes one file, as without PipeStrategy; a folder per stage is written where the "
        "stages live in other processes (launched or rpc mode). Leave save_distributed_checkpoint out here"
    )


def checkpoint_io_unused(mode: str, written_by: str, checkpoint_io: Any) -> str | None:
    """Where the stages write their own parts (``written_by`` says how, in ``mode``): a ``checkpoint_io`` other than
    Lightning's default `TorchCheckpointIO` is not used."""
    if checkpoint_io is None or type(checkpoint_io) is TorchCheckpointIO:
        return None
    return (
        f"PipeStrategy in {mode} mode with checkpoint_io={type(checkpoint_io).__name__}: checkpoints are not "
        f"written through it, {written_by}, and read part by part where each stage lives. Leave checkpoint_io out, "
        "or run local mode (transport='local'), where Lightning writes through it"
    )


def resuming_over_weights(weights: str) -> str:
    """The warning when ``ckpt_path=`` and ``PipeStrategy(weights=...)`` are given together: the checkpoint wins."""
    return (
        f"PipeStrategy(weights={weights!r}) with ckpt_path=: the run resumes from the checkpoint, which holds the "
        "trained values of a run that started from those weights, so the weights are not read in this fit (the "
        "checkpoint's keys are checked as strict_loading says). To start from the weights, leave ckpt_path out"
    )


def synchronous_in_rpc_mode(config: PipeConfig) -> str | None:
    """rpc mode: ``async_checkpoint=True`` is not read (the stage workers write their parts synchronously)."""
    if not config.async_checkpoint:
        return None
    return (
        "PipeStrategy(transport='rpc', async_checkpoint=True): the stage workers write their parts of a checkpoint "
        "synchronously (the training loop waits for them); async_checkpoint applies to local and launched mode"
    )
