"""Peak memory of rpc mode's processes: ``PipeStrategy(stages=4, transport="rpc")``, the model built on meta.

    python benchmarks/memory_rpc.py                  # the 512 MiB model of the README (32 x Linear(2048, 2048))
    python benchmarks/memory_rpc.py --width 1024 --depth 16 --json out/memory_rpc.json

The row `benchmarks/memory.py` lacks: one Lightning process (the script's) and three worker processes, the model
built under ``trainer.init_module(empty_init=True)``, resumed from the plain Trainer's checkpoint and trained
2 more steps, with a checkpoint written during the fit (a sharded folder, every worker its stage) and one after
it (one file, made of the folder the workers left a tensor at a time). The script's process holds the last
stage (1/4 of the model) and the tensors outside the pipeline; it should never hold more: no gathered model, no
optimizer state assembled on resume, none gathered to save. Its peak is ``VmHWM`` minus an empty process's (torch,
Lightning and lightning_pipe imported), as a share of the training state (parameters, gradients, SGD momentum);
the workers' ``VmHWM`` is given whole (they do not import Lightning: an empty process's is not theirs to
subtract). The losses are checked against the plain run's.
``rows()`` gives the table's row for `benchmarks/memory.py`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]

from memory import reports, run  # noqa: E402  (benchmarks/memory.py: a run of examples/big_model.py)

NAME = "PipeStrategy 1 x 4 rpc, init_module(empty_init=True)"


def vm_hwm(pid: int) -> float:
    """The peak resident memory of process ``pid`` (Linux), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            children = (task / "children").read_text().split()
            found += [int(c) for c in children]
            todo += [int(c) for c in children]
    return found


def child(args: argparse.Namespace) -> None:
    """The rpc run itself (``--child``): one Lightning process, its workers started by the strategy."""
    import os

    import lightning as L
    import torch
    from big_model import Big, Record
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_pipe import PipeStrategy

    class Workers(L.Callback):
        """The workers' peaks, read before they stop (they are this process's children)."""

        def __init__(self) -> None:
            self.peaks: list[float] = []

        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            self.peaks = [vm_hwm(pid) for pid in descendants(os.getpid())]

    L.seed_everything(0, verbose=False)
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(args.batch, args.width), torch.randn(args.batch, args.width))
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, 1, 0, seed=0))
    record, workers = Record(str(Path(args.out) / "during.ckpt"), 1), Workers()
    strategy = PipeStrategy(stages=4, microbatches=4, transport="rpc", timeout=600)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=3, callbacks=[record, workers],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=args.out)  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = Big(args.width, args.depth, "meta")
    trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    trainer.strategy.save_distributed_checkpoint = False  # type: ignore[attr-defined]
    trainer.save_checkpoint(Path(args.out) / "after.ckpt")  # one file, from the folder the workers left
    report = {"losses": record.losses, "peak_mib": vm_hwm(os.getpid()), "worker_peaks_mib": workers.peaks}
    (Path(args.out) / "rpc.json").write_text(json.dumps(report))


def rows(width: int, depth: int, timeout: float, tmp: Path) -> dict[str, Any]:
    """The rpc row: the script's peak and the workers', each as a share of the training state."""
    state = 3 * depth * (width * width + width) * 4 / 2**20  # params + grads + momentum, MiB
    model = ["--width", str(width), "--depth", str(depth)]
    run(["--empty", "--report", str(tmp / "empty")], timeout)
    empty = reports(tmp / "empty")[0]["peak_mib"]
    checkpoint = tmp / "plain.ckpt"
    run([*model, "--plain", "--epochs", "1", "--save", str(checkpoint)], timeout)
    run([*model, "--plain", "--ckpt-path", str(checkpoint), "--report", str(tmp / "plain")], timeout)
    plain = reports(tmp / "plain")[0]["losses"]
    command = [sys.executable, __file__, "--child", "--width", str(width), "--depth", str(depth),
               "--ckpt-path", str(checkpoint), "--out", str(tmp)]  # fmt: skip
    subprocess.run(command, check=True, timeout=timeout, cwd=ROOT)
    got = json.loads((tmp / "rpc.json").read_text())
    script = got["peak_mib"] - empty
    return {
        "config": NAME, "state_mib": round(state), "empty_mib": round(empty),
        "peak_mib": [round(script)], "share": [round(script / state, 3)],
        "worker_peaks_mib": [round(p) for p in got["worker_peaks_mib"]],
        "ideal_mib": round(state / 4), "losses": [got["losses"]], "plain_losses": plain,
        "losses_equal": len(got["losses"]) == len(plain)
        and all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(got["losses"], plain, strict=True)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "memory_rpc.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        row = rows(args.width, args.depth, args.timeout, Path(tmp))
    print(f"training state {row['state_mib']} MiB; an empty process {row['empty_mib']} MiB (subtracted)\n")
    print("| configuration | the script's peak, MiB | its share of the training state | ideal, MiB | workers' VmHWM |")
    print("| --- | --- | --- | --- | --- |")
    workers = " / ".join(map(str, row["worker_peaks_mib"]))
    print(f"| {row['config']} | {row['peak_mib'][0]} | {row['share'][0]:.2f} | {row['ideal_mib']} | {workers} |")
    print(f"\nlosses {row['losses'][0]} (plain {row['plain_losses']}): equal {row['losses_equal']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
