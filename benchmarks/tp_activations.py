"""How a replicated activation should cross between stages with tensor parallel: per tensor rank, or once and spread.

    python benchmarks/tp_activations.py                          # 2 stages x 2 tensor ranks, 64 KiB - 16 MiB, 12 rounds
    python benchmarks/tp_activations.py --rounds 20 --reps 9 --tokens 64,4096

Four processes on 127.0.0.1 in one gloo world: stage 0 is ranks 0, 1 and stage 1 ranks 2, 3 (tensor rank t of
stage p is global rank p * T + t, tensor innermost as in launched mode). An fp32 activation of batch x seq x
hidden crosses from stage 0 to stage 1 (forward) and its gradient, of the same size, from stage 1 to stage 0
(backward), three ways:

- ``per_rank`` (a, what `p2p.dtensor_frames` does today): each tensor rank t of the sending stage ``isend``s the
  whole tensor to tensor rank t of the receiving stage, which ``irecv``s it (the p2p transport's primitives);
- ``broadcast`` (b): tensor rank 0 sends it to tensor rank 0, which broadcasts it over the receiving stage's
  tensor group;
- ``scatter_gather`` (c, Megatron's): each pair sends 1/T of the flattened tensor, then the receiving stage
  all-gathers it over its tensor group.

A transfer starts after a barrier of the four processes and ends when every receiving process holds the whole
tensor: its time is the latest end minus the earliest start (CLOCK_MONOTONIC, one clock for all processes). In each
round every size and direction runs the three ways, in an order rotated every round, ``--reps`` transfers each
(their median is the round's time); the ratios b/a and c/a are taken within a round, their median over rounds
reported. Every received tensor is checked against the sent one in the first round. Prints a table and writes
``benchmarks/results/tp_activations.json``. Loopback is not an inter-node link: a and b/c move T x and 1 x the
tensor's bytes between the stages, which only a slow link between the stages' nodes makes count.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_procs import free_port, write_json  # noqa: E402

WAYS = ("per_rank", "broadcast", "scatter_gather")
STAGES = 2
TIMEOUT = 120.0  # seconds any collective, send or receive may wait; the parent waits for the whole run


def now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def point_to_point(tensor: torch.Tensor, peer: int, sending: bool) -> None:
    """One ``isend`` or ``irecv`` (tag 1), waited for: the p2p transport's primitives."""
    work = dist.isend(tensor, dst=peer, tag=1) if sending else dist.irecv(tensor, src=peer, tag=1)
    if work is not None:
        work.wait()


