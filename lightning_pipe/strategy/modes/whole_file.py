"""`WholeFile`: a checkpoint of the model one process holds, written by Lightning in one file.

Local mode writes every checkpoint so; rpc mode where no stage worker holds a fit's stages; launched mode where no
LightningModule is attached. The file is written under a temporary name and published once complete
(`lightning_pipe.checkpoint.publish`; ``async_checkpoint``: written in the background during a fit).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_pipe.checkpoint.background import CheckpointWrites
from lightning_pipe.checkpoint.publish import is_local, prepare, publish
from lightning_pipe.strategy.model_state import Host
from lightning_pipe.strategy.modes.mode import Write


class WholeFile:
    """Writes and removes one-file checkpoints through ``writes`` (this process's writes in flight); ``host``: the
    strategy (its LightningModule and ``checkpoint_io``); ``first``: this process is global rank 0, the one that
    writes (Lightning writes a file from global rank 0 only)."""

    def __init__(self, writes: CheckpointWrites, host: Host, first: bool = True) -> None:
        self.writes = writes
        self.host = host
        self.first = first

    def save(self, checkpoint: dict[str, Any], path: Path, storage_options: Any, lightning: Write) -> None:
        """``checkpoint`` at ``path``; ``lightning``: Lightning's writing, under a temporary name and then published
        (`write_file`; with ``async_checkpoint``, in the background during a fit)."""
        self.writes.wait()
        if not self.first:
            lightning(checkpoint, path, storage_options=storage_options)
            return
        write_file(self.writes, lightning, checkpoint, path, storage_options, self.host.checkpoint_io)
        if not in_fit(self.host.lightning_module):
            self.writes.wait()  # no training to overlap: the checkpoint is there when save_checkpoint returns

    def remove(self, path: Path, lightning: Write) -> None:
        """As Lightning removes it (``lightning``), once the checkpoint being written is published."""
        self.writes.then(lambda: lightning(path))


def publishes(checkpoint_io: CheckpointIO, path: Path) -> bool:
    """Whether a file that ``checkpoint_io`` writes at ``path`` can be written under a temporary name and renamed:
    Lightning's own ``TorchCheckpointIO`` on this machine's file system (another plugin, such as Lightning's
    ``AsyncCheckpointIO``, writes where and when it chooses)."""
    return isinstance(checkpoint_io, TorchCheckpointIO) and is_local(path)


def write_file(
    writes: CheckpointWrites,
    lightning: Callable[..., None],
    checkpoint: dict[str, Any],
    path: Path,
    storage_options: Any,
    checkpoint_io: CheckpointIO,
) -> None:
    """``checkpoint`` as one file at ``path``, written by Lightning (``lightning``: the strategy's base class's
    ``save_checkpoint``, through ``checkpoint_io``) under a temporary name and published; with ``writes``
    asynchronous, from a copy of its tensors in CPU memory, in ``writes``' thread."""
    if not publishes(checkpoint_io, path):
        lightning(checkpoint, path, storage_options=storage_options)
        return
    temporary = prepare(path)
    checkpoint = writes.stage(checkpoint)
    writes.run(lambda: lightning(checkpoint, temporary, storage_options=storage_options), path)
    writes.then(lambda: publish(temporary, path))


def in_fit(module: Any) -> bool:
    """Whether the Trainer of ``module`` (the LightningModule) runs: a save during a fit may run in the background
    (its end waits for it); one after it completes before ``save_checkpoint`` returns."""
    trainer = getattr(module, "_trainer", None)
    return trainer is not None and trainer.state.status == TrainerStatus.RUNNING
