"""Schedules and runners side by side: step time, samples/s and the measured bubble of each.

    python benchmarks/schedules.py --rounds 3 --steps 5 --out schedules.json

Every configuration trains the same model on the same batches; rounds alternate the order of the
configurations so that a noisy machine hurts them alike. The bubble is measured from the workers'
action timelines: ``1 - busy / (workers x span)`` over one step. Stages run in threads
(``transport="local"``), so on a CPU with fewer cores than stages the numbers say more about the
schedule's order than about parallel speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe import Pipeline

CONFIGS: list[tuple[str, int, str]] = [  # (schedule, virtual_stages, runner)
    ("gpipe", 1, "parallel"),
    ("1f1b", 1, "parallel"),
    ("interleaved-1f1b", 2, "parallel"),
    ("zero-bubble", 1, "parallel"),
    ("1f1b", 1, "dataflow"),
    ("zero-bubble", 1, "dataflow"),
    ("1f1b", 1, "linear"),
    ("async", 1, "parallel"),  # no flush: one stream of all the batches, per-stage SGD
]


def model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)], nn.Linear(width, 10)
    )


def bubble(records: list[list[tuple[str, float, float]]]) -> float:
    busy = sum(end - start for rank in records for _, start, end in rank)
    span = max(e for rank in records for _, _, e in rank) - min(s for rank in records for _, s, _ in rank)
    return 1.0 - busy / (len(records) * span)


def run(config: tuple[str, int, str], args: argparse.Namespace, data: list[Any]) -> dict[str, float]:
    schedule, virtual, runner = config
    net = model(args.width, args.depth)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    times, bubbles = [], []
    if schedule == "async":
        with Pipeline(
            net, stages=args.stages, schedule="async", checkpoint=args.checkpoint, partition="uniform"
        ) as pipe:
            sgd = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
            pipe.train_async(data[:1], F.cross_entropy, sgd, args.microbatches)  # build and warm up
            start = time.perf_counter()
            run = pipe.train_async(data[1:], F.cross_entropy, sgd, args.microbatches)
            step = (time.perf_counter() - start) / (len(data) - 1)
        return {"step_s": step, "samples_per_s": args.batch / step, "bubble": bubble(run.step.records)}
    with Pipeline(
        net,
        stages=args.stages,
        schedule=schedule,
        virtual_stages=virtual,
        runner=runner,
        checkpoint=args.checkpoint,
        partition="uniform",
    ) as pipe:
        for i, (x, y) in enumerate(data):
            start = time.perf_counter()
            result = pipe.train_step(x, y, F.cross_entropy, microbatches=args.microbatches)
            opt.step()
            opt.zero_grad()
            if i > 0:  # the first step builds and warms up
                times.append(time.perf_counter() - start)
                bubbles.append(bubble(result.records))
    step = statistics.median(times)
    return {"step_s": step, "samples_per_s": args.batch / step, "bubble": statistics.median(bubbles)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--checkpoint", default="never")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
        for _ in range(args.steps + 1)
    ]
    results: dict[str, list[dict[str, float]]] = {}
    for r in range(args.rounds):
        order = CONFIGS if r % 2 == 0 else list(reversed(CONFIGS))
        for config in order:
            results.setdefault("/".join(map(str, config)), []).append(run(config, args, data))
    base = statistics.median(x["step_s"] for x in results["1f1b/1/parallel"])
    print(f"{'schedule/virtual/runner':<28} {'step ms':>8} {'samples/s':>10} {'vs 1f1b':>8} {'bubble':>7}")
    summary = {}
    for name, runs in results.items():
        step = statistics.median(x["step_s"] for x in runs)
        bub = statistics.median(x["bubble"] for x in runs)
        summary[name] = {"step_s": step, "samples_per_s": args.batch / step, "vs_1f1b": base / step, "bubble": bub}
        print(f"{name:<28} {step * 1e3:>8.1f} {args.batch / step:>10.0f} {base / step:>8.2f} {bub:>7.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch_threads": torch.get_num_threads(), "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
