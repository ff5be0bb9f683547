"""A short launched run for the exit tests: ``python tests/launched_exits.py --out DIR [--fits N] [--ctrl-c]``.

Every process of the run executes this script (``--devices 2``: Lightning's launcher starts the
second one; under torchrun's or SLURM's variables both are started). Each fit trains a tiny model in
one pipeline of 2 stages for 2 steps. After its last fit, each process writes ``done-rank<r>``: the
names of the lightning_pipe threads still running then, one a line (a clean run has none: they are
joined before ``fit`` returns, so none is left when the interpreter exits). At exit, after the
strategy's own exit hook, each writes ``exit-rank<r>``: ``destroyed`` once the process groups are gone
(else ``still initialised``), and the time (``time.time()``).

``--ctrl-c``: in the last fit, stage 0 writes ``waiting-rank<r>`` at its first training forward and
waits there (at most 60 s) for the test's Ctrl-C to the process group of the run.

``--ports P0,P1,...``: one run per port, each in a child forked from this process (which imported torch and
Lightning once, and never joins torch.distributed itself): run ``i`` writes into ``DIR/i`` and meets its peers
on port ``Pi``. Each child ends through the interpreter's own shutdown, as a process started for the run would;
this process writes ``children-rank<r>``: each child's exit status, one a line (0, or ``-SIGNAL``).
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import gc
import os
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pipe import PipeStrategy  # noqa: E402


class WaitsForCtrlC(nn.Module):
    """The identity; once ``armed``, its first training forward writes ``mark`` and sleeps up to 60 s."""

    def __init__(self, mark: Path) -> None:
        super().__init__()
        self.mark, self.armed = mark, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and torch.is_grad_enabled():
            self.armed = False
            self.mark.with_name(f"{self.mark.name}-rank{dist.get_rank()}").write_text(str(time.time()))
            until = time.monotonic() + 60
            while time.monotonic() < until:
                time.sleep(0.05)
        return x


class Net(L.LightningModule):
    def __init__(self, waits: WaitsForCtrlC) -> None:
        super().__init__()
        self.model = nn.Sequential(waits, nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def note_exit(out: Path, rank: int) -> None:
    """Registered before the first fit, so it runs after the strategy's exit hook (atexit runs them in reverse)."""
    state = "still initialised" if dist.is_initialized() else "destroyed"
    (out / f"exit-rank{rank}").write_text(f"{state}\n{time.time()}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fits", type=int, default=1)
    parser.add_argument("--ctrl-c", action="store_true", help="the last fit waits mid-step for a Ctrl-C")
    parser.add_argument("--ports", default="", help="one forked run per port (see the module's docstring)")
    args = parser.parse_args()
    if args.ports:
        fork_runs(args, [int(port) for port in args.ports.split(",")])
    else:
        run(args, Path(args.out))


def fork_runs(args: argparse.Namespace, ports: list[int]) -> None:
    """One run per port, each in a child of this process; the children's exit statuses in ``children-rank<r>``."""
    rank = next(os.environ[k] for k in ("RANK", "SLURM_PROCID", "LOCAL_RANK") if k in os.environ)
    statuses = []
    for index, port in enumerate(ports):
        out = Path(args.out) / str(index)
        out.mkdir(parents=True, exist_ok=True)
        gc.freeze()  # the child's exit does not walk (and copy) the parent's objects
        child = os.fork()
        if child == 0:
            os.environ["MASTER_PORT"] = str(port)
            run(args, out)
            sys.exit(0)  # the interpreter's shutdown: atexit hooks, thread joins, module teardown
        _, status = os.waitpid(child, 0)
        statuses.append(os.waitstatus_to_exitcode(status))
    (Path(args.out) / f"children-rank{rank}").write_text("".join(f"{code}\n" for code in statuses))


def run(args: argparse.Namespace, out: Path) -> None:
    waits = WaitsForCtrlC(out / "waiting")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
    rank = next((os.environ[k] for k in ("RANK", "SLURM_PROCID", "LOCAL_RANK") if k in os.environ), "0")
    atexit.register(note_exit, out, int(rank))  # the launcher's variables: no group exists yet
    for fit in range(args.fits):
        waits.armed = args.ctrl_c and fit == args.fits - 1
        trainer = L.Trainer(
            accelerator="cpu", devices=args.devices, strategy=PipeStrategy(stages=2, microbatches=2, timeout=60),
            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Net(waits), DataLoader(data, batch_size=4))
        (out / f"fit{fit}-rank{dist.get_rank()}").touch()
    left = [t.name for t in threading.enumerate() if t.name.startswith("lightning_pipe-")]
    (out / f"done-rank{dist.get_rank()}").write_text("".join(f"{name}\n" for name in left))


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    main()
