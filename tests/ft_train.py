"""The training script of the fault-tolerance tests and of ``benchmarks/fault_tolerance.py``: one torchrun per torchft
replica group, 2 processes each (2 stages), or Lightning's DDP with 2 processes as the reference (``--ddp``).

A small MLP, SGD with momentum and a step-wise LR schedule, a shuffled loader (Lightning cuts it into one shard per
replica group, as DDP does per process). The coordinator of each group appends a line per step to
``<out>/steps-g<group>.jsonl`` (time, Lightning's global step, the groups in the step's quorum) and, while its quorum
lacks a group, waits ``--degraded-sleep`` seconds after each step, so that a restarted group can rejoin before the
run ends. Every process appends its start (pid, attempt, when its interpreter started) to ``<out>/procs.jsonl`` and
writes, after the fit, its stage's tensors and optimizer state to ``<out>/final-g<group>-r<rank>.pt``.

    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 \\
        torchrun --nproc-per-node 2 --max-restarts 1 tests/ft_train.py --out /tmp/ft --steps 40
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a restarted process's start, as the benchmark measures it

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pipe import FaultTolerance, PipeStrategy  # noqa: E402

BATCH, ROWS, FEATURES, WIDTH, OUTPUTS = 8, 256, 8, 16, 4
QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False)  # fmt: skip


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUTPUTS)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class StepLog(L.Callback):
    """Each step of this group's coordinator: when, Lightning's global step, the groups in the quorum."""

    def __init__(self, path: Path, groups: int, sleep: float, degraded_sleep: float) -> None:
        self.path, self.groups, self.sleep, self.degraded_sleep = path, groups, sleep, degraded_sleep

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        replicas = getattr(getattr(trainer.strategy, "mode", None), "replicas", None)  # launched mode's `Replicas`
        replica_group = getattr(replicas, "group", None)  # torchft's: `TorchftGroups.group`
        groups = replica_group.manager.num_participants() if replica_group is not None else self.groups
        with self.path.open("a") as log:
            log.write(json.dumps({"t": time.time(), "step": trainer.global_step, "groups": groups,
                                  "attempt": attempt()}) + "\n")  # fmt: skip
        time.sleep(self.sleep if groups >= self.groups else self.degraded_sleep)


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--degraded-sleep", type=float, default=0.0)
    parser.add_argument("--ddp", action="store_true", help="the reference: Lightning's DDP, one process per replica")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if os.environ.get("FT_DEBUG"):  # torchft's own log (quorums, commits, errors), with times
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    with (args.out / "procs.jsonl").open("a") as log:
        log.write(json.dumps({"group": group, "rank": rank, "pid": os.getpid(), "attempt": attempt(),
                              "started": STARTED}) + "\n")  # fmt: skip
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(ROWS, FEATURES, generator=g), torch.randn(ROWS, OUTPUTS, generator=g))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    groups = 2 if args.ddp else int(os.environ["NUM_REPLICA_GROUPS"])
    if args.ddp:
        strategy: Any = "ddp"
    else:
        strategy = PipeStrategy(stages=2, microbatches=2, timeout=60, fault_tolerance=FaultTolerance(timeout=10))
    callbacks = [StepLog(args.out / f"steps-g{group}.jsonl", groups, args.sleep, args.degraded_sleep)]
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=args.steps, strategy=strategy, callbacks=callbacks,
                        **QUIET)  # fmt: skip
    net = Net()
    trainer.fit(net, loader)
    if args.ddp:
        if rank == 0:
            state = {"model": net.model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                     "step": trainer.global_step}  # fmt: skip
            torch.save(state, args.out / "final-ddp.pt")
        return
    worker = trainer.strategy.stage.worker
    final = {"model": worker.state.call_state_dict(), "optimizer": worker.state.call_optimizer_state(),
             "step": trainer.global_step}  # fmt: skip
    torch.save(final, args.out / f"final-g{group}-r{rank}.pt")


if __name__ == "__main__":
    main()
