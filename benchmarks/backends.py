"""Inductor against eager for one stage's forward (eval) and forward+backward (train).

    python benchmarks/backends.py --workload mlp block --rounds 5 --json out/backends.json

Each workload is one stage module run through `lightning_pipe.backends` exactly as a stage worker
runs it (a `StageExecutable` per backend and mode). The first call of each backend is timed
separately (it compiles); then the backends run in alternating rounds so machine drift hits both
alike, and the medians are compared. ``--pipeline`` adds a 2-stage `Pipeline.train_step` per
backend. Prints a table, and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe.backends import build_executables, resolve_backends  # noqa: E402
from lightning_pipe.pipeline.pipeline import Pipeline  # noqa: E402

BACKENDS = ("eager", "inductor")


class Block(nn.Module):
    """A pre-LN decoder block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)  # (b, t, c) each
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def workload(name: str) -> tuple[nn.Sequential, torch.Tensor]:
    """A stage module and one microbatch for it."""
    torch.manual_seed(0)
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(1024, 1024), nn.GELU()]
        return nn.Sequential(*layers), torch.randn(64, 1024)
    if name == "block":
        return nn.Sequential(Block(), Block()), torch.randn(4, 128, 256)
    if name == "pointwise":  # many small elementwise ops: where fusion pays most
        layers = []
        for _ in range(6):
            layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU(), nn.Dropout(0.0)]
        return nn.Sequential(*layers), torch.randn(256, 256)
    raise SystemExit(f"unknown workload {name!r}; available: mlp, block, pointwise")


def timed(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call."""
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) * 1e3 / iters


def stage_calls(module: nn.Module, x: torch.Tensor, backend: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(train step, eval step) of one stage on ``backend``, as the stage worker would run them."""
    shard = type("Shard", (), {"index": 0, "module": module})()
    executables, _ = build_executables([shard], resolve_backends(backend, 1), {0: torch.device("cpu")})
    train_exe, eval_exe = executables[(0, "train")], executables[(0, "eval")]

    def train() -> None:
        leaf = x.detach().requires_grad_(True)
        train_exe(leaf).sum().backward()

    def evaluate() -> None:
        with torch.no_grad():
            eval_exe(x)

    return train, evaluate


def bench_stage(name: str, rounds: int, iters: int) -> list[dict[str, Any]]:
    module, x = workload(name)
    calls = {b: stage_calls(module, x, b) for b in BACKENDS}
    first: dict[tuple[str, str], float] = {}
    for b in BACKENDS:
        first[(b, "train")] = timed(calls[b][0], 1)
        first[(b, "eval")] = timed(calls[b][1], 1)
        for fn in calls[b]:  # settle: a second call may still specialise (e.g. dynamic shapes)
            fn()
    samples: dict[tuple[str, str], list[float]] = {(b, m): [] for b in BACKENDS for m in ("train", "eval")}
    for r in range(rounds):
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        for b in order:
            samples[(b, "train")].append(timed(calls[b][0], iters))
            samples[(b, "eval")].append(timed(calls[b][1], iters))
    rows = []
    for mode in ("train", "eval"):
        eager = statistics.median(samples[("eager", mode)])
        for b in BACKENDS:
            ms = statistics.median(samples[(b, mode)])
            rows.append({
                "workload": name, "what": f"stage {mode}", "backend": b, "ms": ms,
                "min_ms": min(samples[(b, mode)]), "max_ms": max(samples[(b, mode)]),
                "first_call_s": first[(b, mode)] / 1e3, "speedup_vs_eager": eager / ms,
            })  # fmt: skip
    return rows


def bench_pipeline(name: str, rounds: int, iters: int, microbatches: int = 4) -> list[dict[str, Any]]:
    """A 2-stage `Pipeline` training step per backend (the same weights for both)."""
    module, x = workload(name)
    batch = x.repeat(microbatches, *([1] * (x.dim() - 1)))
    target = torch.randn_like(module(batch[:1]).expand(batch.shape[0], *([-1] * (x.dim() - 1))))
    pipes = {
        b: Pipeline(module, stages=2, partition="uniform", backend=b, checkpoint="never", timeout=900).start()
        for b in BACKENDS
    }
    try:
        step = {b: (lambda p=p: p.train_step(batch, target, F.mse_loss, microbatches)) for b, p in pipes.items()}
        first = {b: timed(step[b], 1) / 1e3 for b in BACKENDS}
        samples: dict[str, list[float]] = {b: [] for b in BACKENDS}
        for r in range(rounds):
            for b in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                samples[b].append(timed(step[b], iters))
    finally:
        for p in pipes.values():
            p.close()
    eager = statistics.median(samples["eager"])
    return [
        {
            "workload": name,
            "what": f"2-stage train_step ({microbatches} mb)",
            "backend": b,
            "ms": statistics.median(samples[b]),
            "min_ms": min(samples[b]),
            "max_ms": max(samples[b]),
            "first_call_s": first[b],
            "speedup_vs_eager": eager / statistics.median(samples[b]),
        }  # fmt: skip
        for b in BACKENDS
    ]


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'workload':<10} {'what':<28} {'backend':<9} {'ms':>9} {'min':>9} {'max':>9}"
    head += f" {'1st call s':>10} {'vs eager':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:<10} {r['what']:<28} {r['backend']:<9} {r['ms']:>9.3f} {r['min_ms']:>9.3f} "
            f"{r['max_ms']:>9.3f} {r['first_call_s']:>10.2f} {r['speedup_vs_eager']:>7.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["mlp", "block"], help="mlp, block, pointwise")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10, help="calls per round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--pipeline", action="store_true", help="also time a 2-stage Pipeline.train_step")
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for name in args.workload:
        rows += bench_stage(name, args.rounds, args.iters)
        if args.pipeline:
            rows += bench_pipeline(name, args.rounds, max(1, args.iters // 4))
    print(table(rows))
    meta = {"torch": torch.__version__, "threads": args.threads, "rounds": args.rounds, "iters": args.iters}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
