"""Train a classifier on scikit-learn's digits with PipeStrategy, on the GPU where there is one, else on CPU.

    python examples/digits.py                 # 2 stages, 4 microbatches, 1F1B (both stages on the one GPU)
    python examples/digits.py --accelerator cpu   # on CPU whatever the machine has
    python examples/digits.py --stages 4 --schedule gpipe
    python examples/digits.py --schedule auto --microbatches auto   # measured in the first step, logged
    python examples/digits.py --no-pipe       # the same LightningModule without the strategy
    python examples/digits.py --transport rpc --compress bf16   # stages in processes, activations as bfloat16
    python examples/digits.py --devices 4     # launched mode: 4 processes = 2 replicas x 2 stages (a GPU each)
    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29500 examples/digits.py --devices 4

The data set ships with scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from lightning_pipe import PipeStrategy


class DigitsClassifier(L.LightningModule):
    """An ordinary LightningModule: nothing here knows about pipelines."""

    def __init__(self, hidden: int = 128, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 10),
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        # sync_dist: in launched mode each replica validates its own shard; the logged value is their mean
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def digits_loaders(batch_size: int = 64, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))
    train, val = random_split(data, [1437, 360], generator=torch.Generator().manual_seed(seed))
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)),
        DataLoader(val, batch_size=batch_size),
    )


def train(
    pipe: bool = True,
    stages: int = 2,
    microbatches: int | str = 4,
    schedule: str = "1f1b",
    epochs: int = 15,
    transport: str | None = None,
    compress: str | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    accelerator: str = "auto",
) -> float:
    """Train and return the validation accuracy (in launched mode: on the processes that run Lightning's loop).

    ``accelerator="auto"``: ``"cuda"`` where a GPU is, else ``"cpu"``. With one GPU (``devices=1``) every stage
    runs on it, as threads of this process; with ``devices > 1`` each process of launched mode has its own.
    """
    L.seed_everything(0, verbose=False)
    model = DigitsClassifier()
    accelerator = resolve_accelerator(accelerator)
    options: dict[str, Any] = {"transport": transport} | ({"compress": compress} if compress else {})
    if accelerator in ("cuda", "gpu") and devices * num_nodes == 1:
        options["devices"] = ["cuda:0"] * stages  # the Trainer has one device: the stages share it
    # the global batch is split over the replicas: 64 rows per step whatever the layout
    replicas = max(1, devices * num_nodes // stages) if pipe and transport is None else devices * num_nodes
    train_loader, val_loader = digits_loaders(batch_size=64 // replicas)
    strategy: Any = (
        PipeStrategy(stages=stages, microbatches=microbatches, schedule=schedule, **options) if pipe else "auto"
    )
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_loader, val_loader)
    results = trainer.validate(model, val_loader, verbose=False)
    # once, on global rank 0: the value is the mean over the replicas; a serving process validates nothing
    return float(results[0]["val_acc"]) if results and trainer.is_global_zero else float("nan")


def resolve_accelerator(accelerator: str) -> str:
    """``"auto"``: ``"cuda"`` where torch sees a GPU, else ``"cpu"``; any other name as given."""
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def _count(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=_count, default=4, help="a number, or auto (with --schedule auto)")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--no-pipe", action="store_true", help="train without PipeStrategy")
    parser.add_argument("--transport", default=None, help="default: local, or launched with --devices > 1; rpc")
    parser.add_argument("--accelerator", default="auto", help="auto (cuda where a GPU is, else cpu), cuda or cpu")
    parser.add_argument("--devices", type=int, default=1, help="processes per machine (launched mode if > 1)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--compress", default=None, help="with --transport rpc: bf16, fp16, zstd, bf16+zstd, ...")
    args = parser.parse_args()
    accuracy = train(
        not args.no_pipe, args.stages, args.microbatches, args.schedule, args.epochs, args.transport, args.compress,
        args.devices, args.num_nodes, args.accelerator,
    )  # fmt: skip
    if accuracy == accuracy:  # NaN on every process but global rank 0
        print(f"validation accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
