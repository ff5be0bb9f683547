"""The training-state contract's model, data and fits, shared by its test (local mode, in the test's process)
and by the launched runs (``python tests/state_contract.py --mode ddp|fsdp --files F --out D [--mode ...]``).

A small MLP trained with SGD and momentum on 4 batches; a "part" run trains 2 steps and writes the files a
run resumes from: a single-file checkpoint, a sharded folder (DCP) and safetensors weights, and next to each
a copy with one key renamed and a copy with one unexpected key. A launched run does its cases one after the
other in the same processes and writes what each did to ``<out>/<case>-rank<g>.json``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
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
from lightning_pipe import PipeStrategy  # noqa: E402
from lightning_pipe.checkpoint.reader import open_checkpoint  # noqa: E402
from lightning_pipe.checkpoint.sharded import OptimizerPart, save_sharded  # noqa: E402

BATCH, STEPS, PART = 16, 4, 2  # the global batch; the uninterrupted run's steps; the steps before the checkpoint
# One batch per epoch: a plain Trainer resumed from a checkpoint written when max_steps stopped it re-reads the
# epoch's batches from its start (a DataLoader keeps no position), so with one batch a resumed run sees what the
# uninterrupted one does, and any difference is the training state's.
RENAMED, EXTRA = ("model.2.weight", "model.renamed.weight"), "model.extra.weight"
QUIET: dict[str, Any] = dict(
    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)  # fmt: skip


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))


class Net(L.LightningModule):
    """The model, built as the user's code does: eagerly in ``__init__``, or in ``configure_model`` (on meta)."""

    def __init__(self, in_configure_model: bool = False, strict: bool = True) -> None:
        super().__init__()
        self.in_configure_model = in_configure_model
        self.strict_loading = strict
        self.model: nn.Module | None = None if in_configure_model else make_model()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = make_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.model is not None
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Losses(L.Callback):
    """Each step's loss as the coordinator's step returned it; the model's tensors as the fit starts (local mode)."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        if getattr(trainer.strategy, "layout", None) is None:  # local mode, or a plain Trainer
            self.start = {k: v.detach().clone() for k, v in module.state_dict().items()}

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.values.append(float(outputs["loss"]))


def fit(
    strategy: PipeStrategy,
    build: str,
    steps: int,
    ckpt: str | None = None,
    strict: bool = True,
    replicas: int = 1,
    seed: int | None = 0,
    net: Net | None = None,
    **trainer: Any,
) -> tuple[L.Trainer, Net, Losses]:
    """One fit of ``steps`` optimizer steps (``build``: "eager", "init_module" (empty_init) or "configure_model");
    ``seed`` None: no seed_everything (the run's seed is torch's initial seed); ``net``: a module an earlier fit
    trained, fitted again (a new Trainer, a new optimizer) from where that fit left it."""
    if seed is not None:
        L.seed_everything(seed, verbose=False)
    losses = Losses()
    t = L.Trainer(strategy=strategy, max_steps=steps, callbacks=[losses], **{**QUIET, **trainer})
    if net is not None:
        pass
    elif build == "init_module":
        with t.init_module(empty_init=True):
            net = Net(strict=strict)
    else:
        net = Net(build == "configure_model", strict)
    loader = DataLoader(make_data(), batch_size=BATCH // replicas)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        t.fit(net, loader, ckpt_path=ckpt)
    t.said = [str(w.message) for w in said]  # type: ignore[attr-defined]
    return t, net, losses


def tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint (a single file or a sharded folder), by the LightningModule's keys."""
    reader = open_checkpoint(path)
    source = reader.model()
    try:
        return {k: source.get(k).clone() for k in source.keys()}
    finally:
        reader.close()


def write_files(part: Path, out: Path) -> dict[str, str]:
    """From the single-file checkpoint ``part``: the three formats, each good, with a key renamed, with an
    unexpected key; ``{"<format>-<kind>": path}``."""
    from safetensors.torch import save_file

    checkpoint = torch.load(part, weights_only=True)
    files: dict[str, str] = {}
    for kind in ("good", "renamed", "extra"):
        edited = {**checkpoint, "state_dict": dict(checkpoint["state_dict"])}
        state = edited["state_dict"]
        if kind == "renamed":
            state[RENAMED[1]] = state.pop(RENAMED[0])
        elif kind == "extra":
            state[EXTRA] = torch.zeros(3)
        files[f"file-{kind}"] = str(out / f"file-{kind}.ckpt")
        torch.save(edited, files[f"file-{kind}"])
        files[f"folder-{kind}"] = str(out / f"folder-{kind}")
        order = [RENAMED[1] if kind == "renamed" and k == RENAMED[0] else k for k in checkpoint["state_dict"]]
        to_folder(edited, Path(files[f"folder-{kind}"]), order)
        files[f"weights-{kind}"] = str(out / f"weights-{kind}.safetensors")
        save_file({k.removeprefix("model."): v.contiguous() for k, v in state.items()}, files[f"weights-{kind}"])
    return files


