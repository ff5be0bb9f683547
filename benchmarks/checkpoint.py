"""How long the training loop stands still per checkpoint, synchronous and asynchronous, and what checkpoints cost.

    python benchmarks/checkpoint.py      # the 512 MiB model (32 x Linear(2048, 2048)), 1 x 4 and 2 x 2 FSDP
    python benchmarks/checkpoint.py --size 16 --steps 9 --every 3 --json out/checkpoint.json

Each row is one run of 4 processes (Lightning's launcher starts them) training ``--steps`` steps of the model of
``examples/big_model.py`` (SGD with momentum), with ModelCheckpoint writing ``last.ckpt`` (a sharded folder) every
``--every`` steps: ``sync`` (the default), ``async`` (``PipeStrategy(async_checkpoint=True)``) or ``none`` (no
checkpoint). Global rank 0 times every step (from one ``on_train_batch_start`` to the next; the first step, which
builds the pipeline, is left out). The columns: the median step without a checkpoint; the stall per checkpoint (the
mean step with a checkpoint minus that median: what the loop stood still); the mean seconds global rank 0 spent in
ModelCheckpoint's ``trainer.save_checkpoint`` (a direct reading of the same, less noisy on a loaded machine; it
includes waiting for the pipeline's other processes to finish the step, which a step without a save waits for
later); the run's throughput (rows a second, from the second step's start to ``fit``'s return, which waits for the
last write) and its share of the ``none`` run's. The JSON holds every timed step too (``durations_s``).
The goal (issue 38): the async stall at most a quarter of the synchronous one. ``--parts`` also times each part
of every save on every process (`save_parts`) and prints a table per row; ``--modes`` runs some of the modes only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"1x4": {"stages": 4}, "2x2-fsdp": {"stages": 2, "data_parallel": "fsdp"}}
MODES = ["none", "sync", "async"]


def shape(size_mib: int) -> tuple[int, int]:
    """(width, depth) of a model of about ``size_mib`` MiB of fp32 parameters: Linear(2048, 2048) layers (16 MiB
    each), or Linear(512, 512) ones (1 MiB each) below 64 MiB."""
    width = 2048 if size_mib >= 64 else 512
    return width, max(4, round(size_mib * 2**20 / (width * width * 4)))


def worker(args: argparse.Namespace) -> None:
    """One row, in each of the run's processes (Lightning's launcher re-runs this script for ranks 1-3)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT / "examples"))
    from big_model import Big

    from lightning_pipe import PipeStrategy

    class Steps(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *_: Any) -> None:
            self.starts.append(time.perf_counter())

    if args.parts_to:
        from save_parts import install  # the script's folder is on the path

        install(args.parts_to)
    width, depth = shape(args.size)
    layout = LAYOUTS[args.layout]
    replicas = 4 // layout["stages"]
    strategy = PipeStrategy(microbatches=4, async_checkpoint=args.mode == "async", timeout=600, **layout)
    steps = Steps()
    callbacks: list[Any] = [steps]
    if args.mode != "none":
        every = ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_top_k=0, save_last=True)
        callbacks.append(every)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_steps=args.steps, callbacks=callbacks, logger=False,
        enable_checkpointing=args.mode != "none", enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = Big(width, depth, build="meta")
    rows = args.batch * replicas
    data = TensorDataset(torch.randn(rows * args.steps, width), torch.randn(rows * args.steps, width))
    saving, saves = trainer.save_checkpoint, []

    def timed_save(*given: Any, **named: Any) -> None:  # ModelCheckpoint's save, timed: the loop waits for it
        start = time.perf_counter()
        saving(*given, **named)
        saves.append(time.perf_counter() - start)

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    ended = time.perf_counter()
    if trainer.global_rank == 0:
        starts = [*steps.starts, ended]
        durations = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        saved = [(i + 1) % args.every == 0 for i in range(len(durations))]  # a save ends the step it follows
        report = {"durations": durations, "saved": saved, "rows_per_step": rows, "seconds": ended - starts[1],
                  "saves": saves}  # fmt: skip
        Path(args.report).write_text(json.dumps(report))


