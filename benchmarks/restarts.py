"""Kill-and-restart cycles of a 2 x 2 launched run under ``torchrun --max-restarts 1``: does the restarted attempt
come up, how fast, and does it end equal to the uninterrupted run?

Each cycle: ``torchrun --nproc-per-node 4 --max-restarts 1 --master-addr 127.0.0.1 --master-port <free>
tests/restart_train.py --modes ddp --attempts cut --kill rank:3``: ``PipeStrategy(stages=2)`` over 4 processes (2
replicas x 2 stages), dropout in the stages, SGD with momentum, a step-wise LR schedule, a ``StatefulDataLoader``,
``ModelCheckpoint(every_n_train_steps=3, save_last=True)``. After step 5 global rank 0 SIGKILLs global rank 3 (a
serving rank of replica 1); torchrun ends the others and starts the script again, whose second attempt runs
``fit(ckpt_path="last")`` to step 10. A cycle "came up" when that attempt trained and torchrun exited with 0; "seconds
back" is from the kill to the resumed attempt's first step; "equal" compares every process's trained tensors with an
uninterrupted run's (``--attempts ref``, run once first), 1e-6 at most. Every run has a timeout (``--timeout``),
after which its whole process group is killed (a hang counts as not coming up).

    python benchmarks/restarts.py --cycles 20            # writes benchmarks/results/restarts.json
    python benchmarks/restarts.py --cycles 5 --root /path/to/an/older/tree --json /tmp/before.json
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
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "restart_train.py"
TOLERANCE = 1e-6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    script: Path, args: list[str], root: Path, out: Path, timeout: float, restarts: int
) -> tuple[int | None, str, float]:
    """One torchrun of the script in a session of its own; its return code (None: killed after ``timeout``), its
    output, its seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PL_", "SLURM_"))}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", RESTART_PIDS=str(out), PYTHONFAULTHANDLER="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--nnodes", "1",
        "--max-restarts", str(restarts), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(script), "--modes", "ddp", "--out", str(out), *args,
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    log = out / "torchrun.log"  # a file, not a pipe: a worker torchrun leaves behind would hold a pipe open
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=env, cwd=root, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            end_session(proc.pid)
            end_workers(out)
            proc.wait(30)
    return code, log.read_text(errors="replace"), time.monotonic() - began


def end_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # torchrun and whatever of its session is left
    except (ProcessLookupError, PermissionError):
        pass


def end_workers(out: Path) -> None:
    """The workers of this run still alive (their pids in ``rank*.pid``; torchrun may leave one behind when it gives
    up, in a session of its own)."""
    for path in out.glob("rank*.pid"):
        pid = int(path.read_text())
        try:
            if SCRIPT.name in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass


def tensors(out: Path, attempt: str) -> dict[int, dict[str, Any]] | None:
    """Every process's trained tensors of ``attempt``; None if a process wrote none or failed."""
    found = {}
    for rank in range(4):
        path = out / f"ddp-{attempt}-rank{rank}.json"
        if not path.exists():
            return None
        result = json.loads(path.read_text())
        if "error" in result:
            return None
        found[rank] = result["tensors"]
    return found


def largest_difference(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> float:
    import torch

    worst = 0.0
    for rank, held in a.items():
        if held.keys() != b[rank].keys():
            return float("inf")
        for key, value in held.items():
            worst = max(worst, float((torch.tensor(value) - torch.tensor(b[rank][key])).abs().max()))
    return worst


def cause(output: str) -> str:
    """What the failed attempt's log names: a failed connect, a timeout, or its last error line."""
    for marker in ("connectFullMesh failed", "Connection refused", "timed out", "Timeout"):
        if marker in output:
            return marker
    errors = [line for line in output.splitlines() if "Error" in line]
    return errors[-1][:120] if errors else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300, help="seconds at most for one torchrun")
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree whose lightning_pipe the ranks import")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "restarts.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="restarts-"))
    script = work / SCRIPT.name  # a copy outside this tree: the ranks import the lightning_pipe of --root
    script.write_text(SCRIPT.read_text())
    code, output, seconds = torchrun(script, ["--attempts", "ref"], args.root, work / "ref", args.timeout, restarts=0)
    reference = tensors(work / "ref", "ref")
    if code != 0 or reference is None:
        sys.exit(f"the uninterrupted run failed (exit {code}):\n{output[-3000:]}")
    print(f"uninterrupted run: {seconds:.1f} s")
    print(f"{'cycle':>5}  {'came up':>7}  {'s back':>7}  {'equal':>5}  {'max diff':>9}  {'run s':>6}  cause")
    rows = []
    for cycle in range(1, args.cycles + 1):
        out = work / f"cycle{cycle}"
        killed = ["--attempts", "cut", "--kill", "rank:3"]
        code, output, seconds = torchrun(script, killed, args.root, out, args.timeout, 1)
        resumed = tensors(out, "resume")
        came_up = code == 0 and resumed is not None
        back = None
        if (out / "killed.txt").exists() and (out / "first-step-rank0.txt").exists():
            back = float((out / "first-step-rank0.txt").read_text()) - float((out / "killed.txt").read_text())
        difference = largest_difference(resumed, reference) if resumed is not None else None
        row = {
            "cycle": cycle, "came_up": came_up, "seconds_back": back, "equal": difference is not None
            and difference <= TOLERANCE, "max_difference": difference, "exit_code": code, "seconds": seconds,
            "cause": "" if came_up else ("hang (killed after the timeout) " if code is None else "") + cause(output),
        }  # fmt: skip
        rows.append(row)
        print(f"{cycle:>5}  {'yes' if came_up else 'no':>7}  {back if back is not None else float('nan'):>7.1f}  "
              f"{'yes' if row['equal'] else 'no':>5}  {difference if difference is not None else float('nan'):>9.2g}  "
              f"{seconds:>6.1f}  {row['cause']}", flush=True)  # fmt: skip
        if not came_up:
            (work / f"cycle{cycle}.log").write_text(output)
    up = [r for r in rows if r["came_up"]]
    backs = sorted(r["seconds_back"] for r in up if r["seconds_back"] is not None)
    summary = {
        "cycles": len(rows), "came_up": len(up), "equal": sum(r["equal"] for r in rows),
        "seconds_back_median": backs[len(backs) // 2] if backs else None,
        "seconds_back_max": backs[-1] if backs else None, "root": str(args.root), "logs": str(work),
    }  # fmt: skip
    print(f"came up {summary['came_up']} / {summary['cycles']}, equal {summary['equal']} / {summary['cycles']}, "
          f"seconds back: median {summary['seconds_back_median']}, max {summary['seconds_back_max']}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"summary": summary, "cycles": rows}, indent=1))


if __name__ == "__main__":
    main()
