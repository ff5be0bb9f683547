"""The benchmark's plumbing: its configuration, worker processes driven over a `Connection`, /proc readings.

A contender is one or more worker processes that answer commands (``start``, ``check``, ``run``,
``profile``, ``stop``) over a pipe; some contenders also have processes that answer nothing (the
serving ranks of launched mode), which are measured and ended all the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import WORKLOADS
from lightning_pipe.comm.rpc.world import environment  # a spawned child inherits the environment at start

REPLY_TIMEOUT = 900.0  # seconds any worker may take to answer one command
# untimed steps after a contender (re)starts its stages at the beginning of a round: the first step of a new
# pipeline measures its stages and checkpoint="auto" decides before the second (a few control calls)
ROUND_WARMUP = 2


@dataclass
class Config:
    workload: str
    stages: int
    microbatches: int
    schedule: str
    threads: int  # intra-op threads per stage
    unsplit_threads: int
    lr: float
    balance: list[int]
    port: int = 0
    trace_dir: str | None = None
    compress: str | None = None  # the rpc contenders' message compression (``compress=``)
    backend: str | None = None  # lightning_pipe's stage backend (``backend=``: "eager", "inductor"); None: default
    virtual_stages: int = 1  # stages per process (``stages`` counts the model's pieces)

    @property
    def batch(self) -> int:
        return WORKLOADS[self.workload].batch

    @property
    def ranks(self) -> int:
        """Processes of one pipeline: the stages over the stages each holds."""
        return self.stages // self.virtual_stages


def serve(conn: Connection, factory: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """A worker process: build the runner, then answer commands until ``stop``."""
    try:
        runner = factory(*args)
        conn.send(("ready", os.getpid()))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                conn.send(("ok", runner.stop()))
                return
            method = getattr(runner, command[0])
            conn.send(("ok", method(*command[1:])))
    except Exception:
        conn.send(("error", traceback.format_exc()))


@dataclass
class Contender:
    """One library configuration: worker processes driven over pipes, and processes that answer nothing."""

    name: str
    transport: str = "local"
    workers: list[tuple[Any, Connection]] = field(default_factory=list)
    silent: list[Any] = field(default_factory=list)  # e.g. launched mode's serving rank: it only runs ``fit``
    rounds: list[list[float]] = field(default_factory=list)  # step seconds, one list per round
    cpu: list[tuple[float, float]] = field(default_factory=list)  # per round: (user, system) CPU seconds per step
    info: list[dict[str, float]] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)

    def ask(self, *command: Any) -> list[Any]:
        for _, conn in self.workers:
            conn.send(command)
        return [reply(conn, self.name, command[0]) for _, conn in self.workers]

    def processes(self) -> list[Any]:
        """Every process of the contender, the driven ones first (the coordinator first)."""
        return [process for process, _ in self.workers] + self.silent

    def silent_cpu(self) -> tuple[float, float]:
        """CPU seconds (user, system) used so far by the silent processes, which report nothing themselves."""
        readings = [cpu_seconds(process.pid) for process in self.silent]
        return sum(u for u, _ in readings), sum(s for _, s in readings)

    def end(self, timeout: float = 30.0) -> list[str]:
        """Join every process (killing those still running after ``timeout``); how each one that failed ended."""
        failures = []
        for _, conn in self.workers:
            conn.close()  # a worker still waiting for a command (after an error elsewhere) gets EOFError and ends
        for process in self.processes():
            process.join(timeout)
            if process.is_alive():
                process.terminate()
                process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
            if process.exitcode:
                failures.append(f"{self.name}: process {process.pid} exited with {process.exitcode}")
        return failures


def end_all(contenders: list[Contender]) -> None:
    """End every contender's processes (`Contender.end`), saying how each one that failed ended."""
    for contender in contenders:
        for failure in contender.end():
            print(f"warning: {failure}", file=sys.stderr)


def reply(conn: Connection, name: str, what: str) -> Any:
    if not conn.poll(REPLY_TIMEOUT):
        raise TimeoutError(f"{name} did not answer {what!r} within {REPLY_TIMEOUT:.0f} s")
    status, value = conn.recv()
    if status == "error":
        raise RuntimeError(f"{name} failed during {what!r}:\n{value}")
    return value


def spawn(
    ctx: Any,
    contender: Contender,
    target: Callable[..., None],
    args: tuple[Any, ...],
    env: dict[str, str] | None = None,
) -> None:
    """Start ``target(conn, *args)`` as a driven worker of ``contender``, with ``env`` added to its environment."""
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=False)
    with environment(env or {}):
        process.start()
    contender.workers.append((process, parent))


def spawn_silent(
    ctx: Any, contender: Contender, target: Callable[..., None], args: tuple[Any, ...], env: dict[str, str]
) -> None:
    """Start ``target(*args)`` as a process of ``contender`` that takes no commands."""
    process = ctx.Process(target=target, args=args, daemon=False)
    with environment(env):
        process.start()
    contender.silent.append(process)


def write_json(path: str | Path, document: Any) -> None:
    """Write a benchmark's results to ``path`` (its folder made), and say where on stderr."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2))
    print(f"wrote {path}", file=sys.stderr)


def write_results(path: str | Path, started: str, args: Any, results: Any, table: str) -> dict[str, Any]:
    """A benchmark's document (when it started, its arguments, this machine's cores, its results and table),
    written to ``path``."""
    document = {"date": started, "args": vars(args), "cpus": os.cpu_count(), "results": results, "table": table}
    write_json(path, document)
    return document


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss_mb(pid: int) -> list[float]:
    """Peak resident memory (VmHWM, MB) of ``pid`` and then of each of its descendants."""
    peaks = []
    pending = [pid]
    while pending:
        current = pending.pop(0)
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) / 1024)
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
    return peaks


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds used so far by ``pid`` and its descendants (all their threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    pending = [pid]
    while pending:
        current = pending.pop(0)
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11]) / tick  # utime: field 14 of stat, counted after the command name
            system += int(fields[12]) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
    return user, system
