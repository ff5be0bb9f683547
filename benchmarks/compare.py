"""lightning_pipe against torch.distributed.pipelining, side by side in one run.

    python benchmarks/compare.py --workload mlp --stages 2 --microbatches 8 --schedule 1f1b

Contenders, each in its own process(es), all with the same model, initialisation, data and
threads per stage:

- ``unsplit``: the whole model in one process (threads: stages x threads per stage, at most the cores);
- ``torch``: torch.distributed.pipelining, `PipelineStage` + `ScheduleGPipe`/`Schedule1F1B`, one
  process per stage, gloo on 127.0.0.1;
- ``lightning_pipe``: a Lightning ``Trainer`` with ``PipeStrategy`` (local transport: stage threads
  in one process), when the strategy is importable;
- ``engine``: lightning_pipe's `Pipeline` without Lightning (local transport), the engine alone;
- ``engine-rpc`` / ``lightning_pipe-rpc``: the same over ``transport="rpc"`` when that transport exists;
- ``lightning_pipe-p2p``: the Trainer in launched mode, one process per stage started as torchrun starts
  them, activations point to point over gloo (`contenders_launched`).

lightning_pipe runs with its default arguments besides the run's stages, microbatches and schedule
(``checkpoint="auto"``, ``partition="params"``, ...); its default partition must cut where torch's stages
are cut (checked at the first step).

Modules: `bench_procs` (configuration, worker processes, /proc readings), `contenders_local` (unsplit,
engine), `contenders_torch`, `contenders_trainer`, `contenders_launched`, `compare_tables` (the tables).

After one checked step (all contenders must hold the same parameters), the contenders run in
alternating rounds so machine drift hits all alike. Reported: training samples/s (median, min,
max over the timed steps), the ratio to torch.distributed.pipelining, the efficiency against the
pipeline bound ``batch / ((M + S - 1) * t_max)`` with ``t_max`` the slowest stage's measured
forward+backward time per microbatch, peak RSS per process, and lightning_pipe's engine overhead
(time per microbatch its stage workers spend outside compute and outside waiting).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.bench_procs import Config, Contender, free_port, peak_rss_mb, reply, serve, spawn  # noqa: E402
from benchmarks.compare_tables import format_table, summary_table  # noqa: E402
from benchmarks.contenders_launched import start_launched  # noqa: E402
from benchmarks.contenders_local import EngineRunner, UnsplitRunner  # noqa: E402
from benchmarks.contenders_torch import TorchPipeRunner  # noqa: E402
from benchmarks.contenders_trainer import serve_trainer_entry  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_model  # noqa: E402


def available_transports() -> list[str]:
    import importlib.util

    from lightning_pipe.comm.transports import TRANSPORTS

    spec = importlib.util.find_spec("lightning_pipe.comm.rpc")
    if spec is not None and spec.origin is not None and Path(spec.origin).is_relative_to(REPO):
        import lightning_pipe.comm.rpc  # noqa: F401 - registers transport="rpc" where it exists
    return sorted(TRANSPORTS)


def has_strategy() -> bool:
    """Whether this checkout has the Lightning strategy (not another copy of lightning_pipe on the path)."""
    import importlib.util

    spec = importlib.util.find_spec("lightning_pipe.strategy")
    return spec is not None and spec.origin is not None and Path(spec.origin).is_relative_to(REPO)


def has_launched_mode() -> bool:
    """Whether this checkout's strategy runs launched mode (several processes, one stage each)."""
    import importlib.util

    return importlib.util.find_spec("lightning_pipe.comm.p2p") is not None


def start_contenders(cfg: Config, names: list[str], contenders: list[Contender]) -> None:
    """Start each contender's processes into ``contenders`` (so that the caller ends them also when one fails)."""
    ctx = mp.get_context("spawn")
    for label in names:
        name = label.split("#")[0]  # "engine#2": a second copy of a contender, to see the noise between equals
        contender = Contender(label, transport="rpc" if name.endswith("-rpc") else "local")
        contenders.append(contender)
        if name == "unsplit":
            spawn(ctx, contender, serve, (UnsplitRunner, (cfg,)))
        elif name == "torch":
            cfg.port = free_port()
            for rank in range(cfg.stages):
                spawn(ctx, contender, serve, (TorchPipeRunner, (cfg, rank)))
        elif name.startswith("engine"):
            spawn(ctx, contender, serve, (EngineRunner, (cfg, contender.transport)))
        elif name.startswith("lightning_pipe-p2p"):
            contender.transport = "p2p"
            start_launched(ctx, contender, cfg)
        elif name.startswith("lightning_pipe"):
            spawn(ctx, contender, serve_trainer_entry, (cfg, contender.transport))
        else:
            raise ValueError(f"unknown contender {name!r}")
        for _, conn in contender.workers:
            reply(conn, label, "start")


