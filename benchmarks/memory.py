"""Peak memory of every process: a plain Trainer, Lightning DDP and PipeStrategy (1 x 4 and 2 x 2), side by side.

    python benchmarks/memory.py                      # the 512 MiB model of docs/big-models.md (32 x Linear(2048, 2048))
    python benchmarks/memory.py --width 1024 --depth 16 --json out/memory.json

Each configuration is a run of ``examples/big_model.py`` (Lightning's launcher starts its processes), resumed
from the plain Trainer's checkpoint and trained 2 more steps; each process reports its peak resident memory
(``VmHWM``; on CUDA ``torch.cuda.max_memory_allocated``). The table gives it minus an empty process's (torch,
Lightning and lightning_pipe imported), in MiB and as a share of the model's training state (parameters,
gradients and SGD momentum), beside the ideal: the training state / (replicas x stages). The losses column
checks that every run trains as the plain one does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "big_model.py"

CONFIGS: list[tuple[str, list[str], int]] = [  # name, arguments, processes
    ("plain Trainer", ["--plain"], 1),
    ("Lightning DDP, 2 processes", ["--ddp", "--devices", "2"], 2),
    ("PipeStrategy 1 x 4, built in __init__", ["--build", "eager"], 4),
    ("PipeStrategy 1 x 4, init_module(empty_init=True)", ["--build", "meta"], 4),
    ("PipeStrategy 1 x 4, configure_model", ["--build", "configure_model"], 4),
    ("PipeStrategy 2 x 2, DDP per stage", ["--build", "meta", "--stages", "2", "--batch", "8"], 4),
    ("PipeStrategy 2 x 2, FSDP per stage", ["--build", "meta", "--stages", "2", "--batch", "8",
                                            "--data-parallel", "fsdp"], 4),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: list[str], timeout: float) -> None:
    """``python examples/big_model.py ...`` in a session of its own, ended with all its processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args], env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out[-4000:]}")


def reports(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--accelerator", default="cpu", help="gpu: one process per GPU, CUDA memory reported too")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "memory.json"))
    args = parser.parse_args()
    model = ["--width", str(args.width), "--depth", str(args.depth), "--accelerator", args.accelerator]
    state = 3 * args.depth * (args.width * args.width + args.width) * 4 / 2**20  # params + grads + momentum, MiB
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        run(["--empty", "--report", str(out / "empty")], args.timeout)
        empty = reports(out / "empty")[0]["peak_mib"]
        checkpoint = out / "plain.ckpt"
        run([*model, "--plain", "--epochs", "1", "--save", str(checkpoint)], args.timeout)
        for name, config, processes in CONFIGS:
            folder = out / f"run{len(rows)}"
            run([*model, *config, "--ckpt-path", str(checkpoint), "--report", str(folder)], args.timeout)
            got = reports(folder)
            piped = not ({"--plain", "--ddp"} & set(config))
            rows.append({
                "config": name,
                "peak_mib": [round(r["peak_mib"] - empty) for r in got],
                "share": [round((r["peak_mib"] - empty) / state, 3) for r in got],
                "ideal_mib": round(state / processes if piped else state),  # the training state / (R x S)
                "cuda_peak_mib": [r.get("cuda_peak_mib") for r in got],
                "losses": [r["losses"] for r in got if r["losses"]],
            })  # fmt: skip
    print(f"training state {state:.0f} MiB; an empty process {empty:.0f} MiB (subtracted)\n")
    cuda = any(v is not None for row in rows for v in row["cuda_peak_mib"])
    print(
        "| configuration | peak per process, MiB | share of the training state | ideal, MiB |"
        + (" CUDA, MiB |" if cuda else "")
    )
    print("| --- | --- | --- | --- |" + (" --- |" if cuda else ""))
    for row in rows:
        peaks = " / ".join(map(str, row["peak_mib"]))
        line = f"| {row['config']} | {peaks} | {max(row['share']):.2f} | {row['ideal_mib']} |"
        if cuda:
            line += " " + " / ".join(f"{v:.0f}" for v in row["cuda_peak_mib"] if v is not None) + " |"
        print(line)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"state_mib": state, "empty_mib": empty, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