def to_folder(checkpoint: dict[str, Any], folder: Path, names: list[str]) -> None:
    """``checkpoint`` (a single file's content) as the sharded folder launched mode writes (one process);
    ``names``: the parameters' keys in the optimizer's order (the model has no buffers)."""
    optimizers = []
    for saved in checkpoint["optimizer_states"]:
        layout: list[list[str]] = []
        flat: list[str] = []
        for group in saved["param_groups"]:
            keys = names[len(flat) : len(flat) + len(group["params"])]
            layout.append(keys)
            flat += keys
        state = {flat[i]: s for i, s in saved["state"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
        optimizers.append(OptimizerPart(state, groups, layout))
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded(folder, dict(checkpoint["state_dict"]), optimizers, meta)


def launched_cases(mode: str, files: dict[str, str], out: Path) -> None:
    """Every case of one launched mode, in these processes: ``ddp`` (1 x 2, built eagerly) or ``fsdp`` (2 x 1,
    built in configure_model)."""
    stages, replicas, build = (2, 1, "eager") if mode == "ddp" else (1, 2, "configure_model")
    options: dict[str, Any] = {"stages": stages, "microbatches": 2, "timeout": 60}
    if mode == "fsdp":
        options["data_parallel"] = "fsdp"

    def run(case: str, steps: int, **kwargs: Any) -> None:
        weights, save = kwargs.pop("weights", None), kwargs.pop("save", None)
        strategy = PipeStrategy(**options, weights=weights)
        result: dict[str, Any] = {}
        began = time.monotonic()
        try:
            t, _, losses = fit(strategy, build, steps, replicas=replicas, devices=2, **kwargs)
            result = {"losses": losses.values, "said": t.said}  # type: ignore[attr-defined]
            if save is not None:  # a sharded folder: every process writes its own part
                t.save_checkpoint(save)
        except Exception as error:  # noqa: BLE001 - what each process raised is the result
            result = {"error": f"{type(error).__name__}: {error}"}
        result["seconds"] = time.monotonic() - began
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out / f"{case}-rank{rank}.json").write_text(json.dumps(result))

    run("ref", STEPS, save=str(out / "ref"))
    for fmt in ("file", "folder"):
        run(f"resume-{fmt}", STEPS, ckpt=files[f"{fmt}-good"], save=str(out / f"resume-{fmt}"))
    run("resume-weights", 1, weights=files["weights-good"])
    for fmt in ("file", "folder", "weights"):
        for kind in ("renamed", "extra"):
            if fmt == "weights":
                run(f"{fmt}-{kind}", 1, weights=files[f"{fmt}-{kind}"])
            else:
                run(f"{fmt}-{kind}", STEPS, ckpt=files[f"{fmt}-{kind}"])
    _, net, _ = fit(PipeStrategy(**options), build, PART, replicas=replicas, devices=2)
    run("again", PART, net=net)  # a later fit of the same module (FSDP: its stages as the first fit sharded them)
    run("lenient-file", PART + 1, ckpt=files["file-renamed"], strict=False)
    run("lenient-weights", 1, weights=files["weights-extra"], strict=False)
    if mode == "fsdp":  # no seed_everything: each process's torch seed differs; the run's seed is rank 0's
        os.environ.pop("PL_GLOBAL_SEED", None)
        torch.manual_seed(100 + (dist.get_rank() if dist.is_initialized() else 0))
        run("unseeded", 1, seed=None, save=str(out / "unseeded"))


def main() -> None:
    """Each ``--mode`` with its ``--files`` and ``--out``, one mode after the other in these processes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "fsdp"], action="append", required=True)
    parser.add_argument("--files", action="append", required=True, help="a JSON file: the paths (write_files)")
    parser.add_argument("--out", action="append", required=True)
    args = parser.parse_args()
    for mode, files, out in zip(args.mode, args.files, args.out, strict=True):
        launched_cases(mode, json.loads(Path(files).read_text()), Path(out))


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    main()
