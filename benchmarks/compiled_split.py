"""What splitting a compiled stage's backward into I and W costs, and what compiling gains against eager.

    python benchmarks/compiled_split.py --width 256 --rows 512 --blocks 2 --pairs 20 [--threads 1]
    python benchmarks/compiled_split.py --model gpt --blocks 2 --pairs 20 --threads 1

A stage (``--model mlp``: transformer-style MLP blocks, LayerNorm, Linear 4x, GELU, Linear, residual;
``--model gpt``: ``--blocks`` decoder blocks of the `workloads` gpt at a pipeline microbatch, 4 x 128 tokens) run
five ways: eager with one ordinary backward; eager with its backward split as the eager split-backward schedules
split it (`backward_input` then `backward_weight`, over the retained autograd graph); compiled as torch.compile
compiles it (one backward graph); and as the ``inductor`` stage backend compiles it (its backward split into an
input-gradient graph and a weight-gradient graph), that last one also with a plain backward (a ``B`` action: both
graphs at once). Each round times each of them once (forward, backward or I, W),
alternating; it prints the medians, the ratio (I + W) / backward of the compiled stage, the compiled split's step
against the eager split's (what a zero-bubble schedule's stage gains from inductor), and checks that the compiled
split gives the ordinary gradients.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.workloads import D_MODEL, SEQ, build_model, stage_module  # noqa: E402
from lightning_pipe.backends import InductorCompiler, OpCounter, StageTrace  # noqa: E402
from lightning_pipe.backends.ops import OpTable  # noqa: E402
from lightning_pipe.engine.split_backward import backward_input, backward_weight  # noqa: E402

Timed = tuple[float, float, float]  # forward, backward (or I), W seconds


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def stage_and_input(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if args.model == "gpt":  # the blocks after the embedding, as a middle stage holds them
        model = build_model("gpt")
        stage = stage_module(model, [1, args.blocks, len(model) - 1 - args.blocks], 1)
        return stage, torch.randn(4, SEQ, D_MODEL)
    return nn.Sequential(*[Block(args.width) for _ in range(args.blocks)]), torch.randn(args.rows, args.width)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--width", type=int, default=256, help="mlp only")
    parser.add_argument("--rows", type=int, default=512, help="mlp only")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=20, help="rounds")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stage, x = stage_and_input(args)
    g = torch.randn_like(x)
    params = list(stage.parameters())
    ordinary = torch.compile(stage, backend="inductor", fullgraph=True)
    trace = StageTrace(1)
    compiler = InductorCompiler(stage, OpTable([]), OpCounter(), "inductor", "bench", {})
    compiler.attach(trace, "train")
    split = compiler.build()

    def whole(forward: Callable[[torch.Tensor], torch.Tensor]) -> Timed:
        leaf = x.detach().requires_grad_()
        start = time.perf_counter()
        out = forward(leaf)
        middle = time.perf_counter()
        out.backward(g)
        return middle - start, time.perf_counter() - middle, 0.0

    def halves(forward: Callable[[torch.Tensor], torch.Tensor]) -> Timed:
        leaf = x.detach().requires_grad_()
        start = time.perf_counter()
        out = forward(leaf)
        forwarded = time.perf_counter()
        _, work = backward_input([out], [g], [leaf], params)
        middle = time.perf_counter()
        backward_weight(work)
        return forwarded - start, middle - forwarded, time.perf_counter() - middle

    ways: dict[str, Callable[[], Timed]] = {
        "eager": lambda: whole(stage),
        "eager split": lambda: halves(stage),
        "compiled": lambda: whole(ordinary),
        "compiled split": lambda: halves(split),
        "compiled split B": lambda: whole(split),  # a B action (1f1b, dualpipev's main phase): I and W graphs at once
    }
    stage.zero_grad(set_to_none=True)
    ways["compiled"]()
    want = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    stage.zero_grad(set_to_none=True)
    ways["compiled split"]()
    error = max((p.grad - w).abs().max().item() for p, w in zip(params, want, strict=True))  # type: ignore[operator]
    for _ in range(3):  # warm up all
        for way in ways.values():
            way()
    samples: dict[str, list[Timed]] = {name: [] for name in ways}
    for r in range(args.pairs):
        for name in list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]:
            samples[name].append(ways[name]())
    stage.zero_grad(set_to_none=True)
    ms = 1e3
    shape = "x".join(map(str, x.shape))
    print(f"stage: {args.model}, {args.blocks} blocks, input {shape}; threads {torch.get_num_threads()}")
    print(f"compiled graphs of the split stage: {trace.graphs['train']}")
    print(f"max |grad difference| compiled split vs compiled: {error:.2e}")
    print(f"{'':16} {'forward':>8} {'bwd / I':>8} {'W':>8} {'step':>8}  (ms, medians of {args.pairs})")
    steps = {name: [sum(t) for t in got] for name, got in samples.items()}
    for name, got in samples.items():
        f, b, w = (statistics.median(column) * ms for column in zip(*got, strict=True))
        print(f"{name:16} {f:8.2f} {b:8.2f} {w:8.2f} {statistics.median(steps[name]) * ms:8.2f}")
    compiled_bwd = [t[1] for t in samples["compiled"]]
    split_bwd = [t[1] + t[2] for t in samples["compiled split"]]
    ratios = [s / c for s, c in zip(split_bwd, compiled_bwd, strict=True)]
    print(f"(I + W) / backward of the compiled stage, median of the rounds: {statistics.median(ratios):.3f}")
    gain = [e / c for e, c in zip(steps["eager split"], steps["compiled split"], strict=True)]
    print(f"eager split step / compiled split step, median of the rounds: {statistics.median(gain):.3f}")
    as_b = [s[1] / c[1] for s, c in zip(samples["compiled split B"], samples["compiled"], strict=True)]
    print(f"B on the split stage / one compiled backward, median of the rounds: {statistics.median(as_b):.3f}")
    as_b = [s[1] / e[1] for s, e in zip(samples["compiled split B"], samples["eager"], strict=True)]
    print(f"B on the split stage / eager backward, median of the rounds: {statistics.median(as_b):.3f}")


if __name__ == "__main__":
    main()
