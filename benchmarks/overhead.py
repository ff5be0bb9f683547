"""The cost of one pipeline action: lightning_pipe (local, rpc, launched) against torch.distributed.pipelining.

    python benchmarks/overhead.py --schedules 1f1b,zbv --rounds 8 --steps 4

Each stage is one ``Linear(32, 32)`` and a step runs 32 microbatches of 2 rows over 2 ranks, so compute is a
few microseconds per action and a step's time is the libraries' own work: dispatch, hand-offs, messages. Every
contender runs the same schedule (1f1b: one stage per rank, F and B; zbv: two per rank, F, I and W) from the same
model and data, one intra-op thread per rank, in processes of its own, all started before the rounds; the rounds
alternate their order, so the machine's drift hits all alike:

- ``torch``: torch.distributed.pipelining, one process per rank, gloo on 127.0.0.1;
- ``local``: lightning_pipe's `Pipeline` with stage threads in one process;
- ``rpc``: the same with ``transport="rpc"`` (a worker process for stage 0, the last stage with the coordinator);
- ``launched``: launched mode's engine, `P2PCommunicator` over a gloo world of 2 processes, global rank 0 the
  coordinator with the last stage (as a torchrun launch places it), without Lightning's loop; with a second gloo
  group for the messages to the lower pipeline rank (``reverse``), as launched mode makes one.

``--base DIR`` adds ``local@base``, ``rpc@base`` and ``launched@base``: the same contenders on the lightning_pipe
of another checkout (``git worktree add DIR <commit>``), to measure a change before and after in one run.

Reported per contender: the median step time; microseconds per action, wall (step time over the actions of one
rank: the ranks run at once) and CPU (every process's CPU time per step over every rank's actions); the paired
ratio against torch (each round's median step time of torch over the contender's, the median over rounds; > 1:
faster than torch); and the mean microseconds of each kind of action where it is measured (see
`contenders_overhead`: lightning_pipe's F, B, I, W exclude waiting for their inputs, torch's exclude its receives;
the columns send/recv are lightning_pipe's hand-offs, ``p2p post``/``p2p wait`` torch's). Writes
``benchmarks/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LIGHTNING_PIPE_WORKER", "1")  # the engine only: no process of this run imports Lightning
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import multiprocessing as mp  # noqa: E402

from benchmarks.bench_procs import Contender, cpu_seconds, end_all, free_port, reply, spawn, write_results  # noqa: E402
from benchmarks.contenders_overhead import (  # noqa: E402
    V_SHAPED,
    LaunchedRunner,
    OverheadConfig,
    PipelineRunner,
    TorchRunner,
    serve_and_exit,
    serve_rank,
)

KINDS = ["F", "B", "I", "W", "send", "recv", "loss", "p2p post", "p2p wait"]
MULTI_STAGE = ("interleaved-1f1b", "interleaved-zero-bubble", *V_SHAPED)


def start(ctx: Any, label: str, cfg: OverheadConfig) -> Contender:
    """Start ``label``'s processes (``name`` or ``name@base``) and wait until each is ready."""
    name = label.split("@")[0]
    contender = Contender(label)
    if name in ("torch", "launched"):
        cfg.port = free_port()
    if name == "torch":
        for rank in range(cfg.ranks):
            spawn(ctx, contender, serve_and_exit, (TorchRunner, (cfg, rank)))
    elif name == "launched":
        spawn(ctx, contender, serve_and_exit, (LaunchedRunner, (cfg,)))
        for rank in range(1, cfg.ranks):
            process = ctx.Process(target=serve_rank, args=(cfg, rank), daemon=False)
            process.start()
            contender.silent.append(process)
    elif name in ("local", "rpc"):
        spawn(ctx, contender, serve_and_exit, (PipelineRunner, (cfg, name)))
    else:
        raise ValueError(f"unknown contender {label!r}; available: torch, local, rpc, launched (and name@base)")
    for _, conn in contender.workers:
        reply(conn, label, "start")
    return contender


def actions_per_rank(cfg: OverheadConfig) -> list[int]:
    """How many actions each rank runs in a step (lightning_pipe's schedule, which is torch's)."""
    from lightning_pipe.schedule import resolve_schedule

    schedule = resolve_schedule(cfg.schedule)(cfg.ranks, cfg.microbatches, cfg.virtual_stages)
    return [len(actions) for actions in schedule.actions()]


