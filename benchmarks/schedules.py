"""Every schedule in launched mode beside torch.distributed.pipelining's same schedule, and ``schedule="auto"``.

    python benchmarks/schedules.py --workloads mlp,gpt --rounds 4 --steps 2

Two pipeline ranks = two processes on this machine (launched mode as torchrun starts it; torch's processes in a
gloo world), M=8 microbatches, the `workloads` models. The schedules are the registry's (every registered
synchronous schedule, so schedules registered later are measured too): one stage per rank where the schedule
takes one, else two per rank (4 stages, cut as torch's stages are cut). Each schedule runs in its own race:

- ``<schedule>``: lightning_pipe against torch's same schedule (`contenders_torch.TORCH_SCHEDULES`) where torch
  has it, rounds alternating, after one checked step (both must make the same first update); the paired ratio
  is torch's median step time over ours in the same round, the median over rounds (> 1: lightning_pipe faster);
- ``auto``: ``schedule="auto"`` (same stages per rank) against the fastest fixed schedule of the races above,
  alternating again; reported with what auto chose (and in which placement), its predicted step time, and its
  prediction of every fixed schedule (``predicted_ms`` of each fixed row: compare it with the row's measurement).

``--backend eager,inductor`` runs each schedule once per backend in the same race (``backend=`` of PipeStrategy:
every stage compiled with inductor, or eager), so compiled against eager is a paired ratio too (the eager step time
over the compiled one, the median over rounds; > 1: compiled faster), and so is the CPU time per step (user and
system seconds of all the contender's processes in a round, per step: the work done, which a loaded machine moves
far less than the step time); a backend whose run fails (a crash while
compiling or in an action) gets its error in the table and the race is run again without it. With several
backends an ``unsplit`` row races the whole model in one process per backend (``MicrobatchRunner``: the same
microbatches, gradients accumulated, a stage's threads; inductor as a plain ``torch.compile``): what the backend
gains on the model itself, no pipeline and no split backward (``--without-unsplit``: not raced).

Prints a table and writes ``benchmarks/results/schedules.json``. The machine's speed drifts: only ratios measured
in one race mean much.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_procs import Config, Contender, end_all, free_port, reply, serve, spawn, write_results  # noqa: E402
from benchmarks.compare import compare_params  # noqa: E402
from benchmarks.contenders_launched import start_launched  # noqa: E402
from benchmarks.contenders_local import MicrobatchRunner  # noqa: E402
from benchmarks.contenders_torch import TORCH_SCHEDULES, TorchPipeRunner  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_model  # noqa: E402
from lightning_pipe.schedule import registered_schedules  # noqa: E402

Entry = tuple[str, str, Config]  # (label, "torch", "lightning_pipe" or "unsplit", configuration)
UNSPLIT = "unsplit"  # the row of the whole model in one process, per backend (`MicrobatchRunner`)


def schedules(ranks: int, microbatches: int) -> list[tuple[str, int]]:
    """(name, stages per rank) of every registered synchronous schedule that runs ``ranks`` x ``microbatches``."""
    found = []
    for name, factory in sorted(registered_schedules().items()):
        preferred = ([1] if name in ("gpipe", "1f1b") else [2]) if name in TORCH_SCHEDULES else [1, 2]
        for virtual in preferred:
            try:
                built = factory(ranks, microbatches, virtual)
                built.actions()
            except Exception:  # noqa: BLE001, S112 - a schedule that does not run this configuration is skipped
                continue
            if not built.asynchronous:
                found.append((name, virtual))
            break
    return found


def config(args: argparse.Namespace, workload: str, schedule: str, virtual: int) -> Config:
    stages = args.ranks * virtual
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.ranks)
    return Config(
        workload=workload,
        stages=stages,
        microbatches=args.microbatches,
        schedule=schedule,
        threads=threads,
        unsplit_threads=threads * args.ranks,
        lr=0.01,
        balance=WORKLOADS[workload].balance(stages),
        virtual_stages=virtual,
    )


def race(entries: list[Entry], args: argparse.Namespace) -> dict[str, Any]:
    """The entries' contenders started together, one checked step, warm-up, then alternating rounds."""
    ctx = mp.get_context("spawn")
    contenders: list[Contender] = []
    ran: dict[str, Any] = {}
    try:
        for label, kind, cfg in entries:
            contender = Contender(label, transport="p2p" if kind == "lightning_pipe" else "local")
            contenders.append(contender)
            if kind == UNSPLIT:
                spawn(ctx, contender, serve, (MicrobatchRunner, (cfg,)))
            elif kind == "torch":
                cfg.port = free_port()
                for rank in range(cfg.ranks):
                    spawn(ctx, contender, serve, (TorchPipeRunner, (cfg, rank)))
            else:
                start_launched(ctx, contender, cfg)
            for _, conn in contender.workers:
                reply(conn, label, "start")
        for contender in contenders:
            for answer in contender.ask("check"):
                contender.params.update(answer["params"])
        initial = build_model(entries[0][2].workload).state_dict()
        checks = {c.name: compare_params(initial, contenders[0].params, c.params)["same"] for c in contenders}
        for contender in contenders:
            contender.ask("run", args.warmup)
        for r in range(args.rounds):
            for contender in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
                silent = contender.silent_cpu()
                answers = contender.ask("run", args.steps)
                contender.rounds.append([max(ts) for ts in zip(*(a["times"] for a in answers), strict=True)])
                if all("cpu" in a for a in answers):  # every process's CPU seconds in the round, per step
                    now = contender.silent_cpu()
                    user = sum(a["cpu"][0] for a in answers) + now[0] - silent[0]
                    system = sum(a["cpu"][1] for a in answers) + now[1] - silent[1]
                    contender.cpu.append((user / args.steps, system / args.steps))
                if "ran" in answers[0]:  # lightning_pipe: which schedule ran (auto: its choice) and its prediction
                    ran[contender.name] = answers[0]["ran"]
        for contender in contenders:
            contender.ask("stop")
    finally:
        end_all(contenders)
    cpu = {c.name: [user + system for user, system in c.cpu] for c in contenders if len(c.cpu) == len(c.rounds)}
    return {"rounds": {c.name: c.rounds for c in contenders}, "same_first_update": checks, "ran": ran, "cpu": cpu}


