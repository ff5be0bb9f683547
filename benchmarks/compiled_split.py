"""What splitting a compiled stage's backward into I and W costs, and what compiling gains against eager.

    python benchmarks/compiled_split.py --width 256 --rows 512 --blocks 2 --pairs 20 [--threads 1]
    python benchmarks/compiled_split.py --model gpt --blocks 2 --pairs 20 --threads 1
    python benchmarks/compiled_split.py --model gpt --stage last --pairs 20 --threads 1

A stage (``--model mlp``: transformer-style MLP blocks, LayerNorm, Linear 4x, GELU, Linear, residual;
``--model gpt``: ``--blocks`` decoder blocks of the `workloads` gpt at a pipeline microbatch, 4 x 128 tokens, as a
middle stage holds them; ``--stage first`` / ``last``: the first or the last stage of the 2-stage gpt pipeline, the
embedding and 4 blocks, or 4 blocks and the head) run five ways: eager with one ordinary backward; eager with its
backward split as the eager split-backward schedules split it (`backward_input` then `backward_weight`, over the
retained autograd graph); compiled as torch.compile compiles it (one backward graph); and as the ``inductor`` stage
backend compiles it through the `StageExecutable` the pipeline runs (its backward split into an input-gradient graph
and a weight-gradient graph, beside the whole backward), that last one also with a plain backward (a ``B`` action:
the whole backward graph). Each round times each of them once (forward, backward or I, W),
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
from torch._dynamo.utils import counters

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.workloads import BALANCES, D_MODEL, SEQ, VOCAB, build_model, stage_module  # noqa: E402
from lightning_pipe.backends import StageTrace  # noqa: E402
from lightning_pipe.backends.config import resolve_backends  # noqa: E402
from lightning_pipe.backends.executable import StageExecutable  # noqa: E402
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


def stage_and_input(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The stage, its input and the gradient of its output."""
    torch.manual_seed(0)
    if args.model == "gpt" and args.stage != "middle":  # a stage of the 2-stage pipeline, as schedules.py cuts it
        model = build_model("gpt")
        index = 0 if args.stage == "first" else 1
        stage = stage_module(model, BALANCES[("gpt", 2)], index)
        if index == 0:  # token ids: no input gradient, so no I (W runs the whole backward)
            return stage, torch.randint(0, VOCAB, (4, SEQ)), torch.randn(4, SEQ, D_MODEL)
        return stage, torch.randn(4, SEQ, D_MODEL), torch.randn(4, SEQ, VOCAB)
    if args.model == "gpt":  # the blocks after the embedding, as a middle stage holds them
        model = build_model("gpt")
        stage = stage_module(model, [1, args.blocks, len(model) - 1 - args.blocks], 1)
        return stage, torch.randn(4, SEQ, D_MODEL), torch.randn(4, SEQ, D_MODEL)
    x = torch.randn(args.rows, args.width)
    return nn.Sequential(*[Block(args.width) for _ in range(args.blocks)]), x, torch.randn_like(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--width", type=int, default=256, help="mlp only")
    parser.add_argument("--rows", type=int, default=512, help="mlp only")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--stage", choices=("middle", "first", "last"), default="middle", help="gpt only")
    parser.add_argument("--pairs", type=int, default=20, help="rounds")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stage, x, g = stage_and_input(args)
    params = list(stage.parameters())
    ordinary = torch.compile(stage, backend="inductor", fullgraph=True)
    trace = StageTrace(1)
    chain = resolve_backends("inductor", 2).chain(1, "train")  # inductor, then eager
    split = StageExecutable(stage, 1, "train", chain, trace, torch.device("cpu"))  # what a pipeline's stage runs

    def leaf_of(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_() if x.is_floating_point() else x

    def whole(forward: Callable[[torch.Tensor], torch.Tensor]) -> Timed:
        leaf = leaf_of(x)
        start = time.perf_counter()
        out = forward(leaf)
        middle = time.perf_counter()
        out.backward(g)
        return middle - start, time.perf_counter() - middle, 0.0

    def halves(forward: Callable[[torch.Tensor], torch.Tensor]) -> Timed:
        leaf = leaf_of(x)
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
        "compiled split B": lambda: whole(split),  # a B action (1f1b, dualpipev's main phase): the whole graph
    }
    stage.zero_grad(set_to_none=True)
    ways["compiled"]()
    want = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    errors = []
    for name in ("compiled split", "compiled split B"):
        stage.zero_grad(set_to_none=True)
        ways[name]()
        errors.append(max((p.grad - w).abs().max().item() for p, w in zip(params, want, strict=True)))  # type: ignore[operator]
    for _ in range(3):  # warm up all
        for way in ways.values():
            way()
    frames = counters["frames"]["ok"]  # frames Dynamo compiled: a recompile in the rounds would add one
    samples: dict[str, list[Timed]] = {name: [] for name in ways}
    for r in range(args.pairs):
        for name in list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]:
            samples[name].append(ways[name]())
    stage.zero_grad(set_to_none=True)
    ms = 1e3
    shape = "x".join(map(str, x.shape))
    what = f"{args.blocks} blocks" if args.model == "mlp" or args.stage == "middle" else f"{args.stage} stage of 2"
    print(f"stage: {args.model}, {what}, input {shape}; threads {torch.get_num_threads()}")
    print(f"compiled graphs of the split stage: {trace.graphs['train']}; backends that ran it: {trace.runs['train']}")
    print(f"frames Dynamo compiled during the {args.pairs} rounds (recompiles): {counters['frames']['ok'] - frames}")
    print(f"max |grad difference| against compiled: compiled split {errors[0]:.2e}, compiled split B {errors[1]:.2e}")
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
