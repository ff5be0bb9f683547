"""A fault-tolerant run on one machine: a torchft Lighthouse in this process and one torchrun per replica group of
``tests/ft_train.py`` (2 processes each), optionally one process of a group SIGKILLed after a step; always ended.

Used by tests/test_fault_tolerance.py and benchmarks/fault_tolerance.py. Every torchrun runs in a session of its own
and is SIGKILLed with its whole session when the run ends or times out; the Lighthouse is shut down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from launching import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ft_train.py"
#: the Lighthouse's timings: a group that stops heartbeating is out after 1 s; a quorum waits up to 5 s for a group
#: that heartbeats but has not asked yet (longer than a survivor's slowed step, so a restarted group joins them)
HEARTBEAT_MS, JOIN_MS, TICK_MS = 1000, 5000, 50


@dataclass
class FtRun:
    """What a run left in ``out``: each group's steps, each process's start, each process's final state."""

    out: Path
    returncodes: list[int | None]
    output: str
    killed_at: float | None = None  # time.time() of the SIGKILL
    steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    procs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)

    def final(self, group: int, rank: int) -> dict[str, Any]:
        import torch

        return torch.load(self.out / f"final-g{group}-r{rank}.pt", weights_only=False)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _env(lighthouse: str, group: int, groups: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PL_", "SLURM_"))}
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", RUST_LOG="warn", TORCHFT_LIGHTHOUSE=lighthouse,
               REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS=str(groups))  # fmt: skip
    return env


def _torchrun(args: list[str], env: dict[str, str], log: Path, restarts: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
        "--max-restarts", str(restarts), "--monitor-interval", "0.1", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(SCRIPT), *args,
    ]  # fmt: skip
    with log.open("w") as sink:  # a file, not a pipe: nothing a process leaves behind can hold it open
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def _end(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_groups(
    out: Path,
    args: list[str],
    groups: int = 2,
    min_replicas: int = 1,
    kill: tuple[int, int, int] | None = None,
    timeout: float = 300.0,
) -> FtRun:
    """Start the Lighthouse (``min_replicas``) and ``groups`` torchruns of `SCRIPT` with ``args`` (``--out`` added),
    each allowed one restart; ``kill=(group, rank, step)``: SIGKILL that process once its group's coordinator logged
    that step. Wait for every torchrun (``timeout`` in all), then end whatever is left."""
    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse's log: its warnings only
    from torchft._torchft import LighthouseServer

    out.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=JOIN_MS,
                                  quorum_tick_ms=TICK_MS, heartbeat_timeout_ms=HEARTBEAT_MS)  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    killed_at = None
    try:
        for group in range(groups):
            env = _env(lighthouse.address(), group, groups)
            procs.append(_torchrun([*args, "--out", str(out)], env, out / f"torchrun-g{group}.log", restarts=1))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if kill is not None and killed_at is None:
                killed_at = _kill_when_due(out, *kill)
            time.sleep(0.02)
    finally:
        for proc in procs:
            _end(proc)
        lighthouse.shutdown()
    output = "\n".join(f"--- group {g} ---\n" + (out / f"torchrun-g{g}.log").read_text(errors="replace")
                       for g in range(groups))  # fmt: skip
    return FtRun(
        out,
        [p.returncode for p in procs],
        output,
        killed_at,
        {g: read_jsonl(out / f"steps-g{g}.jsonl") for g in range(groups)},
        read_jsonl(out / "procs.jsonl"),
    )


def _kill_when_due(out: Path, group: int, rank: int, step: int) -> float | None:
    """SIGKILL ``rank`` of ``group`` (its first attempt) once the group's coordinator logged ``step``; its time."""
    logged = read_jsonl(out / f"steps-g{group}.jsonl")
    if not logged or logged[-1]["step"] < step:
        return None
    pid = next(p["pid"] for p in read_jsonl(out / "procs.jsonl") if (p["group"], p["rank"]) == (group, rank))
    os.kill(pid, signal.SIGKILL)
    return time.time()


def run_ddp(out: Path, args: list[str], timeout: float = 240.0) -> tuple[int | None, str]:
    """The reference: Lightning's DDP with 2 processes (``--ddp``), one torchrun; its return code and output."""
    out.mkdir(parents=True, exist_ok=True)
    env = _env("unused", 0, 2)
    proc = _torchrun([*args, "--ddp", "--out", str(out)], env, out / "torchrun-ddp.log", restarts=0)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _end(proc)
    return proc.returncode, (out / "torchrun-ddp.log").read_text(errors="replace")
