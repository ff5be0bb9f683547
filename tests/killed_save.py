"""A launched run (1 x 2) whose checkpoints are written in the background, then one killed while it writes:
``python tests/killed_save.py OUT`` under `launching.forked_ranks` with 2 processes.

1. ``OUT/async``: 4 steps, ``async_checkpoint=True``, ModelCheckpoint every step (``last.ckpt`` only). Right after
   ``fit`` returns, global rank 0 writes what it found at ``last.ckpt`` to ``OUT/async-rank0.json``: fit waits for
   the last save, so it is there, complete, at step 4.
2. ``OUT/killed``: the same, but the serving process (rank 1) SIGKILLs itself in the background write of the third
   save, after its part's files are written and before DCP finishes the folder. The launcher then ends rank 0 (as
   torchrun does) and exits with 1. ``last.ckpt`` must still be the complete checkpoint of step 2.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from state_contract import BATCH, QUIET, STEPS, Net, make_data  # noqa: E402

from lightning_pipe import PipeStrategy  # noqa: E402

KILLED_AT = 3  # the save (one per step: last.ckpt) during which rank 1 dies


class EndsAtSigterm(L.Callback):
    """Lightning's SIGTERM handler (set at the fit's start) only flags the signal: without it, the process that the
    launcher ends after the other's death goes at once instead of after the launcher's 30 s of grace."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def fit(folder: Path) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    every_step = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=0, save_last=True)
    strategy = PipeStrategy(stages=2, microbatches=2, timeout=60, async_checkpoint=True)
    options: dict[str, Any] = {**QUIET, "enable_checkpointing": True}
    callbacks = [every_step, EndsAtSigterm()]
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=STEPS, callbacks=callbacks, **options)
    trainer.fit(Net(), DataLoader(make_data(), batch_size=BATCH))
    return trainer


def die_in_a_write(at: int) -> None:
    """This process SIGKILLs itself in its ``at``-th checkpoint write, once its part's files are on disk."""
    write_data = FileSystemWriter.write_data
    count = [0]

    def write_then_die(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        written = write_data(self, plan, planner)
        count[0] += 1
        if count[0] == at:
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


def main() -> None:
    out = Path(sys.argv[1])
    fit(out / "async")
    if dist.get_rank() == 0:
        last = out / "async" / "last.ckpt"
        meta = torch.load(last / "meta.pt", weights_only=False)
        found = {"metadata": (last / ".metadata").exists(), "global_step": meta["global_step"],
                 "left": sorted(p.name for p in (out / "async").iterdir())}  # fmt: skip
        (out / "async-rank0.json").write_text(json.dumps(found))
    if dist.get_rank() == 1:
        die_in_a_write(KILLED_AT)
    fit(out / "killed")


if __name__ == "__main__":
    faulthandler.enable()
    main()
