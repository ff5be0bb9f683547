"""Checkpoint migration by ``on_load_checkpoint``: the model, the files and the fits shared by
tests/test_checkpoint_hooks.py (local and rpc mode, in the test's process) and its launched runs
(``python tests/checkpoint_hooks.py --files F --out D``).

A checkpoint of an older version of the model: one key under its old name, a tensor stored in half precision, one
stored scaled by 2, one missing (the module gained it since). The LightningModule's ``on_load_checkpoint`` migrates
it: renames the key back, converts the half tensor, undoes the scale, adds the missing tensor, and (``drop``) drops
one more key, which ``strict_loading = False`` then initialises. Its ``on_save_checkpoint`` exports the state
under other keys (one renamed, one dropped, one added). A plain Trainer resuming the same file with the same hooks
is the reference: its losses and the checkpoint it writes.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from state_contract import to_folder  # noqa: E402

from lightning_pipe import PipeStrategy  # noqa: E402

BATCH, PART, STEPS = 16, 2, 4
OLD_NAME, NEW_NAME = "model.legacy.weight", "model.2.weight"  # renamed since the checkpoint was written
HALF, SCALED, ADDED, DROPPED = "model.0.weight", "model.4.weight", "model.3.bias", "model.3.weight"
EXPORTED, NOT_SAVED, VERSION = ("model.4.weight", "model.head.weight"), "model.3.bias", "model.version"
QUIET: dict[str, Any] = dict(
    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)  # fmt: skip


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))


def migrate(state: dict[str, Any], drop: bool) -> None:
    """The user's migration: the old checkpoint's ``state_dict`` to this version's keys and values."""
    state[NEW_NAME] = state.pop(OLD_NAME)
    state[HALF] = state[HALF].float()
    state[SCALED] = state[SCALED] / 2
    state[ADDED] = torch.full((16,), 0.25)
    if drop:
        del state[DROPPED]


class Net(L.LightningModule):
    def __init__(self, build: str = "eager", drop: bool = False) -> None:
        super().__init__()
        self.build, self.drop = build, drop
        self.export = False  # on_save_checkpoint exports under other keys (a resumed run's)
        self.strict_loading = not drop
        self.model: nn.Module | None = None if build == "configure_model" else make_model()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = make_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.model is not None
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        migrate(checkpoint["state_dict"], self.drop)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.export:
            state = checkpoint["state_dict"]
            state[EXPORTED[1]] = state.pop(EXPORTED[0])
            del state[NOT_SAVED]
            state[VERSION] = torch.tensor(2.0)


class SaveAt(L.Callback):
    """``trainer.save_checkpoint(path)`` after optimizer step ``step``, while the fit runs."""

    def __init__(self, path: str | Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.values.append(float(outputs["loss"]))


def fit(
    strategy: Any,
    build: str,
    steps: int,
    ckpt: str | None = None,
    drop: bool = False,
    replicas: int = 1,
    save: str | Path | None = None,
    **trainer: Any,
) -> tuple[L.Trainer, Net, Losses]:
    """``steps`` optimizer steps from ``ckpt`` (``build``: "eager", "init_module" or "configure_model"); ``save``: a
    checkpoint written after the last step while the fit runs (through the export hook)."""
    L.seed_everything(0, verbose=False)
    losses = Losses()
    callbacks: list[L.Callback] = [losses] + ([SaveAt(save, steps)] if save is not None else [])
    t = L.Trainer(strategy=strategy, max_steps=steps, callbacks=callbacks, **{**QUIET, **trainer})
    if build == "init_module":
        with t.init_module(empty_init=True):
            net = Net(build, drop)
    else:
        net = Net(build, drop)
    net.export = ckpt is not None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        t.fit(net, DataLoader(make_data(), batch_size=BATCH // replicas), ckpt_path=ckpt)
    t.said = [str(w.message) for w in said]  # type: ignore[attr-defined]
    return t, net, losses


def write_old_files(out: Path) -> dict[str, str]:
    """A plain Trainer's checkpoint after ``PART`` steps, written as the older version would have: a single file
    and a sharded folder (the optimizer's state of the renamed parameter under its old name too)."""
    t, _, _ = fit("auto", "eager", PART)
    t.save_checkpoint(out / "new.ckpt")
    checkpoint = torch.load(out / "new.ckpt", weights_only=True)
    order = list(checkpoint["state_dict"])
    state = checkpoint["state_dict"]
    state[OLD_NAME] = state.pop(NEW_NAME)
    state[HALF] = state[HALF].half()
    state[SCALED] = state[SCALED] * 2
    del state[ADDED]
    torch.save(checkpoint, out / "old.ckpt")
    params = [OLD_NAME if k == NEW_NAME else k for k in order]  # the optimizer's order: every key is a parameter
    to_folder(checkpoint, out / "old", params)
    return {"file": str(out / "old.ckpt"), "folder": str(out / "old")}


def model_tensors(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items() if not v.is_meta}


LAUNCHED = [  # (name, build, stages, replicas, data_parallel)
    ("ddp-eager", "eager", 2, 1, "ddp"),
    ("ddp-meta", "configure_model", 2, 1, "ddp"),
    ("fsdp-meta", "configure_model", 1, 2, "fsdp"),
]
#: the launched cases: each build from the file and from the folder, the lenient hook (every edit, a key dropped)
#: and the strict one (every edit but the drop) each at least once per mode
LAUNCHED_CASES = [
    ("ddp-eager", "file", True), ("ddp-eager", "folder", True), ("ddp-meta", "file", False),
    ("ddp-meta", "folder", True), ("fsdp-meta", "file", True), ("fsdp-meta", "folder", False),
]  # fmt: skip


def launched_cases(files: dict[str, str], out: Path) -> None:
    """Every launched case (`LAUNCHED_CASES`) in these 2 processes; each process writes its losses; the checkpoint is
    written while the fit runs (``migrate``) or after it (``drop``: every process saves its own part)."""
    builds = {name: rest for name, *rest in LAUNCHED}
    for name, fmt, drop in LAUNCHED_CASES:
        build, stages, replicas, data_parallel = builds[name]
        path = files[fmt]
        case = f"{name}-{fmt}-{'drop' if drop else 'migrate'}"
        strategy = PipeStrategy(stages=stages, microbatches=2, timeout=60, data_parallel=data_parallel)
        result: dict[str, Any] = {}
        began = time.monotonic()
        try:
            during = None if drop else out / case
            t, _, losses = fit(strategy, build, STEPS, ckpt=path, drop=drop, replicas=replicas, devices=2, save=during)
            result = {"losses": losses.values, "said": t.said}  # type: ignore[attr-defined]
            if drop:
                t.save_checkpoint(out / case)
        except Exception as error:  # noqa: BLE001 - what each process raised is the result
            result = {"error": f"{type(error).__name__}: {error}"}
        result["seconds"] = time.monotonic() - began
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out / f"{case}-rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", required=True, help="a JSON file: the old checkpoint's paths (write_old_files)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    launched_cases(json.loads(Path(args.files).read_text()), Path(args.out))


if __name__ == "__main__":
    faulthandler.enable()
    main()