def compare_params(
    initial: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Whether ``other`` made the same first update as ``reference``, relative to the update's size.

    A difference within the parameters' own rounding also counts as the same: an update of 3e-5 to a weight
    near 1.0 (a LayerNorm's) lands on float32 values 6e-8 apart, so two correct but differently ordered sums
    (inductor's fused kernels against eager's) can differ by 2e-3 of the update and by no more than an ulp.
    """
    missing = sorted(set(reference) ^ set(other))
    keys = [k for k in reference if k in other and reference[k].is_floating_point()]
    update = max((reference[k] - initial[k]).abs().max().item() for k in keys)
    diffs = {k: (reference[k] - other[k]).abs().max().item() for k in keys}
    diff = max(diffs.values())
    relative = diff / update if update > 0 else float("inf")
    # per tensor: about two ulps of its largest value
    rounding = {k: 2 * torch.finfo(reference[k].dtype).eps * reference[k].abs().max().item() for k in keys}
    same = not missing and all(diffs[k] < 1e-3 * update or diffs[k] <= rounding[k] for k in keys)
    return {
        "max_abs_diff": diff,
        "update": update,
        "relative": relative,
        "within_rounding": relative >= 1e-3 and same,
        "same": same,
        "missing": missing,
    }


def run(cfg: Config, names: list[str], warmup: int, rounds: int, steps: int) -> dict[str, Any]:
    contenders: list[Contender] = []
    try:
        start_contenders(cfg, names, contenders)
        by_name = {c.name: c for c in contenders}
        # one checked step from the same initial parameters
        for contender in contenders:
            for answer in contender.ask("check"):
                contender.params.update(answer["params"])
        initial = build_model(cfg.workload).state_dict()
        reference = by_name["torch"].params if "torch" in by_name else contenders[0].params
        checks = {c.name: compare_params(initial, reference, c.params) for c in contenders}
        for contender in contenders:
            contender.ask("run", warmup)
        stage_times: list[list[float]] = []
        for r in range(rounds):
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            for contender in order:
                run_round(contender, steps)
            if "unsplit" in by_name:
                stage_times.append(by_name["unsplit"].ask("profile")[0])
            print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        for contender in contenders:
            contender.rss_mb = [mb for process in contender.processes() for mb in peak_rss_mb(process.pid)]
            for answer in contender.ask("stop"):
                contender.rss_mb += (answer or {}).get("worker_rss_mb", [])
    finally:
        for contender in contenders:
            for failure in contender.end():
                print(f"warning: {failure}", file=sys.stderr)
    return summarize(cfg, contenders, checks, stage_times)


def run_round(contender: Contender, steps: int) -> None:
    """One round of ``steps`` timed steps: their times, CPU (silent processes' read from here) and info."""
    silent_before = contender.silent_cpu()
    answers = contender.ask("run", steps)
    silent_after = contender.silent_cpu()
    user = sum(a["cpu"][0] for a in answers) + silent_after[0] - silent_before[0]
    system = sum(a["cpu"][1] for a in answers) + silent_after[1] - silent_before[1]
    contender.cpu.append((user / steps, system / steps))
    contender.rounds.append([max(ts) for ts in zip(*(a["times"] for a in answers), strict=True)])
    for answer in answers:
        contender.info.extend(answer["info"])


def summarize(
    cfg: Config, contenders: list[Contender], checks: dict[str, Any], stage_times: list[list[float]]
) -> dict[str, Any]:
    """Throughput, ratios and efficiencies.

    The machine's speed drifts (other jobs share the cores), so besides medians over all timed steps
    this reports the *paired* ratio (each round's median step time against torch's in the same round,
    then the median over rounds) and best-case numbers (fastest step, fastest stage profile).
    """
    per_stage = [statistics.median(ts) for ts in zip(*stage_times, strict=True)] if stage_times else []
    best_stage = [min(ts) for ts in zip(*stage_times, strict=True)] if stage_times else []
    span = cfg.microbatches + cfg.stages - 1
    bound_step = span * max(per_stage) if per_stage else None
    best_bound_step = span * max(best_stage) if best_stage else None
    torch_rounds = next((c.rounds for c in contenders if c.name == "torch"), None)
    rows: dict[str, Any] = {}
    for c in contenders:
        times = [t for r in c.rounds for t in r]
        rates = [cfg.batch / t for t in times]
        row: dict[str, Any] = {
            "samples_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
            "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_best": min(times) * 1e3,
            # CPU time of all the contender's processes and threads per step: unlike wall time it hardly
            # changes when other jobs share the machine, so it shows each library's own cost
            "cpu_ms_per_step": {
                "user": statistics.median(u for u, _ in c.cpu) * 1e3,
                "system": statistics.median(s for _, s in c.cpu) * 1e3,
            },
            "steps_timed": len(times),
            "peak_rss_mb": [round(x, 1) for x in c.rss_mb],
            "params_match": checks[c.name],
        }
        if bound_step and best_bound_step:
            row["efficiency_vs_bound"] = bound_step / statistics.median(times)
            row["efficiency_vs_bound_best"] = best_bound_step / min(times)
        if torch_rounds is not None:
            paired = [
                statistics.median(theirs) / statistics.median(ours)
                for ours, theirs in zip(c.rounds, torch_rounds, strict=True)
            ]
            row["ratio_vs_torch_paired"] = statistics.median(paired)
            row["ratio_vs_torch_per_round"] = paired
        if c.info:
            row["engine"] = {k: statistics.median(i[k] for i in c.info) for k in c.info[0]}
            row["engine"]["overhead_share_of_compute"] = (
                row["engine"]["overhead_ms_per_microbatch"] / row["engine"]["compute_ms_per_microbatch"]
            )
        rows[c.name] = row
    if "torch" in rows:
        torch_row = rows["torch"]
        for row in rows.values():
            row["ratio_vs_torch"] = row["samples_per_s"]["median"] / torch_row["samples_per_s"]["median"]
            row["ratio_vs_torch_best"] = torch_row["step_ms_best"] / row["step_ms_best"]
    return {
        "config": asdict(cfg) | {"batch": cfg.batch, "torch": torch.__version__, "cpus": os.cpu_count()},
        "stage_fwd_bwd_ms": [t * 1e3 for t in per_stage],
        "stage_fwd_bwd_ms_best": [t * 1e3 for t in best_stage],
        "bound_samples_per_s": cfg.batch / bound_step if bound_step else None,
        "bound_samples_per_s_best": cfg.batch / best_bound_step if best_bound_step else None,
        "contenders": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads per stage (default: cores/stages)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender before the rounds")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per contender per round")
    parser.add_argument("--contenders", default=None, help="comma-separated subset; default: all available")
    parser.add_argument(
        "--compress", default=None, help="message compression of the rpc contenders: bf16, fp16, zstd, bf16+zstd, ..."
    )
    parser.add_argument("--json", default=None, help="where to write the results (default: benchmarks/results/)")
    parser.add_argument("--summary", nargs="+", metavar="JSON", help="print one markdown table of result files")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary_table(args.summary))
        return {}

    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.stages)
    cfg = Config(
        workload=args.workload,
        stages=args.stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        threads=threads,
        unsplit_threads=min(cores, threads * args.stages),
        lr=args.lr,
        balance=WORKLOADS[args.workload].balance(args.stages),
        compress=args.compress,
    )
    names = ["unsplit", "torch", "engine"]
    if has_strategy():
        names.append("lightning_pipe")
    if "rpc" in available_transports():
        names += ["engine-rpc"] + (["lightning_pipe-rpc"] if has_strategy() else [])
    if has_strategy() and has_launched_mode():
        names.append("lightning_pipe-p2p")
    if args.contenders:
        names = [n.strip() for n in args.contenders.split(",")]
    print(f"contenders: {', '.join(names)}; balance {cfg.balance}", file=sys.stderr, flush=True)
    results = run(cfg, names, args.warmup, args.rounds, args.steps)
    table = format_table(results)
    print(table)
    path = (
        Path(args.json)
        if args.json
        else REPO
        / "benchmarks"
        / "results"
        / (
            f"{cfg.workload}-{cfg.stages}stages-{cfg.microbatches}mb-{cfg.schedule}"
            + (f"-{cfg.compress}" if cfg.compress else "")
            + ".json"
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    results["table"] = table
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
