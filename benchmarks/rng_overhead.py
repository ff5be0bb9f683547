"""What routing a stage's random draws to its own generators costs (lightning_pipe.rng.RandomRouting).

    python benchmarks/rng_overhead.py

Prints the time of one small torch call bare and under the mode, and of a transformer block's forward
(the benchmark's ``gpt`` block size) without and with dropout, bare and routed. Stages whose modules
draw nothing never run under the mode; these numbers are what a stage with dropout pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_pipe.rng import RandomRouting, StageGenerators


def best_of(fn: Callable[[], object], repeats: int, rounds: int = 5) -> float:
    """Fastest of ``rounds`` averages over ``repeats`` calls, in microseconds per call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        times.append((time.perf_counter() - start) / repeats * 1e6)
    return min(times)


def compare(name: str, fn: Callable[[], object], repeats: int) -> None:
    bare = best_of(fn, repeats)
    with RandomRouting(StageGenerators(0, 0, "cpu")):
        routed = best_of(fn, repeats)
    extra = routed - bare
    print(f"{name:42s} bare {bare:10.1f} us   routed {routed:10.1f} us   +{extra:8.1f} us ({extra / bare:+.1%})")


def main() -> None:
    torch.set_num_threads(1)
    small = torch.randn(8, 8)
    compare("torch.add on 8x8 (per torch call)", lambda: torch.add(small, small), 20000)
    x = torch.randn(8, 64, 256)
    for p in (0.0, 0.1):
        block = nn.TransformerEncoderLayer(256, 4, 1024, dropout=p, batch_first=True)
        compare(f"TransformerEncoderLayer(256) fwd, dropout={p}", lambda block=block: block(x), 30)


if __name__ == "__main__":
    main()
