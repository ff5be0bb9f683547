"""A training script that the launched-mode tests start as a user would (Lightning's launcher, torchrun, SLURM).

Every process runs this script; PipeStrategy makes R replicas x P pipeline ranks of them. Each case
is one ``fit`` of 3 optimizer steps on a small MLP; after it, every process saves its own stage's trained
tensors (``<out>/<case>-rank<g>.pt``) for the test to put together and compare with the unsplit model
trained on the global batch. ``--save``/``--resume`` write and resume a checkpoint; ``--kill-rank G
--kill-call N`` makes global rank G SIGKILL itself in the N-th forward of its first stage (mid-step).

    python tests/launched_train.py --devices 4 --cases s2-sgd-gpipe,s4-adam-1f1b --out /tmp/x
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
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
from lightning_pipe.strategy.process_groups import ProcessGroups  # noqa: E402

GLOBAL_BATCH = 16
DROPOUT = 0.3
STEPS = 3
FEATURES, OUTPUTS = 8, 4


def make_model(dropout: float = 0.0, gelu: bool = False) -> nn.Sequential:
    """The MLP; ``gelu``: GELU in place of Tanh (it saves an intermediate, which a compiled backward donates)."""
    if dropout:  # a dropout in every one of 4 stages of 2 layers each
        return nn.Sequential(
            nn.Linear(FEATURES, 16), nn.Dropout(dropout), nn.Linear(16, 16), nn.Dropout(dropout),
            nn.Linear(16, 16), nn.Dropout(dropout), nn.Dropout(dropout), nn.Linear(16, OUTPUTS),
        )  # fmt: skip
    act = nn.GELU if gelu else nn.Tanh
    return nn.Sequential(
        nn.Linear(FEATURES, 16), act(), nn.Linear(16, 16), act(), nn.Linear(16, 16), act(), nn.Linear(16, OUTPUTS),
    )  # fmt: skip


def make_data(batches: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(batches * GLOBAL_BATCH, FEATURES, generator=g),
                         torch.randn(batches * GLOBAL_BATCH, OUTPUTS, generator=g))  # fmt: skip


def parse_case(case: str) -> dict:
    """``s2-adam-1f1b-acc2-clip``: pipeline ranks, optimizer, schedule, accumulation 2, clipping; ``save`` writes a
    checkpoint after the fit, ``resume`` resumes from the case's ``--resume`` checkpoint for one more step.
    ``s2-sgd-looped_bfs-v2-m8``: schedule ``looped-bfs`` (``_`` for ``-``), two stages per rank, 8 microbatches;
    ``tok``: a masked loss, the mean over the rows whose target is labelled (`masked_mse`), microbatches weighted
    by their labelled rows; ``drop``: dropout in every stage, each stage recomputing its forward; ``ind``: stages
    compiled with ``backend="inductor"`` (and GELU for Tanh); ``sub``: the model's Linear layers compiled by the user
    (``torch.compile``)."""
    parts = case.split("-")
    option = {p[0]: int(p[1:]) for p in parts[3:] if p[:1] in ("v", "m") and p[1:].isdigit()}
    return {
        "stages": int(parts[0][1:]),
        "optimizer": parts[1],
        "schedule": parts[2].replace("_", "-"),
        "virtual": option.get("v", 1),
        "microbatches": option.get("m", 2),
        "accumulate": 2 if "acc2" in parts else 1,
        "masked": "tok" in parts,
        "dropout": "drop" in parts,
        "clip": 0.05 if "clip" in parts else None,
        "save": "save" in parts,
        "resume": "resume" in parts,
        "backend": "inductor" if "ind" in parts else None,
        "gelu": "ind" in parts,
        "compiled_submodules": "sub" in parts,
    }


class Killer(nn.Module):
    """SIGKILLs its own process in its ``call``-th forward when that process is global rank ``rank``."""

    def __init__(self, rank: int, call: int, mark: str) -> None:
        super().__init__()
        self.rank, self.call, self.calls, self.mark = rank, call, 0, mark

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.is_initialized() and dist.get_rank() == self.rank and self.calls == self.call:
            Path(self.mark).write_text(str(time.time()))  # when it died, for the test
            os.kill(os.getpid(), signal.SIGKILL)
        return x


def labelled(y: torch.Tensor) -> torch.Tensor:
    """The rows of a target that count (a token-weighted loss's labelled tokens): about half, some microbatches none."""
    return y[:, 0] > 0


def masked_mse(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean squared error over the labelled rows only."""
    valid = labelled(y).float()
    return (((output - y) ** 2).mean(dim=1) * valid).sum() / valid.sum()


def labelled_rows(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return labelled(batch[1]).sum()


class Net(L.LightningModule):
    def __init__(
        self,
        optimizer: str = "sgd",
        killer: nn.Module | None = None,
        masked: bool = False,
        dropout: float = 0.0,
        gelu: bool = False,
    ) -> None:
        super().__init__()
        model = make_model(dropout, gelu)
        self.model = nn.Sequential(killer, *model) if killer is not None else model
        self.optimizer = optimizer
        self.loss = masked_mse if masked else F.mse_loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self.model(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL)")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--cases", default="s2-sgd-1f1b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", default=None, help="the checkpoint that cases marked 'resume' continue")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-call", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    for name in args.cases.split(","):
        case = parse_case(name)
        replicas = args.devices * args.num_nodes // case["stages"]
        L.seed_everything(0, verbose=False)
        killer = Killer(args.kill_rank, args.kill_call, str(out / "killed-at")) if args.kill_rank is not None else None
        model = Net(case["optimizer"], killer, case["masked"], DROPOUT if case["dropout"] else 0.0, case["gelu"])
        if case["compiled_submodules"]:
            for i, layer in enumerate(model.model):
                if isinstance(layer, nn.Linear):
                    model.model[i] = torch.compile(layer)
        steps = STEPS + 1 if case["resume"] else STEPS
        trainer = L.Trainer(
            accelerator=args.accelerator,
            devices=args.devices,
            num_nodes=args.num_nodes,
            strategy=PipeStrategy(
                stages=case["stages"] * case["virtual"],
                virtual_stages=case["virtual"],
                microbatches=case["microbatches"],
                schedule=case["schedule"],
                timeout=240 if case["backend"] or case["compiled_submodules"] else 60,  # compiles
                microbatch_weight=labelled_rows if case["masked"] else None,
                checkpoint="always" if case["dropout"] else "auto",
                backend=case["backend"],
            ),  # fmt: skip
            max_steps=steps,
            accumulate_grad_batches=case["accumulate"],
            gradient_clip_val=case["clip"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        data = make_data(STEPS * case["accumulate"])
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // replicas)
        trainer.fit(model, loader, ckpt_path=args.resume if case["resume"] else None)
        layout = trainer.strategy.layout
        rank = trainer.global_rank
        # each process's LightningModule holds its own stage's trained tensors (the rest is on meta)
        trained = {k.replace("_orig_mod.", ""): v.cpu() for k, v in model.model.state_dict().items() if not v.is_meta}
        torch.save(trained, out / f"{name}-rank{rank}.pt")
        if layout is None or layout.coordinates:
            if trainer.is_global_zero:
                info = {"world_size": layout.world_size if layout else 1, "replicas": layout.replicas if layout else 1,
                        "loss": float(trainer.callback_metrics["train_loss"])}  # fmt: skip
                if layout is not None:  # a pipeline of two processes on this machine: its link is their own socket
                    info["socket"] = ProcessGroups.of(layout, "cpu").socket is not None
                (out / f"{name}.json").write_text(json.dumps(info))
        if case["save"]:
            trainer.save_checkpoint(out / f"{name}.ckpt")  # written once, by global rank 0
    (out / f"done-rank{dist.get_rank() if dist.is_initialized() else 0}").touch()


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    main()
