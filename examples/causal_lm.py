"""Train a small causal language model (HuggingFace GPT-2 built from a config) with PipeStrategy, on the
GPU where there is one (both stages on it), else on CPU.

    python examples/causal_lm.py                 # 2 stages, 4 microbatches, 1F1B: about a minute on CPU
    python examples/causal_lm.py --steps 40      # fewer steps
    python examples/causal_lm.py --no-pipe       # the same LightningModule without the strategy
    python examples/causal_lm.py --accelerator cpu   # on CPU whatever the machine has
    python examples/causal_lm.py --devices 2     # one stage per GPU: stage 0 in a worker process, the last here

The corpus is synthetic (sums such as "57 + 1024 = 1081", one character a token), so nothing is
downloaded. Rows have different lengths: a batch is right-padded, with -100 labels on the padding,
as HuggingFace's data collators make them. The model's loss averages over the labelled tokens, so
`PipeStrategy(microbatch_weight=...)` weights each microbatch by its labelled tokens: with weights by
rows (the default) a piped step would not be the unsplit step. The script checks that first.
"""

from __future__ import annotations

import argparse
import copy
import random
from typing import Any

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader

from lightning_pipe import PipeStrategy

VOCAB = ["<pad>", "<eos>", *"0123456789 +="]
PAD, EOS = 0, 1


def sums(rows: int, seed: int = 0) -> list[list[int]]:
    """Token ids of ``rows`` sums of numbers with 1 to 4 digits, each ended by <eos>."""
    rng = random.Random(seed)
    texts = []
    for _ in range(rows):
        a, b = (rng.randrange(10 ** rng.randint(0, 4)) for _ in range(2))
        texts.append(f"{a} + {b} = {a + b}")
    return [[VOCAB.index(c) for c in text] + [EOS] for text in texts]


def collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-pad a batch; labels are the ids, -100 on the padding (what HF's collators return)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    labels = torch.full((len(rows), width), -100)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = labels[i, : len(row)] = torch.tensor(row)
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


def labelled_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a causal LM's loss averages over: the model shifts the labels by one, so the first never counts."""
    return (batch["labels"][:, 1:] != -100).sum()


class CausalLM(L.LightningModule):
    """An ordinary LightningModule around a HF causal LM: nothing here knows about pipelines."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = transformers.GPT2Config(
            vocab_size=len(VOCAB), n_positions=32, n_embd=64, n_layer=4, n_head=4, use_cache=False,
            bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
            # no dropout, so that one piped step can be compared with one unsplit step exactly
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss  # the mean over the labelled tokens of the batch
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class LossLog(L.Callback):
    """Prints the mean training loss every ``every`` steps."""

    def __init__(self, every: int) -> None:
        self.every, self.window, self.means = every, [], []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.window.append(float(outputs["loss"]))
        if len(self.window) == self.every:
            self.means.append(sum(self.window) / len(self.window))
            print(f"step {trainer.global_step:4d}: train loss {self.means[-1]:.4f}")
            self.window = []


class Where:
    """Where a run trains: ``accelerator`` (``"auto"``: cuda where torch sees a GPU, else cpu) and, for piped runs,
    ``devices``: 1, every stage on that one device as threads of this process; more, one stage per device, the
    last in this process and the others each in a worker process (``transport="rpc"``: the embedding and the LM
    head share a weight, which threads may only share on one device; in processes each holder has a copy, given
    the summed gradients)."""

    def __init__(self, accelerator: str = "auto", devices: int = 1) -> None:
        if accelerator == "auto":
            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        self.accelerator, self.devices = accelerator, devices

    def strategy(self, stages: int, microbatches: int, schedule: str, weight: Any = None) -> PipeStrategy:
        gpu = self.accelerator in ("cuda", "gpu")
        devices = [f"cuda:{s % self.devices}" if gpu else "cpu" for s in range(stages)]
        transport = "local" if self.devices == 1 else "rpc"
        return PipeStrategy(
            stages=stages, microbatches=microbatches, schedule=schedule, microbatch_weight=weight,
            devices=devices, transport=transport,
        )  # fmt: skip


def fit(
    module: CausalLM,
    loader: DataLoader,
    strategy: Any,
    steps: int,
    callbacks: list[Any] | None = None,
    where: Where | None = None,
) -> None:
    where = where or Where("cpu")
    trainer = L.Trainer(
        accelerator=where.accelerator, devices=1, strategy=strategy, max_steps=steps, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(module, loader)


class FirstStep(L.Callback):
    """The loss and the gradients of the first training step."""

    def __init__(self) -> None:
        self.loss, self.grads = float("nan"), []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.grads:
            self.grads = [p.grad.clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.loss = float(outputs["loss"])


def one_step_check(stages: int, microbatches: int, schedule: str, where: Where) -> dict[str, tuple[float, float]]:
    """One step's loss and largest gradient difference to the unsplit step: with ``microbatch_weight``, by rows."""
    L.seed_everything(0, verbose=False)
    model = CausalLM()
    loader = DataLoader(sums(16, seed=1), batch_size=16, collate_fn=collate)
    steps = {name: FirstStep() for name in ("unsplit", "microbatch_weight", "rows")}
    fit(copy.deepcopy(model), loader, "auto", steps=1, callbacks=[steps["unsplit"]], where=where)
    for name, weight in (("microbatch_weight", labelled_tokens), ("rows", None)):
        strategy = where.strategy(stages, microbatches, schedule, weight)
        fit(copy.deepcopy(model), loader, strategy, steps=1, callbacks=[steps[name]], where=where)
    want = steps["unsplit"].grads
    return {
        name: (step.loss, max((g - w).abs().max().item() for g, w in zip(step.grads, want, strict=True)))
        for name, step in steps.items()
    }


def train(
    pipe: bool = True,
    stages: int = 2,
    microbatches: int = 4,
    schedule: str = "1f1b",
    steps: int = 200,
    accelerator: str = "auto",
    devices: int = 1,
) -> dict[str, Any]:
    """Check one step against the unsplit model, then train; returns the check and the printed losses."""
    where = Where(accelerator, devices)
    check: dict[str, tuple[float, float]] = {}
    if pipe:
        # on one device: Lightning sees the stages' gradients only where they share the module's parameters
        check = one_step_check(stages, microbatches, schedule, Where(where.accelerator))
        print(f"one step on a padded batch of 16 rows, {microbatches} microbatches:")
        for name, (loss, grad) in check.items():
            versus = f", largest gradient difference to the unsplit step {grad:.1e}" if name != "unsplit" else ""
            print(f"  {name:>17}: loss {loss:.6f}{versus}")
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(sums(4096), batch_size=16, shuffle=True, collate_fn=collate, generator=generator)
    log = LossLog(every=max(1, steps // 10))
    strategy: Any = where.strategy(stages, microbatches, schedule, labelled_tokens) if pipe else "auto"
    fit(CausalLM(), loader, strategy, steps, [log], where)
    return {"check": check, "losses": log.means}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-pipe", action="store_true", help="train without PipeStrategy")
    parser.add_argument("--accelerator", default="auto", help="auto (cuda where a GPU is, else cpu), cuda or cpu")
    parser.add_argument("--devices", type=int, default=1, help="1: stages share one device; N: one stage per device")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    train(not args.no_pipe, args.stages, args.microbatches, args.schedule, args.steps, args.accelerator, args.devices)


if __name__ == "__main__":
    main()
