"""A run killed mid-epoch and restarted with ``fit(ckpt_path="last")``: the training script of the restart tests and
of ``benchmarks/restarts.py``.

A small MLP with dropout inside every stage, SGD with momentum, a step-wise LR schedule, a torchdata
``StatefulDataLoader`` (its position is in the checkpoint), ``ModelCheckpoint(every_n_train_steps=EVERY,
save_last=True)``. Each case is a mode (``ddp`` R x S, ``fsdp`` R x S with ``data_parallel="fsdp"``, ``3d`` 1 x S x 2
with tensor parallel blocks, ``local``, ``rpc``) and an attempt:

- ``ref``: the uninterrupted run of `STEPS` steps;
- ``cut``: the same run, stopped as a killed process stops it after step `KILL_AT` (``--kill raise``: every
  coordinator raises there, so the same processes go on with the next case, as a restart would; ``--kill
  rank:G``: global rank 0 SIGKILLs global rank G there, a real loss for torchrun's ``--max-restarts``);
- ``resume``: the same script again with ``fit(ckpt_path="last")`` from the cut run's folder.

After a fit every process writes ``<out>/<mode>-<attempt>-rank<g>.json``: its losses, the values of the parameters
it holds (whole, by the LightningModule's keys) and what the run said (warnings).

    torchrun --nproc-per-node 4 tests/restart_train.py --modes ddp --attempts cut,resume --kill rank:3 --out /tmp/x
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pipe import PipeStrategy  # noqa: E402

GLOBAL_BATCH, BATCHES, FEATURES, WIDTH = 8, 6, 8, 16  # an epoch is BATCHES steps
STEPS, EVERY, KILL_AT = 10, 3, 5  # the last checkpoint before the kill: step 3, mid-epoch (batch 3 of 6)
DROPOUT = 0.2
QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


class Block(nn.Module):
    """Linear, ReLU, Linear, dropout: with tensor parallel the first is split by columns, the second by rows."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.up, self.down, self.dropout = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(F.relu(self.up(x))))


def make_model(dropout: float = DROPOUT) -> nn.Sequential:
    blocks = [Block(dropout) for _ in range(3)]
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), *blocks, nn.Linear(WIDTH, 1))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    rows = BATCHES * GLOBAL_BATCH
    return TensorDataset(torch.randn(rows, FEATURES, generator=g), torch.randn(rows, 1, generator=g))