def paired(ours: list[list[float]], theirs: list[list[float]]) -> float:
    """Median over rounds of (their median step time / ours) in the same round."""
    return statistics.median(statistics.median(t) / statistics.median(o) for o, t in zip(ours, theirs, strict=True))


def round_ms(rounds: list[list[float]]) -> list[float]:
    """Each round's median step time in ms (the spread over rounds shows the machine's noise)."""
    return [round(statistics.median(r) * 1e3, 1) for r in rounds]


def median_ms(rounds: list[list[float]]) -> float:
    return statistics.median(t for r in rounds for t in r) * 1e3


def backend_label(name: str, backend: str, backends: list[str]) -> str:
    """A lightning_pipe contender's name in a race: the schedule's, with the backend where several run."""
    return name if len(backends) == 1 else f"{name} [{backend}]"


def race_backends(
    args: argparse.Namespace, name: str, ours: Config, backends: list[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """One race of the schedule on every backend (and torch's); a backend that fails is raced again without."""
    errors: dict[str, str] = {}
    kind = UNSPLIT if name == UNSPLIT else "lightning_pipe"
    while True:
        running = [b for b in backends if b not in errors]
        entries: list[Entry] = [
            (backend_label(name, b, backends), kind, dataclasses.replace(ours, backend=b if b != "default" else None))
            for b in running
        ]
        if name in TORCH_SCHEDULES and not args.without_torch:
            entries.append((f"torch {name}", "torch", dataclasses.replace(ours)))
        try:
            return race(entries, args), errors
        except Exception as exc:  # noqa: BLE001 - the failing cell gets the error, the others still run
            failed = next((b for b in running if backend_label(name, b, backends) in str(exc)), None)
            if failed is None or len(running) == 1:
                errors.update({b: first_error(exc) for b in running})
                return {"rounds": {}, "same_first_update": {}, "ran": {}, "cpu": {}}, errors
            errors[failed] = first_error(exc)
            print(f"  {name} [{failed}] failed: {errors[failed]}", file=sys.stderr, flush=True)


def first_error(exc: BaseException) -> str:
    """The last line of a contender's traceback (its exception), shortened for a table cell."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:160]


def backend_cells(result: dict[str, Any], errors: dict[str, str], name: str, backends: list[str]) -> dict[str, Any]:
    """Each backend's step time, its ratio to torch and (after the first backend) to the first, paired."""
    cells: dict[str, Any] = {}
    first = backend_label(name, backends[0], backends)
    theirs = result["rounds"].get(f"torch {name}")
    for backend in backends:
        label = backend_label(name, backend, backends)
        if backend in errors or label not in result["rounds"]:
            cells[backend] = {"error": errors.get(backend, "did not run")}
            continue
        rounds = result["rounds"][label]
        cell: dict[str, Any] = {"step_ms": median_ms(rounds), "rounds_ms": round_ms(rounds)}
        # the first backend's first update is the reference; torch's is checked against it too (the row's flag)
        cell["same_first_update"] = result["same_first_update"].get(label, False)
        if theirs:
            cell["ratio_vs_torch"] = paired(rounds, theirs)
        if backend != backends[0] and first in result["rounds"]:
            cell[f"ratio_vs_{backends[0]}"] = paired(rounds, result["rounds"][first])
        cpu = result.get("cpu", {})
        if label in cpu:  # CPU seconds per step of all the contender's processes: the work, less the machine's load
            cell["cpu_ms_per_step"] = [round(c * 1e3, 1) for c in cpu[label]]
            if backend != backends[0] and first in cpu:
                ratios = [f / c for f, c in zip(cpu[first], cpu[label], strict=True)]
                cell[f"cpu_ratio_vs_{backends[0]}"] = statistics.median(ratios)
        cells[backend] = cell
    return cells


def workload_rows(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    backends = [b.strip() for b in args.backend.split(",")]
    for name, virtual in schedules(args.ranks, args.microbatches):
        if args.schedules and name not in args.schedules.split(","):
            continue
        ours = config(args, workload, name, virtual)
        print(f"{workload}: {name} ({virtual} stage(s) per rank)", file=sys.stderr, flush=True)
        result, errors = race_backends(args, name, ours, backends)
        cells = backend_cells(result, errors, name, backends)
        first = backend_label(name, backends[0], backends)
        if first not in result["rounds"]:
            rows[name] = {"virtual_stages": virtual, "torch": TORCH_SCHEDULES.get(name), "backends": cells}
            continue
        row: dict[str, Any] = {"virtual_stages": virtual, "step_ms": median_ms(result["rounds"][first])}
        row["backends"] = cells
        row["rounds_ms"] = round_ms(result["rounds"][first])
        row["torch"] = TORCH_SCHEDULES.get(name)
        if f"torch {name}" in result["rounds"]:
            theirs = result["rounds"][f"torch {name}"]
            row |= {"torch_step_ms": median_ms(theirs), "ratio_vs_torch": paired(result["rounds"][first], theirs)}
        row["same_first_update"] = all(result["same_first_update"].values())
        rows[name] = row
    if not args.without_auto:
        auto_rows(args, workload, rows)
    if len(backends) > 1 and not args.without_unsplit:
        rows[UNSPLIT] = unsplit_row(args, workload, backends)
    return rows


def unsplit_row(args: argparse.Namespace, workload: str, backends: list[str]) -> dict[str, Any]:
    """The whole model in one process on every backend (plain ``torch.compile`` for inductor), raced like a schedule:
    what the backend gains on this model without a pipeline, at a stage's microbatch size and threads."""
    print(f"{workload}: {UNSPLIT} (the whole model in one process)", file=sys.stderr, flush=True)
    result, errors = race_backends(args, UNSPLIT, config(args, workload, "1f1b", 1), backends)
    row: dict[str, Any] = {"virtual_stages": "-", "torch": None}
    row["backends"] = backend_cells(result, errors, UNSPLIT, backends)
    return row


def auto_rows(args: argparse.Namespace, workload: str, rows: dict[str, Any]) -> None:
    """Adds ``schedule="auto"`` per stages per rank to ``rows``, raced against their fastest fixed schedule."""
    for virtual in sorted({r["virtual_stages"] for r in rows.values() if "step_ms" in r}):
        fixed = {n: r for n, r in rows.items() if r["virtual_stages"] == virtual and "step_ms" in r}
        best = min(fixed, key=lambda n: fixed[n]["step_ms"])
        label = "auto" if virtual == 1 else f"auto (V={virtual})"
        print(f"{workload}: {label} against {best}", file=sys.stderr, flush=True)
        entries = [
            (label, "lightning_pipe", config(args, workload, "auto", virtual)),
            (f"fixed {best}", "lightning_pipe", config(args, workload, best, virtual)),
        ]
        result = race(entries, args)
        auto_rounds, best_rounds = result["rounds"][label], result["rounds"][f"fixed {best}"]
        chose = result["ran"].get(label) or {}
        rows[label] = {
            "virtual_stages": virtual,
            "step_ms": median_ms(auto_rounds),
            "best_fixed": best,
            "best_fixed_step_ms": median_ms(best_rounds),
            "ratio_vs_best_fixed": paired(auto_rounds, best_rounds),
            "rounds_ms": round_ms(auto_rounds),
            "best_fixed_rounds_ms": round_ms(best_rounds),
            "chose": chose.get("schedule"),
            "placement": chose.get("placement"),
            "predicted_ms": (chose.get("predicted_s") or 0.0) * 1e3 or None,
            "same_first_update": all(result["same_first_update"].values()),
        }
        for name, seconds in (chose.get("predictions_s") or {}).items():
            if name in fixed:
                fixed[name]["predicted_ms"] = seconds * 1e3  # auto's prediction of each fixed schedule


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| workload | schedule | V | lightning_pipe ms/step | torch ms/step | ratio vs torch | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload, rows in results.items():
        for name, r in rows.items():
            if "step_ms" not in r:  # its first backend failed: the backend table says why
                continue
            torch_ms = f"{r['torch_step_ms']:.1f}" if "torch_step_ms" in r else "-"
            ratio = f"{r['ratio_vs_torch']:.2f}" if "ratio_vs_torch" in r else "-"
            note = "" if name.startswith("auto") or r["torch"] else "torch has no such schedule"
            if r.get("predicted_ms") and not name.startswith("auto"):
                note = "; ".join(filter(None, [note, f"auto predicted {r['predicted_ms']:.1f} ms"]))
            if name.startswith("auto"):
                predicted = f", predicted {r['predicted_ms']:.1f} ms" if r.get("predicted_ms") else ""
                placed = f" (placement {r['placement']})" if r.get("placement") else ""
                note = (
                    f"chose {r['chose']}{placed}{predicted}; {r['ratio_vs_best_fixed']:.2f}x the best fixed "
                    f"({r['best_fixed']}, {r['best_fixed_step_ms']:.1f} ms in the same race)"
                )
            if not r["same_first_update"]:
                note += " (first update DIFFERS)"
            lines.append(
                f"| {workload} | {name} | {r['virtual_stages']} | {r['step_ms']:.1f} | {torch_ms} | {ratio} | {note} |"
            )
    return "\n".join(lines)


def backend_table(results: dict[str, dict[str, Any]], backends: list[str]) -> str:
    """Each schedule on each backend: ms per step, compiled against the first backend (paired), each against torch."""
    first = backends[0]
    head = " | ".join(f"{b} ms/step" for b in backends)
    versus = " | ".join(f"{b} vs {first} (paired) | CPU per step, {b} vs {first}" for b in backends[1:])
    torch_cols = " | ".join(f"{b} vs torch" for b in backends)
    lines = [
        f"| workload | schedule | V | {head} | {versus} | {torch_cols} | note |",
        "| --- " * (4 + 2 * len(backends) + 2 * (len(backends) - 1)) + "|",
    ]
    for workload, rows in results.items():
        for name, r in rows.items():
            if "backends" not in r:
                continue
            cells = r["backends"]
            ms = [f"{cells[b]['step_ms']:.1f}" if "step_ms" in cells[b] else "failed" for b in backends]
            vs = [
                " | ".join(
                    f"{cells[b][key]:.2f}" if key in cells[b] else "-"
                    for key in (f"ratio_vs_{first}", f"cpu_ratio_vs_{first}")
                )
                for b in backends[1:]
            ]
            tv = [f"{cells[b]['ratio_vs_torch']:.2f}" if "ratio_vs_torch" in cells[b] else "-" for b in backends]
            note = "; ".join(f"{b}: {cells[b]['error']}" for b in backends if "error" in cells[b])
            if name == UNSPLIT:
                note = "; ".join(filter(None, ["the whole model in one process (plain torch.compile)", note]))
            differs = [
                b for b in backends[1:] if cells[b].get("same_first_update") is False and "error" not in cells[b]
            ]
            if differs:
                note = "; ".join(filter(None, [note, f"first update of {', '.join(differs)} DIFFERS from {first}'s"]))
            lines.append(
                f"| {workload} | {name} | {r['virtual_stages']} | " + " | ".join([*ms, *vs, *tv]) + f" | {note} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="mlp,gpt")
    parser.add_argument("--ranks", type=int, default=2, help="processes of the pipeline")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads per process (default: cores/ranks)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender before the rounds")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per contender per round")
    parser.add_argument("--schedules", default="", help="only these fixed schedules (comma-separated; default all)")
    parser.add_argument("--without-torch", action="store_true", help="no torch contenders (auto against ours only)")
    parser.add_argument("--without-auto", action="store_true", help="no schedule='auto' races")
    parser.add_argument(
        "--without-unsplit", action="store_true", help="no race of the whole model per backend (several backends)"
    )
    parser.add_argument(
        "--backend", default="default", help="lightning_pipe's backends, each in every race: e.g. eager,inductor"
    )
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "schedules.json"))
    args = parser.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",")]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {w: workload_rows(args, w) for w in workloads}
    text = table(results)
    if "," in args.backend:
        text += "\n\n" + backend_table(results, [b.strip() for b in args.backend.split(",")])
    print(text)
    return write_results(args.json, started, args, results, text)


if __name__ == "__main__":
    main()
