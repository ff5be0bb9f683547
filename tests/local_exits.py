"""Local-mode fits, then a normal interpreter exit, many times: ``python tests/local_exits.py --out DIR --runs N``.

The script imports torch and Lightning once and ``os.fork()``s N children in sequence. Each child runs
small fits on (part of) the digits data in local mode (stage threads, microbatch driver threads):
interleaved-1f1b (4 stages on 2 workers), zero-bubble, 1f1b and async with 4 stages, ``--fits`` of them
per child in turn, a validation between the steps. Then it leaves through ``sys.exit``: the exception
unwinds to the top of this script and the interpreter shuts down as any script's does (non-daemon
threads joined, atexit hooks, finalization), so a thread of lightning_pipe still running in torch then
aborts it ("terminate called without an active exception", SIGABRT). Each child writes ``threads-<i>``:
the lightning_pipe threads alive right after its fits returned (none: they are joined before ``fit``
returns). The parent prints ``exit <i> <code>`` per child (a signal as a negative code). It forks before
any torch computation (no OpenMP pool is copied half-alive) and after ``gc.freeze()``: a child's exit then
does not walk the parent's objects (without it each exit costs ~1.5 s of CPU; the shutdown is the same).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pipe import PipeStrategy  # noqa: E402

CASES = (
    {"stages": 4, "virtual_stages": 2, "schedule": "interleaved-1f1b"},
    {"stages": 4, "schedule": "zero-bubble"},
    {"stages": 4, "schedule": "1f1b"},
    {"stages": 4, "schedule": "async"},
)
CHILD_TIMEOUT = 120.0


class Digits(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=2e-3)


def child(index: int, data: TensorDataset, out: Path, fits: int) -> None:
    """``fits`` cases (from case ``index``), 3 steps each with a validation after the second; then exit."""
    for k in range(fits):
        fit(index + k, data)
    left = [t.name for t in threading.enumerate() if t.name.startswith("lightning_pipe-")]
    (out / f"threads-{index}").write_text("".join(f"{name}\n" for name in left))
    sys.exit(0)  # unwinds to the top of the script: the interpreter's own shutdown follows


def fit(index: int, data: TensorDataset) -> None:
    """Case ``index`` (modulo their number): 3 steps with a validation after the second."""
    L.seed_everything(index, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipeStrategy(microbatches=4, timeout=60, **CASES[index % len(CASES)]),
        max_steps=3, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Digits(), DataLoader(data, batch_size=32), DataLoader(data, batch_size=64))


def wait(pid: int, timeout: float) -> int:
    """The child's exit code (a signal as its negative number); SIGKILLed after ``timeout`` seconds (-9)."""
    until = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > until:
            os.kill(pid, 9)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--fits", type=int, default=2, help="fits per child (its case and the next ones)")
    args = parser.parse_args()
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x[:256] / 16.0, dtype=torch.float32), torch.tensor(y[:256]))
    gc.freeze()  # the children share the parent's objects: their collections and exits do not walk them
    for index in range(args.runs):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(index, data, Path(args.out), args.fits)
        print(f"exit {index} {wait(pid, CHILD_TIMEOUT)}", flush=True)


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    main()