def row(layout: str, mode: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Run one row (a launch of 4 processes) and summarise global rank 0's timings."""
    report = folder / f"{layout}-{mode}.json"
    command = [sys.executable, __file__, "--worker", "--layout", layout, "--mode", mode, "--size", str(args.size),
               "--steps", str(args.steps), "--every", str(args.every), "--batch", str(args.batch),
               "--dir", str(folder / f"{layout}-{mode}"), "--report", str(report)]  # fmt: skip
    parts = folder / f"{layout}-{mode}-parts"
    if args.parts and mode != "none":
        command += ["--parts-to", str(parts)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(command, env=env, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
    found = json.loads(report.read_text())
    result = {"layout": layout, "mode": mode, **summary(mode, found)}
    if args.parts and mode != "none":
        from save_parts import show, table

        result["parts"] = table(parts)
        show(result["parts"], f"{layout} {mode}")
    return result


def summary(mode: str, found: dict[str, Any]) -> dict[str, Any]:
    """One row's numbers from global rank 0's report (``found``: its step durations, which steps saved, ...)."""
    durations, saved = found["durations"][1:], found["saved"][1:]  # the first step builds the pipeline
    after = [False, *saved[:-1]]  # the step right after a save
    saving = mode != "none"
    plain = [d for d, s in zip(durations, saved, strict=True) if not s or not saving]
    with_save = [d for d, s in zip(durations, saved, strict=True) if s and saving]
    median = statistics.median(plain)
    # net: a save step and the one after it against two plain steps (neither saving nor right after a save): the
    # save step also waits for the pipeline's other processes to end its step, which a plain step leaves to the next
    apart = [d for d, s, a in zip(durations, saved, after, strict=True) if not (s or a) or not saving]
    pairs = [d + n for d, n, s in zip(durations, durations[1:], saved, strict=False) if s and saving]
    steps = len(durations)
    return {
        "median_step_s": median, "stall_s": statistics.mean(with_save) - median if with_save else 0.0,
        "net_stall_s": statistics.mean(pairs) - 2 * statistics.median(apart) if pairs else 0.0,
        "save_s": statistics.mean(found["saves"]) if found.get("saves") else 0.0,
        "rows_per_s": found["rows_per_step"] * steps / found["seconds"], "checkpoints": len(with_save),
        "durations_s": durations,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="MiB of parameters (512: 32 x Linear(2048, 2048))")
    parser.add_argument("--steps", type=int, default=13, help="training steps per run (the first is not timed)")
    parser.add_argument("--every", type=int, default=4, help="a checkpoint every K steps")
    parser.add_argument("--batch", type=int, default=16, help="rows per replica and step")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES, help="the modes to run (none is the base)")
    parser.add_argument("--parts", action="store_true", help="time each part of every save on every process")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run at most")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="1x4", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parts-to", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    width, depth = shape(args.size)
    print(f"model: {depth} x Linear({width}, {width}), {depth * width * (width + 1) * 4 / 2**20:.0f} MiB; "
          f"{args.steps} steps, a checkpoint every {args.every}")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="lightning_pipe-checkpoint-bench-") as tmp:
        for layout in args.layouts:
            for mode in args.modes:
                rows.append(row(layout, mode, args, Path(tmp)))
    print(f"{'layout':<10} {'mode':<6} {'step s':>8} {'stall s':>8} {'net s':>8} {'save s':>8} {'rows/s':>8} "
          f"{'of none':>8}")  # fmt: skip
    for r in rows:
        none = next((x for x in rows if x["layout"] == r["layout"] and x["mode"] == "none"), None)
        r["throughput_of_none"] = r["rows_per_s"] / none["rows_per_s"] if none else float("nan")
        print(f"{r['layout']:<10} {r['mode']:<6} {r['median_step_s']:>8.3f} {r['stall_s']:>8.3f} "
              f"{r['net_stall_s']:>8.3f} {r['save_s']:>8.3f} {r['rows_per_s']:>8.1f} "
              f"{r['throughput_of_none']:>8.2f}")  # fmt: skip
    for layout in args.layouts if {"sync", "async"} <= set(args.modes) else ():
        sync, asyn = (next(x for x in rows if x["layout"] == layout and x["mode"] == m) for m in ("sync", "async"))
        if sync["stall_s"] > 0:
            ratios = {k: asyn[k] / sync[k] if sync[k] else float("nan") for k in ("stall_s", "net_stall_s", "save_s")}
            print(f"{layout}: async / sync: stall {ratios['stall_s']:.2f} (goal <= 0.25), net stall "
                  f"{ratios['net_stall_s']:.2f}, seconds in the save {ratios['save_s']:.2f}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
