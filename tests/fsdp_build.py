"""What the FSDP build tests start (Lightning's launcher, 4 processes = 2 replicas x 2 stages, FSDP per stage).

One launch (of its own, or among the runs of `big_model_runs.py`), three fits of ``examples/big_model.py``'s
model built on meta, each process writing what it holds after each (``<out>/<case>-rank<g>.json``):

- ``seeded``: no checkpoint, no step: each stage initialised from the run's seed; saved as a sharded folder
  (``<out>/seeded``), which rank 0 also makes one file (``<out>/seeded.ckpt``);
- ``folder``: resumed from ``<out>/seeded`` (every tensor read as a shard), 2 steps, saved (``<out>/folder``);
- ``file``: resumed from ``<out>/seeded.ckpt`` (each tensor read whole, one at a time, cut to its shard), 2 steps.

    python tests/fsdp_build.py --out /tmp/x
    # the tests: among the runs of tests/big_model_runs.py (tests/big_launch.py)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import big_model  # noqa: E402

from lightning_pipe import PipeStrategy  # noqa: E402
from lightning_pipe.checkpoint.consolidate import consolidate  # noqa: E402
from lightning_pipe.engine.fsdp_internals import check  # noqa: E402

WIDTH, DEPTH, ROWS = 100, 6, 16  # 6 x Linear(100, 100): 3 blocks per stage; a shard ends mid-page


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g))


def fit(epochs: int, ckpt_path: str | None) -> tuple[L.Trainer, Any, list[float]]:
    L.seed_everything(0, verbose=False)
    record = big_model.Record(None, 0)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_epochs=epochs, callbacks=[record], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=PipeStrategy(stages=2, microbatches=2, data_parallel="fsdp", timeout=60),
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = big_model.Big(WIDTH, DEPTH, "meta", "adam")
    trainer.fit(model, DataLoader(data(), batch_size=ROWS // 2), ckpt_path=ckpt_path)
    return trainer, model, record.losses


def holds(trainer: L.Trainer, model: nn.Module, losses: list[float]) -> dict[str, Any]:
    """What this process holds after its fit: its stage's parameters (each a shard?), what it made whole on the
    way, and any tensor of the LightningModule outside its stage that has values."""
    worker = trainer.strategy.stage.worker
    stage = [(name, p) for shard in worker.shards.values() for name, p in shard.module.named_parameters()]
    mine = {id(p) for _, p in stage}
    params = {}
    for name, p in stage:
        local = p.to_local() if hasattr(p, "to_local") else p
        params[name] = {"dtensor": hasattr(p, "to_local"), "shape": list(p.shape), "local": list(local.shape),
                        "bytes": local.numel() * local.element_size()}  # fmt: skip
    others = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in mine and not t.is_meta]
    # the private FSDP attributes the step's reduce reads are where this torch keeps them (raises if not)
    groups = sum(check(root) for root in worker.replicas.modules.values())
    return {
        "losses": losses,
        "params": params,
        "others_real": others,
        "wholes_peak": worker.materialized.wholes.peak,
        "wholes_count": worker.materialized.wholes.count,
        "loaded": len(worker.materialized.loaded),
        "fsdp_groups_checked": groups,
    }


def main(argv: list[str] | None = None) -> None:
    """The three builds, as the command line (or ``argv``) says."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    trainer, model, losses = fit(0, None)
    rank = trainer.global_rank
    report = holds(trainer, model, losses)
    trainer.save_checkpoint(out / "seeded")  # every process: its own shard
    if rank == 0:
        consolidate(out / "seeded", out / "seeded.ckpt")
    dist.barrier()  # the one file is there before any process opens it
    (out / f"seeded-rank{rank}.json").write_text(json.dumps(report))
    for case, path in (("folder", out / "seeded"), ("file", out / "seeded.ckpt")):
        trainer, model, losses = fit(2, str(path))
        (out / f"{case}-rank{rank}.json").write_text(json.dumps(holds(trainer, model, losses)))
        if case == "folder":
            trainer.save_checkpoint(out / "folder")


if __name__ == "__main__":
    faulthandler.enable()
    main()
