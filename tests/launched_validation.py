"""Validation between launched training steps: ``python tests/launched_validation.py --out DIR [--ddp]``.

Two processes (Lightning's launcher starts the second), one pipeline of 2 stages (R = 1 replica);
``--ddp``: the reference, the same fit under Lightning's DDP over R = 1 process (the same distributed
sampler, which shuffles the training data). Validation runs after every training step. The optimizer's step
(`SlowSGD`, run by each stage on its own parameters) reads the gradients, sleeps, and reads them again:
Lightning posts it to the stages without waiting and, before validation, frees the module's gradients
from its loop's thread (``on_validation_model_zero_grad``). In the coordinator's process those are the
tensors its stage is stepping; the strategy lets the stages finish first. Each process writes
``rank<r>.pt``: its stage's parameters after the fit, by name.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pipe import PipeStrategy  # noqa: E402

PAUSE = 0.3  # seconds between the step's two reads of the gradients


class SlowSGD(torch.optim.SGD):
    """SGD whose step holds on to the gradients for a while, as a big stage's step does."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        time.sleep(PAUSE)
        lost = [tuple(p.shape) for p in params if p.grad is None]
        if lost:
            raise RuntimeError(f"gradients of parameters {lost} were freed during the optimizer step")
        return super().step(closure)


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.val_losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return SlowSGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ddp", action="store_true", help="Lightning's DDP over the replicas (1 process)")
    args = parser.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
    strategy: Any = (
        DDPStrategy(process_group_backend="gloo") if args.ddp else PipeStrategy(stages=2, microbatches=2, timeout=60)
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if args.ddp else 2, strategy=strategy, max_epochs=args.epochs,
        val_check_interval=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    model = Net()
    loader = DataLoader(data, batch_size=4)
    trainer.fit(model, loader, loader)
    prefix = "ddp-" if args.ddp else ""
    kept = {name: p.detach().clone() for name, p in model.named_parameters() if p.device.type != "meta"}
    torch.save(kept, Path(args.out) / f"{prefix}rank{dist.get_rank()}.pt")
    if model.val_losses:  # the process that ran Lightning's loop: the coordinator's
        (Path(args.out) / f"{prefix}val.json").write_text(json.dumps(model.val_losses))


if __name__ == "__main__":
    faulthandler.enable()
    main()
