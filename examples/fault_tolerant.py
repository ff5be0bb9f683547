"""Replica groups that survive a lost process (torchft): each torchrun is one replica group of a 2-stage pipeline.

On one machine, all from one command: a torchft Lighthouse in this process, one torchrun of this script per group,
and (``--kill-after``) one process of group 1 SIGKILLed after that step, to watch group 0 go on alone ("the global
batch shrank") and the restarted group heal from it ("healed from a live group") and rejoin:

    pip install -e ".[ft]"
    python examples/fault_tolerant.py --lighthouse-here --kill-after 20

On a cluster: start the Lighthouse once, anywhere the groups reach, then one torchrun per group (any nodes):

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --heartbeat_timeout_ms 2000   # port 29510
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://lighthouse-host:29510 \\
        torchrun --nproc-per-node 2 --max-restarts 10 examples/fault_tolerant.py   # and REPLICA_GROUP_ID=1 ...
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import FaultTolerance, PipeStrategy

PROGRESS = "FT_EXAMPLE_PROGRESS"  # with --lighthouse-here: where each group's coordinator writes its step


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Progress(L.Callback):
    """Writes the global step where the one-machine launcher reads it (for --kill-after), and slows the steps a
    little, so that a restarted group is back before the run ends."""

    def __init__(self, folder: str | None, group: int) -> None:
        self.path = Path(folder) / f"step-{group}" if folder else None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.path is not None:
            self.path.write_text(str(trainer.global_step))
            time.sleep(0.1)


def train(steps: int) -> None:
    """One replica group's processes (under torchrun): 2 stages; the data is cut into one shard per group."""
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    strategy = PipeStrategy(stages=2, microbatches=4, fault_tolerance=FaultTolerance(timeout=10))
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, strategy=strategy, logger=False,
                        enable_checkpointing=False, callbacks=[Progress(os.environ.get(PROGRESS), group)])  # fmt: skip
    trainer.fit(Regressor(), DataLoader(data, batch_size=32, shuffle=True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def here(groups: int, steps: int, kill_after: int | None) -> int:
    """The Lighthouse in this process, ``groups`` torchruns of this script, an optional kill; their exit codes."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=1000)
    folder = tempfile.mkdtemp()
    procs = []
    for group in range(groups):
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "REPLICA_GROUP_ID": str(group),
               "NUM_REPLICA_GROUPS": str(groups), PROGRESS: folder, "OMP_NUM_THREADS": "1"}  # fmt: skip
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            __file__,
            "--steps",
            str(steps),
        ]
        procs.append(subprocess.Popen(command, env=env, start_new_session=True))
    try:
        while any(p.poll() is None for p in procs):
            step = Path(folder, "step-1")
            if kill_after is not None and step.exists() and step.read_text() and int(step.read_text()) >= kill_after:
                kill_after = None
                victim = _serving_process(folder)
                print(f"[example] SIGKILL of group 1's stage process {victim}", flush=True)
                os.kill(victim, signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        lighthouse.shutdown()
    return max(abs(p.returncode or 0) for p in procs)


def _serving_process(folder: str) -> int:
    """Group 1's process of local rank 1 in this launch (its first stage; rank 0 coordinates), found by its
    environment."""
    marks = (b"REPLICA_GROUP_ID=1", b"LOCAL_RANK=1", f"{PROGRESS}={folder}".encode())
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if all(mark in env for mark in marks):
            return int(entry.name)
    raise RuntimeError("group 1 has no process of local rank 1 running")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lighthouse-here", action="store_true",
                        help="one machine: the Lighthouse in this process, one torchrun per group")  # fmt: skip
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=None, help="with --lighthouse-here: SIGKILL a process of "
                        "group 1 after this step")  # fmt: skip
    args = parser.parse_args()
    if args.lighthouse_here:
        sys.exit(here(args.groups, args.steps, args.kill_after))
    train(args.steps)


if __name__ == "__main__":
    main()
