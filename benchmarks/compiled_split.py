"""What splitting a compiled stage's backward into I and W costs: I + W against one ordinary compiled backward.

    python benchmarks/compiled_split.py --width 256 --rows 512 --blocks 2 --pairs 20 [--threads 1]

A stage of transformer-style MLP blocks (LayerNorm, Linear 4x, GELU, Linear, residual) compiled twice with
inductor: as torch.compile compiles it (one backward graph) and as the ``inductor`` stage backend does (its
backward split into an input-gradient graph and a weight-gradient graph). Each pair times one ordinary
backward and one I followed by W on the same input, alternating; it prints the medians and the ratio
(I + W) / backward, and checks both give the same gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lightning_pipe.backends import InductorCompiler, OpCounter, StageTrace
from lightning_pipe.backends.ops import OpTable
from lightning_pipe.engine.split_backward import backward_input, backward_weight


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stage = nn.Sequential(*[Block(args.width) for _ in range(args.blocks)])
    x, g = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)
    ordinary = torch.compile(stage, backend="inductor", fullgraph=True)
    trace = StageTrace(1)
    compiler = InductorCompiler(stage, OpTable([]), OpCounter(), "inductor", "bench", {})
    compiler.attach(trace, "train")
    split = compiler.build()

    def whole() -> tuple[float, float]:
        leaf = x.detach().requires_grad_()
        out = ordinary(leaf)
        start = time.perf_counter()
        out.backward(g)
        return time.perf_counter() - start, 0.0

    def halves() -> tuple[float, float]:
        leaf = x.detach().requires_grad_()
        out = split(leaf)
        start = time.perf_counter()
        _, work = backward_input([out], [g], [leaf], stage.parameters())
        middle = time.perf_counter()
        backward_weight(work)
        return middle - start, time.perf_counter() - middle

    stage.zero_grad(set_to_none=True)
    whole()
    want = [p.grad.clone() for p in stage.parameters()]  # type: ignore[union-attr]
    stage.zero_grad(set_to_none=True)
    halves()
    error = max((p.grad - w).abs().max().item() for p, w in zip(stage.parameters(), want, strict=True))  # type: ignore[operator]
    for _ in range(3):  # warm up both
        whole()
        halves()
    plain, inputs, weights = [], [], []
    for _ in range(args.pairs):
        plain.append(whole()[0])
        i, w = halves()
        inputs.append(i)
        weights.append(w)
    ratios = [(i + w) / p for i, w, p in zip(inputs, weights, plain, strict=True)]
    ms = 1e3
    print(f"stage: {args.blocks} blocks of width {args.width}, {args.rows} rows; threads {torch.get_num_threads()}")
    print(f"compiled graphs of the split stage: {trace.graphs['train']}")
    print(f"max |grad difference| split vs ordinary: {error:.2e}")
    print(f"ordinary compiled backward: {statistics.median(plain) * ms:.2f} ms (median of {args.pairs})")
    print(
        f"I: {statistics.median(inputs) * ms:.2f} ms, W: {statistics.median(weights) * ms:.2f} ms, "
        f"I + W: {statistics.median([i + w for i, w in zip(inputs, weights, strict=True)]) * ms:.2f} ms"
    )
    print(f"(I + W) / backward, median of the pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
