"""A model bigger than one process should hold, trained with each process holding only its stage.

    # 4 processes on this machine (Lightning starts them), 1 replica x 4 stages, the model built on meta
    python examples/big_model.py --devices 4 --stages 4 --build meta
    # 2 replicas x 2 stages, each stage sharded over its 2 replicas with FSDP2, resumed from a checkpoint
    python examples/big_model.py --devices 4 --stages 2 --data-parallel fsdp --ckpt-path last.ckpt

The recipe (docs/big-models.md): build the model without values, ``with trainer.init_module(empty_init=True)``
or in ``configure_model()``; every process then makes only its own stage real, from ``ckpt_path=`` (a single
file or a sharded folder), from ``PipeStrategy(weights=...)`` or by the modules' own initialisation under the
run's seed. Checkpoints are folders each process writes its part of; ``python -m lightning_pipe consolidate``
makes one file of them. ``--report FILE`` writes each process's losses and peak memory (the tests and
``benchmarks/memory.py`` read them); ``--plain`` trains without the pipeline, ``--ddp`` with Lightning's DDP.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pipe import PipeStrategy


def layers(width: int, depth: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(depth):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


class Big(L.LightningModule):
    def __init__(self, width: int = 2048, depth: int = 32, build: str = "eager", optimizer: str = "sgd") -> None:
        super().__init__()
        self.width, self.depth, self.build, self.optimizer_name = width, depth, build, optimizer
        if build != "configure_model":
            self.model = layers(width, depth)  # on meta under trainer.init_module(empty_init=True)

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = layers(self.width, self.depth)  # the strategy builds this on meta

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-4)
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Record(L.Callback):
    """Each step's loss, and a checkpoint after epoch ``save_epoch``."""

    def __init__(self, save: str | None, save_epoch: int) -> None:
        self.losses: list[float] = []
        self.save, self.save_epoch = save, save_epoch

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.save and trainer.current_epoch == self.save_epoch:
            trainer.save_checkpoint(self.save)


def peak_mib() -> float:
    """This process's peak resident memory (Linux), in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> None:
    """Train as the command line (or ``argv``) says."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--build", choices=["eager", "meta", "configure_model"], default="meta")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu: one process per GPU")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--data-parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument(
        "--virtual-stages", type=int, default=1, help="stages per process (looped schedules); --stages counts processes"
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="rows per replica and step")
    parser.add_argument("--epochs", type=int, default=3, help="one optimizer step per epoch (0: build only)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--recompute", default="auto", help="PipeStrategy(checkpoint=...): activation recomputation")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--save", default=None, help="checkpoint written after epoch --save-epoch")
    parser.add_argument("--save-epoch", type=int, default=0)
    parser.add_argument("--save-at-end", default=None, help="checkpoint written after the fit, by every process")
    parser.add_argument("--single-file", action="store_true", help="save one file instead of a sharded folder")
    parser.add_argument("--weights", default=None, help="pretrained weights of the pipelined module (--plain too)")
    parser.add_argument("--plain", action="store_true", help="no pipeline: one process, the whole model")
    parser.add_argument("--ddp", action="store_true", help="Lightning's DDP over --devices processes")
    parser.add_argument("--report", default=None, help="write losses and peak memory here (one file per process)")
    parser.add_argument("--empty", action="store_true", help="report the memory of a process that trains nothing")
    args = parser.parse_args(argv)
    if args.empty:  # what every process costs before any model: torch, Lightning and lightning_pipe imported
        write_report(args.report, [])
        return

    L.seed_everything(0, verbose=False)
    replicas = 1 if args.plain else args.devices if args.ddp else max(1, args.devices // args.stages)
    torch.manual_seed(1)
    rows = args.batch * replicas * args.accumulate
    data = TensorDataset(torch.randn(rows, args.width), torch.randn(rows, args.width))
    if args.plain:  # the order Lightning's distributed sampler gives a launched run (it shuffles, seed 0)
        loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, 1, 0, seed=0))
    else:
        loader = DataLoader(data, batch_size=args.batch)
    if args.plain:
        strategy: Any = "auto"
    elif args.ddp:
        strategy = "ddp"
    else:
        strategy = PipeStrategy(
            stages=args.stages * args.virtual_stages,
            virtual_stages=args.virtual_stages,
            microbatches=args.microbatches,
            schedule=args.schedule,
            data_parallel=args.data_parallel,
            checkpoint=args.recompute,
            weights=args.weights,
            save_distributed_checkpoint=not args.single_file,
        )
    record = Record(args.save, args.save_epoch)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1 if args.plain else args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        gradient_clip_val=args.clip,
        accumulate_grad_batches=args.accumulate,
        use_distributed_sampler=not args.plain,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    build = args.build if not (args.plain or args.ddp) else "eager"  # Lightning's own strategies: the whole model
    if build == "meta":
        with trainer.init_module(empty_init=True):
            model = Big(args.width, args.depth, build, args.optimizer)
    else:
        model = Big(args.width, args.depth, build, args.optimizer)
    if args.weights and (args.plain or args.ddp):  # Lightning's own strategies: the user loads the weights
        model.model.load_state_dict(read_weights(args.weights))
    trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    if args.save_at_end:
        trainer.save_checkpoint(args.save_at_end)  # every process: each writes its own stage
    write_report(args.report, record.losses)


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """A state dict of the pipelined module: safetensors, or a ``torch.save``d dict."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


def write_report(folder: str | None, losses: list[float]) -> None:
    """This process's losses and peak memory, as ``<folder>/rank<global rank>.json``."""
    if folder is None:
        return
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    Path(folder).mkdir(parents=True, exist_ok=True)
    report = {"rank": rank, "losses": losses, "peak_mib": peak_mib()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
