"""Small models, data and Trainer settings shared by the tests."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

QUIET: dict[str, Any] = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def mlp(depth: int = 4, width: int = 16, inputs: int = 8, classes: int = 3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class Classifier(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about PipeStrategy."""

    def __init__(self, model: nn.Module | None = None, lr: float = 0.1) -> None:
        super().__init__()
        self.model = model if model is not None else mlp()
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_acc", (self.model(x).argmax(-1) == y).float().mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def dataset(rows: int = 64, inputs: int = 8, classes: int = 3, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(rows, inputs, generator=g), torch.randint(0, classes, (rows,), generator=g))


def loader(ds: TensorDataset | None = None, batch_size: int = 16) -> DataLoader:
    return DataLoader(ds if ds is not None else dataset(), batch_size=batch_size)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """A plain reference run's tiny ops in one intra-op thread: on a loaded 2-core machine two OpenMP threads wait
    on each other (a few hundred steps of a tiny MLP: 0.04 s alone, 0.5-2 s beside other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def twins(module: L.LightningModule) -> tuple[L.LightningModule, L.LightningModule]:
    """Two identical copies (same init) of a LightningModule."""
    return module, copy.deepcopy(module)


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def gpt2_config(transformers: Any, dropout: float = 0.0) -> Any:
    """A tiny HuggingFace GPT-2 config (4 layers of width 16, 48 tokens), ``dropout`` everywhere it has one."""
    return transformers.GPT2Config(
        vocab_size=48, n_positions=16, n_embd=16, n_layer=4, n_head=2, use_cache=False,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


class RunsOn(nn.Module):
    """The identity, raising unless its input is on a ``device_type`` device: put at the start of each stage, a
    stage that silently ran elsewhere (a CPU fallback, in a worker process too) fails the step."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != self.device_type:
            raise RuntimeError(f"this stage ran on {x.device}, not on {self.device_type}")
        return x


def checked_mlp(device_type: str) -> tuple[nn.Sequential, list[int]]:
    """`mlp()` with a `RunsOn` check at the start of each of 2 stages, and the partition that puts them there."""
    layers = list(mlp())
    return nn.Sequential(RunsOn(device_type), *layers[:4], RunsOn(device_type), *layers[4:]), [5, len(layers) - 3]