def transfer(
    way: str, rank: int, value: torch.Tensor, out: torch.Tensor, src: list[int], dst: list[int], group: Any
) -> None:
    """One crossing of ``value`` from the ranks ``src`` (a stage's tensor ranks) into ``out`` on the ranks ``dst``."""
    tensors = len(src)
    if way == "per_rank":
        if rank in src:
            point_to_point(value, dst[src.index(rank)], True)
        elif rank in dst:
            point_to_point(out, src[dst.index(rank)], False)
    elif way == "broadcast":
        if rank == src[0]:
            point_to_point(value, dst[0], True)
        elif rank == dst[0]:
            point_to_point(out, src[0], False)
        if rank in dst:
            dist.broadcast(out, group_src=0, group=group)
    else:  # scatter_gather: pair t carries part t of the flattened tensor
        if rank in src:
            point_to_point(value.view(-1).chunk(tensors)[src.index(rank)], dst[src.index(rank)], True)
        elif rank in dst:
            part = torch.empty(value.numel() // tensors, dtype=value.dtype)
            point_to_point(part, src[dst.index(rank)], False)
            dist.all_gather_single(out.view(-1), part, group=group)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT)
    )
    try:
        tensors = world // STAGES
        stage_ranks = [list(range(p * tensors, (p + 1) * tensors)) for p in range(STAGES)]
        groups = [dist.new_group(ranks) for ranks in stage_ranks]
        directions = {"forward": (0, 1), "backward": (1, 0)}  # (sending stage, receiving stage)
        records: list[tuple[int, int, str, str, int, int]] = []  # round, tokens, direction, way, start, end
        for round_ in range(args.rounds):
            ways = WAYS[round_ % len(WAYS) :] + WAYS[: round_ % len(WAYS)]
            for tokens in args.tokens:
                shape = (args.batch, tokens // args.batch, args.hidden)
                value = torch.randn(shape, generator=torch.Generator().manual_seed(tokens))  # the same on every rank
                out = torch.empty(shape)
                for direction, (p, q) in directions.items():
                    for way in ways:
                        for _ in range(args.reps):
                            if round_ == 0:
                                out.zero_()
                            dist.barrier()
                            start = now()
                            transfer(way, rank, value, out, stage_ranks[p], stage_ranks[q], groups[q])
                            records.append((round_, tokens, direction, way, start, now()))
                            if round_ == 0 and rank in stage_ranks[q] and not torch.equal(out, value):
                                raise RuntimeError(f"{way} {direction} delivered a wrong tensor to rank {rank}")
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(records, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            results.put(("ok", gathered))
    except Exception as exc:  # the parent reports it
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> list[list[tuple[int, int, str, str, int, int]]]:
    """Run the processes; every process's records (the same transfers in the same order)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world, port = STAGES * args.tensor_parallel, free_port()
    processes = [ctx.Process(target=worker, args=(r, world, port, args, results)) for r in range(world)]
    for process in processes:
        process.start()
    try:
        status, value = results.get(timeout=args.timeout)
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(10)
    if status != "ok":
        raise RuntimeError(value)
    return value


def summarize(args: argparse.Namespace, records: list[list[tuple[int, int, str, str, int, int]]]) -> list[dict]:
    """Per size and direction: the median time of each way, and the paired ratios b/a and c/a."""
    times: dict[tuple[int, str, str, int], list[float]] = {}
    for per_rank in zip(*records, strict=True):
        round_, tokens, direction, way = per_rank[0][:4]
        elapsed = (max(r[5] for r in per_rank) - min(r[4] for r in per_rank)) / 1e6  # ms
        times.setdefault((tokens, direction, way, round_), []).append(elapsed)
    rows = []
    for tokens in args.tokens:
        for direction in ("forward", "backward"):
            rounds = {w: [statistics.median(times[tokens, direction, w, r]) for r in range(args.rounds)] for w in WAYS}
            ratios = {w: [x / a for x, a in zip(rounds[w], rounds["per_rank"], strict=True)] for w in WAYS[1:]}
            rows.append(
                {
                    "tokens": tokens,
                    "shape": [args.batch, tokens // args.batch, args.hidden],
                    "kib": tokens * args.hidden * 4 // 1024,
                    "direction": direction,
                    "median_ms": {w: statistics.median(v) for w, v in rounds.items()},
                    "ratio_b_a": statistics.median(ratios["broadcast"]),
                    "ratio_c_a": statistics.median(ratios["scatter_gather"]),
                    "ratio_range": {w: [min(v), max(v)] for w, v in ratios.items()},
                    "rounds_faster_than_a": {w: sum(x < 1 for x in v) for w, v in ratios.items()},
                    "round_ms": rounds,
                }
            )
    return rows


def table(rows: list[dict], tensors: int) -> str:
    lines = [
        f"| KiB | batch x seq x hidden | direction | a: per tensor rank ms ({tensors}x bytes) | b: once + broadcast ms "
        "| c: scatter + all-gather ms | b/a | c/a | rounds b < a | rounds c < a |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ms, faster, rounds = r["median_ms"], r["rounds_faster_than_a"], len(r["round_ms"]["per_rank"])
        lines.append(
            f"| {r['kib']} | {' x '.join(map(str, r['shape']))} | {r['direction']} | {ms['per_rank']:.3f} | "
            f"{ms['broadcast']:.3f} | {ms['scatter_gather']:.3f} | {r['ratio_b_a']:.2f} | {r['ratio_c_a']:.2f} | "
            f"{faster['broadcast']}/{rounds} | {faster['scatter_gather']}/{rounds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensor-parallel", type=int, default=2, help="tensor ranks per stage (T)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument(
        "--tokens",
        type=lambda s: [int(t) for t in s.split(",")],
        default=[16, 64, 256, 1024, 4096],
        help="batch x seq of each size (comma-separated; default 64 KiB to 16 MiB at hidden 1024)",
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--reps", type=int, default=9, help="transfers per way, size and direction in a round")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds the whole measurement may take")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "tp_activations.json"))
    args = parser.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = summarize(args, measure(args))
    text = table(rows, args.tensor_parallel)
    print(text)
    out = {
        "date": started,
        "args": vars(args),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "rows": rows,
        "table": text,
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
