"""Record and draw the pipeline timeline of a few training steps through a Lightning Trainer.

    python benchmarks/timeline.py --workload mlp --stages 4 --schedule 1f1b --out docs/timeline-4stage-1f1b.png

Writes a Chrome trace (``.json`` beside the PNG; open it in https://ui.perfetto.dev) and a PNG Gantt
chart of the fastest recorded step, and prints the measured bubble beside the schedule's.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks.workloads import WORKLOADS, build_model, loss_fn, make_batches  # noqa: E402
from lightning_pipe import PipeStrategy, PipeTrace  # noqa: E402
from lightning_pipe.pipeline.timeline import render_png, write_chrome_trace  # noqa: E402


class Net(L.LightningModule):
    def __init__(self, workload: str) -> None:
        super().__init__()
        self.model = build_model(workload)
        self.loss = loss_fn(workload)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=6, help="training steps; steps 1.. are recorded")
    parser.add_argument("--out", default="pipeline_timeline.png")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    out = Path(args.out)
    scratch = tempfile.TemporaryDirectory()  # the callback's own file of every recorded step
    trace = PipeTrace(Path(scratch.name) / "steps.json", steps=range(1, args.steps))
    strategy = PipeStrategy(
        stages=args.stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        partition=WORKLOADS[args.workload].balance(args.stages),
        checkpoint="never",
    )
    batches = make_batches(args.workload)
    loader = torch.utils.data.DataLoader([batches[i % len(batches)] for i in range(args.steps)], batch_size=None)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_epochs=1,
        callbacks=[trace],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(args.workload), loader)
    best = min(trace.timelines, key=lambda t: t.duration)
    for timeline in trace.timelines:
        print(timeline.summary())
    out.parent.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(out.with_suffix(".json"), [best])
    render_png(out, [best])
    scratch.cleanup()
    print(f"fastest step {best.step} drawn to {out} (trace: {out.with_suffix('.json')})")


if __name__ == "__main__":
    main()