def race(cfg: OverheadConfig, labels: list[str], base: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """Start every contender, warm up, then alternate timed rounds; each contender's step times, CPU and spans."""
    ctx = mp.get_context("spawn")
    contenders: list[Contender] = []
    rows: dict[str, dict[str, Any]] = {}
    try:
        for label in labels:
            root = base if label.endswith("@base") else None
            contenders.append(start(ctx, label, OverheadConfig(**{**vars(cfg), "root": root})))
            rows[label] = {"rounds": [], "cpu": [], "spans": {}}
            print(f"  {cfg.schedule}: started {label}", file=sys.stderr, flush=True)
        for contender in contenders:
            contender.ask("run", args.warmup)
        for r in range(args.rounds):
            for contender in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
                silent = sum(sum(cpu_seconds(p.pid)) for p in contender.silent)
                answers = contender.ask("run", args.steps)
                silent = sum(sum(cpu_seconds(p.pid)) for p in contender.silent) - silent
                row = rows[contender.name]
                row["rounds"].append([max(ts) for ts in zip(*(a["times"] for a in answers), strict=True)])
                row["cpu"].append(sum(a["cpu"] for a in answers) + silent)
                for answer in answers:
                    for kind, seconds in answer["spans"].items():
                        row["spans"].setdefault(kind, []).extend(seconds)
        for contender in contenders:
            contender.ask("stop")
    finally:
        end_all(contenders)
    return rows


def summarize(cfg: OverheadConfig, rows: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    per_rank = actions_per_rank(cfg)
    torch_rounds = rows.get("torch", {}).get("rounds")
    out: dict[str, Any] = {"actions_per_rank": per_rank, "contenders": {}}
    for label, row in rows.items():
        step = statistics.median(t for r in row["rounds"] for t in r)
        result: dict[str, Any] = {
            "step_ms": step * 1e3,
            "us_per_action_wall": step / max(per_rank) * 1e6,
            "cpu_us_per_action": sum(row["cpu"]) / (len(row["cpu"]) * steps) / sum(per_rank) * 1e6,
            "rounds_ms": [round(statistics.median(r) * 1e3, 2) for r in row["rounds"]],
            "us_by_kind": {k: statistics.fmean(v) * 1e6 for k, v in row["spans"].items()},
            "count_by_kind_per_step": {k: len(v) / (len(row["rounds"]) * steps) for k, v in row["spans"].items()},
        }
        if torch_rounds:
            ratios = [
                statistics.median(t) / statistics.median(o) for o, t in zip(row["rounds"], torch_rounds, strict=True)
            ]
            result["paired_vs_torch"] = statistics.median(ratios)
        out["contenders"][label] = result
    return out


def table(results: dict[str, Any]) -> str:
    lines = [
        "| schedule | contender | step ms | us/action (wall) | CPU us/action | vs torch (paired) | "
        + " | ".join(KINDS)
        + " |",
        "| --- " * (6 + len(KINDS)) + "|",
    ]
    for schedule, result in results.items():
        for label, r in result["contenders"].items():
            paired = f"{r['paired_vs_torch']:.2f}" if "paired_vs_torch" in r else "-"
            kinds = [f"{r['us_by_kind'][k]:.0f}" if k in r["us_by_kind"] else "-" for k in KINDS]
            lines.append(
                f"| {schedule} | {label} | {r['step_ms']:.1f} | {r['us_per_action_wall']:.0f} | "
                f"{r['cpu_us_per_action']:.0f} | {paired} | " + " | ".join(kinds) + " |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", default="1f1b,zbv", help="comma-separated; torch must have each")
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--contenders", default="torch,local,rpc,launched")
    parser.add_argument("--base", default=None, help="another checkout: adds local@base, rpc@base, launched@base")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per contender before the rounds")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per contender per round")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "overhead.json"))
    args = parser.parse_args(argv)
    labels = [c.strip() for c in args.contenders.split(",")]
    if args.base:
        labels += [f"{c}@base" for c in labels if c != "torch"]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {}
    for schedule in [s.strip() for s in args.schedules.split(",")]:
        virtual = 2 if schedule in MULTI_STAGE else 1
        cfg = OverheadConfig(schedule, args.ranks, virtual, args.microbatches)
        results[schedule] = summarize(cfg, race(cfg, labels, args.base, args), args.steps)
    text = table(results)
    print(text)
    return write_results(args.json, started, args, results, text)


if __name__ == "__main__":
    main()
