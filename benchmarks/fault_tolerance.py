"""What a lost process costs a fault-tolerant run (``PipeStrategy(fault_tolerance=...)``, torchft): 2 replica groups
x 2 stages on one machine, one process of group 1 SIGKILLed mid-run.

Each cycle starts a torchft Lighthouse in this process and two torchruns of ``tests/ft_train.py`` (``--max-restarts
1``; 2 processes each, gloo), kills global rank 1 of group 1 (a serving stage process) after step ``--kill-at``, and
reads the step logs:

- **kill -> survivors' next step**: from the SIGKILL to the end of group 0's first step without group 1 in its quorum
  (the step under way fails its all-reduce and is not committed; the Lighthouse drops group 1 when its heartbeats
  stop, 1 s here);
- **restart -> first step in the quorum**: from the start of the restarted interpreter (the earliest of group 1's
  two) to the end of its first step with both groups in the quorum (imports, the torchrun world, the quorum, healing
  from group 0);
- **throughput degraded / healthy**: group 0's steps per second, and samples per second of the whole run (groups in
  the quorum x batch), while alone against while both groups train.

Steps run as fast as they go (no sleeps), so ``--steps`` must leave the restarted group time to come back (on one
machine the restarting group's imports compete with the survivors for the same CPUs: the degraded rate counts that).

    python benchmarks/fault_tolerance.py --cycles 3        # writes benchmarks/results/fault_tolerance.json
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from ft_launch import FtRun, run_groups  # noqa: E402
from ft_train import BATCH  # noqa: E402


def rate(steps: list[dict[str, Any]]) -> float | None:
    """Steps per second over consecutive logged steps (None: fewer than 3)."""
    if len(steps) < 3:
        return None
    return (len(steps) - 1) / (steps[-1]["t"] - steps[0]["t"])


def measure(run: FtRun) -> dict[str, Any]:
    assert run.killed_at is not None, "the kill never came: " + run.output[-2000:]
    kill = run.killed_at
    live = run.steps[0]
    after = [s for s in live if s["t"] > kill]
    restarted = [p["started"] for p in run.procs if p["group"] == 1 and p["attempt"] >= 1]
    back = [s for s in run.steps[1] if s["attempt"] >= 1 and s["groups"] == 2]
    rejoined = back[0]["t"] if back else None
    healthy = [s for s in live if s["t"] < kill][5:]  # after the first steps (the first quorums, warm-up)
    healthy_after = [s for s in live if rejoined is not None and s["t"] > rejoined + 1.0]
    alone = [s for s in after if s["groups"] == 1]
    degraded = alone[1:]  # from the first step the survivors ran alone
    healthy_rate = statistics.median([r for r in (rate(healthy), rate(healthy_after)) if r is not None])
    degraded_rate = rate(degraded)
    return {
        "ok": run.ok,
        "kill_to_survivors_next_step_s": round(alone[0]["t"] - kill, 3) if alone else None,
        "restart_to_first_step_in_quorum_s": round(rejoined - min(restarted), 3) if restarted and rejoined else None,
        "kill_to_restarted_process_start_s": round(min(restarted) - kill, 3) if restarted else None,
        "healthy_steps_per_s": round(healthy_rate, 2),
        "degraded_steps_per_s": round(degraded_rate, 2) if degraded_rate else None,
        "healthy_samples_per_s": round(healthy_rate * 2 * BATCH, 1),
        "degraded_samples_per_s": round(degraded_rate * BATCH, 1) if degraded_rate else None,
        "degraded_over_healthy_samples": round(degraded_rate * BATCH / (healthy_rate * 2 * BATCH), 3)
        if degraded_rate
        else None,  # fmt: skip
        "steps_alone": len(alone),
        "final_steps": [run.steps[g][-1]["step"] if run.steps[g] else None for g in (0, 1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--kill-at", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "fault_tolerance.json")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM ends the launches too (their `finally`)
    cycles = []
    for cycle in range(args.cycles):
        with tempfile.TemporaryDirectory() as folder:
            run = run_groups(Path(folder), ["--steps", str(args.steps)], kill=(1, 1, args.kill_at),
                             timeout=args.timeout)  # fmt: skip
            result = measure(run)
        print(f"cycle {cycle}: {json.dumps(result)}", flush=True)
        cycles.append(result)
    keys = [k for k in cycles[0] if k.endswith(("_s", "_per_s", "_samples"))]
    summary = {k: statistics.median([c[k] for c in cycles if c[k] is not None] or [float("nan")]) for k in keys}
    report = {
        "setup": f"2 replica groups x 2 stages (tests/ft_train.py: MLP 8-16-16-4, batch {BATCH} per group, 2 "
        f"microbatches), gloo on one CPU machine, {args.steps} steps, SIGKILL of group 1's rank 1 after step "
        f"{args.kill_at}; Lighthouse heartbeat timeout 1 s",
        "median": summary,
        "cycles": cycles,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