class Net(L.LightningModule):
    """The MLP; under tensor parallel ``configure_model`` splits each block over ``device_mesh["tensor_parallel"]``."""

    def __init__(self, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.model = make_model(dropout)

    def configure_model(self) -> None:
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for block in self.model[1:-1]:
            if not isinstance(block.up.weight, DTensor):  # idempotent, as Lightning asks
                plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
                parallelize_module(block, mesh["tensor_parallel"], plan)  # type: ignore[arg-type]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(L.Callback):
    """Each step's loss; on the cut attempt, the kill after step `KILL_AT` (``kill``: "raise" or "rank:G"; rank 0
    writes the time of the kill to ``$RESTART_PIDS/killed.txt``)."""

    def __init__(self, kill: str | None, moments: Path | None = None) -> None:
        self.losses: dict[int, float] = {}
        self.kill = kill
        self.moments = moments  # a resumed attempt: where it writes the time of its first step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.losses and self.moments is not None:  # a resumed attempt's first step: when it came back
            (self.moments / f"first-step-rank{global_rank()}.txt").write_text(repr(time.time()))
        self.losses[trainer.global_step] = float(outputs["loss"])
        if self.kill is None or trainer.global_step != KILL_AT:
            return
        if self.kill == "raise":
            raise Killed(f"killed after step {KILL_AT}")
        victim = int(self.kill.split(":")[1])
        if global_rank() == 0:  # rank 0 kills a process as an outside failure would, then goes on until it fails
            pid = int((Path(os.environ["RESTART_PIDS"]) / f"rank{victim}.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            (Path(os.environ["RESTART_PIDS"]) / "killed.txt").write_text(repr(time.time()))


class Killed(RuntimeError):
    """The simulated failure of the cut attempt."""


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def strategy(mode: str, world: int) -> Any:
    """The mode's strategy: ``ddp`` and ``fsdp`` 2 stages over ``world`` processes, ``3d`` 2 stages x 2 tensor ranks;
    ``local`` 2 stages in threads (``local-auto``: with ``schedule="auto"``, ``local-async``: ``"async"``,
    ``local-fp16``: ``"16-mixed"`` with a GradScaler), ``rpc`` 2 stage workers; ``plain``: no PipeStrategy."""
    if mode == "plain":
        return "auto"
    options: dict[str, Any] = {"stages": 2, "microbatches": 2, "schedule": "1f1b", "timeout": 120}
    if mode == "fsdp":
        options["data_parallel"] = "fsdp"
    elif mode == "3d":
        options["tensor_parallel"] = 2
    elif mode in ("local", "rpc"):
        options["transport"] = mode
    elif mode == "local-async":  # schedule="async": the stages update their own weights, a stream of batches
        options.update(transport="local", schedule="async")
    elif mode == "local-fp16":  # 16-mixed with a GradScaler whose scale grows every 2 steps
        options["transport"] = "local"
    elif mode == "local-auto":  # schedule="auto" chooses the schedule and the microbatch count after step 1
        options.update(transport="local", schedule="auto", microbatches="auto")
    return PipeStrategy(**options)


def replicas(mode: str, world: int) -> int:
    return {"ddp": world // 2, "fsdp": world // 2, "3d": world // 4}.get(mode, 1)


def run(
    mode: str, attempt: str, out: Path, world: int, kill: str | None, dropout: float = DROPOUT, loader: str = "stateful"
) -> dict[str, Any]:
    """One attempt of ``mode`` (its checkpoints under ``<out>/<mode>-ckpt``, the cut and resume attempts' shared
    folder); what this process saw. ``loader="plain"``: a DataLoader, which keeps no position."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    L.seed_everything(0, verbose=False)  # what a restarted script does first, as the first attempt did
    folder = out / f"{mode}-{'ref' if attempt == 'ref' else 'ckpt'}"
    record = Record(kill if attempt == "cut" else None, out if attempt == "resume" else None)
    saving = ModelCheckpoint(dirpath=folder, every_n_train_steps=EVERY, save_last=True, save_top_k=-1)
    devices: Any = world if mode in ("ddp", "fsdp", "3d") else 1
    plugins = []
    if mode == "local-fp16":
        from lightning.pytorch.plugins import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy(mode, world), max_steps=STEPS,
        callbacks=[record, saving], plugins=plugins, **QUIET,
    )  # fmt: skip
    net = Net(dropout)
    kind = StatefulDataLoader if loader == "stateful" else DataLoader
    data = kind(make_data(), batch_size=GLOBAL_BATCH // replicas(mode, world), shuffle=True)
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            trainer.fit(net, data, ckpt_path="last" if attempt == "resume" else None)
        except Exception as error:  # noqa: BLE001 - the cut attempt's failure is its result
            result["error"] = f"{type(error).__name__}: {error}"
    result["said"] = [str(w.message) for w in said]
    result["losses"] = record.losses
    result["steps"] = trainer.global_step
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:  # 16-mixed: the GradScaler's state at the end
        result["scaler"] = {k: float(v) for k, v in scaler.state_dict().items()}
    if mode == "local-auto":  # schedule="auto"'s choice, and whether it came from a checkpoint
        builder = trainer.strategy.builder
        result["chosen"], result["resumed"] = builder.chosen(), builder.selection.resumed
    result["tensors"] = {k: whole(v).tolist() for k, v in net.state_dict().items() if not whole(v).is_meta}
    (out / f"{mode}-{attempt}-rank{global_rank()}.json").write_text(json.dumps(result))
    return result


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value where this process holds it (a DTensor gathered over its own mesh)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor().detach() if isinstance(tensor, DTensor) else tensor.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", required=True, help="comma-separated: ddp, fsdp, 3d, local, rpc, plain")
    parser.add_argument("--attempts", default="ref,cut,resume", help="comma-separated: ref, cut, resume")
    parser.add_argument("--kill", default="raise", help="the cut attempt's failure: raise, or rank:G (SIGKILL)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dropout", type=float, default=DROPOUT)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "RESTART_PIDS" in os.environ:  # what rank 0 kills (torchrun's --max-restarts: each attempt writes its own)
        (Path(os.environ["RESTART_PIDS"]) / f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    attempts = args.attempts.split(",")
    if restarted:  # torchrun restarted the script: this attempt resumes
        attempts = ["resume"]
    for mode in args.modes.split(","):
        for attempt in attempts:
            run(mode, attempt, out, world, args.kill, args.dropout)


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    main()
