"""The model and fits of tests/test_init_accounting.py, in its process (local mode) and in a launched run of 2
processes (``python tests/forked_ranks.py --nproc 2 tests/init_accounting.py --out D --ckpt F``).

A small causal language model whose tensors are of every kind a meta build must account for: an embedding whose
weight the head shares (tied, the two in different stages), an integer buffer of positions, a ``uint8`` buffer that
initialisation sets to zeros, and a non-persistent ``bool`` causal mask made in ``__init__`` by a layer whose
``reset_parameters()`` sets only its weight (``broken="mask"``; ``broken="positions"``: one that sets only half of
the positions). A launched run does its cases one after the other in the same processes and writes what each did
to ``<out>/<case>-rank<g>.json`` (its error, or its losses) and its real tensors as the fit starts to
``<out>/<case>-rank<g>.pt``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pipe import PipeStrategy  # noqa: E402

VOCAB, WIDTH, LENGTH, BATCH = 16, 8, 6, 8
QUIET: dict[str, Any] = dict(
    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)  # fmt: skip


class Embed(nn.Module):
    """Token embedding plus positions (an ``int64`` buffer, as ids index an embedding) and ``uint8`` flags that
    initialisation sets to zeros (tokens never dropped)."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.where = nn.Embedding(LENGTH, WIDTH)
        self.register_buffer("positions", torch.arange(LENGTH))
        self.register_buffer("dropped", torch.zeros(LENGTH, dtype=torch.uint8))

    def reset_parameters(self) -> None:
        half = LENGTH // 2 if self.broken == "positions" else LENGTH
        self.positions[:half].copy_(torch.arange(half))
        self.dropped.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        kept = (1 - self.dropped).to(torch.get_default_dtype()).unsqueeze(-1)
        return (self.tokens(ids) + self.where(self.positions)) * kept


class Causal(nn.Module):
    """One attention-like mixing layer with a causal mask: a non-persistent ``bool`` buffer made in ``__init__``."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken
        self.weight = nn.Parameter(torch.empty(WIDTH, WIDTH))
        self.register_buffer("mask", torch.tril(torch.ones(LENGTH, LENGTH, dtype=torch.bool)), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=WIDTH**-0.5)
        if self.broken != "mask":
            self.mask.copy_(torch.tril(torch.ones_like(self.mask)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ self.weight) @ x.transpose(1, 2)
        return x + torch.softmax(scores.masked_fill(~self.mask, float("-inf")), dim=-1) @ x


def make_model(broken: str = "") -> nn.Sequential:
    embed, head = Embed(broken), nn.Linear(WIDTH, VOCAB)
    head.weight = embed.tokens.weight  # tied: the embedding's weight is the head's
    return nn.Sequential(embed, Causal(broken), head)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class Net(L.LightningModule):
    def __init__(self, broken: str = "", strict: bool = True, lr: float = 0.1) -> None:
        super().__init__()
        self.strict_loading = strict
        self.lr = lr
        self.model = make_model(broken)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self.model(ids).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Start(L.Callback):
    """The losses, and the module's real tensors (buffers not in the state dict too) as the fit starts."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.tied = False

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.tensors = real_tensors(module)
        self.tied = module.model[0].tokens.weight is module.model[2].weight

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def strategy(**kwargs: Any) -> PipeStrategy:
    return PipeStrategy(stages=2, microbatches=2, partition=[1, 2], **kwargs)  # the embedding, then the rest


def fit(
    strategy: L.pytorch.strategies.Strategy | str,
    steps: int,
    broken: str = "",
    meta: bool = True,
    ckpt: str | None = None,
    strict: bool = True,
    start: dict[str, torch.Tensor] | None = None,
    lr: float = 0.1,
    **trainer: Any,
) -> tuple[L.Trainer, Net, Start]:
    """``steps`` SGD steps of `Net`, built on meta (``init_module(empty_init=True)``) or eagerly; ``start``: the
    tensors an eager model starts from (a plain reference of a meta-built run)."""
    L.seed_everything(0, verbose=False)
    seen = Start()
    t = L.Trainer(strategy=strategy, max_steps=steps, callbacks=[seen], **{**QUIET, **trainer})
    if meta:
        with t.init_module(empty_init=True):
            net = Net(broken, strict, lr)
    else:
        net = Net(broken, strict, lr)
    if start is not None:
        own = dict(net.named_buffers(remove_duplicate=False))
        net.load_state_dict({k: v for k, v in start.items() if k not in own or k in net.state_dict()})
        for key, value in start.items():
            if key in own:
                own[key].copy_(value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.fit(net, DataLoader(make_data(), batch_size=BATCH // trainer.get("devices", 1)), ckpt_path=ckpt)
    return t, net, seen


def real_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``module`` with values (a launched process's: its stage's), buffers not in the state dict too."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {k: v.detach().clone() for k, v in named if not v.is_meta}


def launched_cases(out: Path, ckpt: str) -> None:
    """Every case in these 2 processes (1 x 2): each broken tensor, the correct model, the tied weight resumed.
    One step at ``lr=0``: each process's tensors after the fit (its stage's; the serving process runs no callback)
    are those it built."""
    rank = int(os.environ.get("RANK", "0"))  # forked_ranks.py sets torchrun's variables
    cases: dict[str, dict[str, Any]] = {
        "mask": {"broken": "mask"},
        "positions": {"broken": "positions"},
        "good": {},
        "tied": {"ckpt": ckpt, "strict": False},
    }
    for case, kwargs in cases.items():
        result: dict[str, Any] = {}
        began = time.monotonic()
        try:
            steps = 2 if "ckpt" in kwargs else 1  # the checkpoint is of one step
            _, net, seen = fit(strategy(timeout=60), steps, devices=2, lr=0.0, **kwargs)
            result = {"losses": seen.losses}
            torch.save(real_tensors(net), out / f"{case}-rank{rank}.pt")
        except Exception as error:  # noqa: BLE001 - what each process raised is the result
            result = {"error": f"{type(error).__name__}: {error}"}
        result["seconds"] = time.monotonic() - began
        (out / f"{case}-rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True, help="a plain Trainer's checkpoint without model.2.bias, lr 0")
    args = parser.parse_args()
    launched_cases(Path(args.out), args.ckpt)


if __name__ == "__main__":
    faulthandler.enable()
    main()
