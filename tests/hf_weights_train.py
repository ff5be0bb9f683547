"""A HuggingFace GPT-2 trained from pretrained weights in safetensors, built on meta, 1 x 4 in launched mode.

``python hf_weights_train.py --weights FOLDER --report OUT [--plain] [--schedule zbv --devices 2 --virtual-stages 2
--microbatches 4]``: the model of ``examples/causal_lm.py``
from ``save_pretrained`` weights; every process writes its losses (the coordinator's), the keys its stage
read from the weights and the keys its stage holds. ``--plain`` trains the same model loaded with
``from_pretrained`` in a plain Trainer, on the rows in the order Lightning's distributed sampler gives them.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import transformers
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from causal_lm import CausalLM, collate, labelled_tokens, sums  # noqa: E402

from lightning_pipe import PipeStrategy  # noqa: E402


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def main(argv: list[str] | None = None) -> None:
    """Train as the command line (or ``argv``) says; ``--plain`` runs in the caller's process too."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--devices", type=int, default=4, help="processes: one pipeline rank each")
    parser.add_argument("--virtual-stages", type=int, default=1, help="stages per process")
    parser.add_argument("--microbatches", type=int, default=2)
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    L.seed_everything(0, verbose=False)
    rows = sums(8 * args.steps)
    losses = Losses()
    common: dict[str, Any] = dict(
        accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )  # fmt: skip
    if args.plain:
        trainer = L.Trainer(devices=1, use_distributed_sampler=False, **common)
        model = CausalLM()
        model.model = transformers.GPT2LMHeadModel.from_pretrained(args.weights)
        loader = DataLoader(rows, batch_size=8, collate_fn=collate, sampler=DistributedSampler(rows, 1, 0, seed=0))
    else:
        strategy = PipeStrategy(
            stages=args.devices * args.virtual_stages, virtual_stages=args.virtual_stages, schedule=args.schedule,
            microbatches=args.microbatches, weights=args.weights, microbatch_weight=labelled_tokens, module="model",
        )  # fmt: skip
        trainer = L.Trainer(devices=args.devices, strategy=strategy, **common)
        with trainer.init_module(empty_init=True):
            model = CausalLM()
        loader = DataLoader(rows, batch_size=8, collate_fn=collate)
    trainer.fit(model, loader)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    report: dict[str, Any] = {"losses": losses.losses}
    worker = getattr(getattr(trainer.strategy, "stage", None), "worker", None)
    if worker is not None:
        report["read"] = sorted(worker.materialized.loaded)
        report["holds"] = sorted(k for shard in worker.shards.values() for k in shard.module.state_dict())
    Path(args.report).mkdir(parents=True, exist_ok=True)
    (Path(args.report) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    main()
