"""Dropout under PipeStrategy: every stage draws from its own generators, so a seeded fit is reproducible.

Dropout in every stage, random draws in the user's step before and after the pipelined call, and
``seed_everything``: recomputation replays the forward's masks (``checkpoint="always"`` equals
``"never"``), runs repeat exactly, runners and transports agree, and a resumed run continues the
uninterrupted one. The piped run draws other masks than the unsplit model (asserted, so the oracles
are not vacuous).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, dataset, gpt2_config, loader
from lightning.pytorch.callbacks import ModelCheckpoint
from processes import leftover_processes
from torch import nn
from torch.utils.data import TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.strategy.checkpoints import CHECKPOINT_KEY

P = 0.2


def dropout_mlp() -> nn.Sequential:
    """[Linear, Dropout, Tanh] x 3 and a head: with partition [3, 3, 4] every stage has a dropout."""
    layers: list[nn.Module] = []
    for width_in in (8, 32, 32):
        layers += [nn.Linear(width_in, 32), nn.Dropout(P), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 3))


class Noisy(Classifier):
    """Random draws in the step too: input noise before the pipelined call, dropout on the logits after it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x + 0.1 * torch.randn_like(x))
        loss = F.cross_entropy(F.dropout(logits, P), y)
        self.log("train_loss", loss)
        return loss


def fit(
    strategy: Any = None, steps: int = 3, ckpt_path: Any = None, callbacks: Any = (), rows: int = 32, **options: Any
) -> torch.Tensor:
    """A seeded fit of ``steps`` steps; the trained parameters, flat. ``strategy=None``: PipeStrategy(**options)."""
    L.seed_everything(0)
    module = Noisy(dropout_mlp())
    if strategy is None:
        strategy = PipeStrategy(**{"stages": 3, "microbatches": 4, "partition": [3, 3, 4], **options})
    settings = {**QUIET, "enable_checkpointing": bool(callbacks)}
    trainer = L.Trainer(**settings, max_steps=steps, strategy=strategy, callbacks=list(callbacks))
    trainer.fit(module, loader(dataset(rows=rows), 8), ckpt_path=ckpt_path)
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= 1e-6


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """The default fit (``checkpoint="except_last"``, runner ``"parallel"``, transport ``"local"``)."""
    return fit()


def test_the_pipe_draws_other_masks_than_the_unsplit_model(reference: torch.Tensor) -> None:
    assert (fit("auto") - reference).abs().max().item() > 1e-3


def test_identical_runs_are_identical(reference: torch.Tensor) -> None:
    assert torch.equal(fit(), reference)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_recomputation_replays_the_forward_draws(reference: torch.Tensor, checkpoint: str) -> None:
    assert_same(fit(checkpoint=checkpoint), reference)


@pytest.mark.parametrize("runner", ["dataflow", "linear"])
def test_runners_agree(reference: torch.Tensor, runner: str) -> None:
    assert_same(fit(runner=runner), reference)


def test_zero_bubble_split_backward_replays_the_forward_draws() -> None:
    never = fit(schedule="zero-bubble", checkpoint="never")
    assert_same(fit(schedule="zero-bubble", checkpoint="always"), never)
    assert_same(fit(schedule="zero-bubble", runner="dataflow"), never)


def test_async_replays_and_repeats() -> None:
    never = fit(schedule="async", checkpoint="never", steps=4)
    assert_same(fit(schedule="async", checkpoint="always", steps=4), never)
    assert torch.equal(fit(schedule="async", checkpoint="never", steps=4), never)


def test_rpc_stages_draw_what_local_stages_draw() -> None:
    """Stages in worker processes get the run's seed: the same masks as threads of this process."""
    options = {"stages": 2, "partition": [3, 7]}
    local = fit(**options)
    try:
        remote = fit(transport="rpc", timeout=120, **options)
    finally:
        assert leftover_processes() == [], "worker processes left behind"
    assert_same(remote, local)


def test_resume_continues_the_random_sequences(tmp_path: Path) -> None:
    """Checkpoint after step 2 (an epoch of 2 batches), resume for steps 3-4: the uninterrupted 4-step run.

    A plain Trainer does not save torch's generator, so its resumed dropout differs; the stages' and
    the steps' generators are restored (the stages' from the checkpoint, the steps' from the loop state).
    """
    every_two = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    whole = fit(steps=4, rows=16, callbacks=[every_two])
    saved = tmp_path / "epoch=0-step=2.ckpt"
    assert CHECKPOINT_KEY in torch.load(saved, weights_only=True)
    resumed = fit(steps=4, rows=16, ckpt_path=saved)
    assert_same(resumed, whole)


def test_checkpoint_loads_into_a_plain_trainer(tmp_path: Path) -> None:
    fit(steps=2, rows=16, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)])
    (saved,) = tmp_path.glob("*.ckpt")
    assert torch.isfinite(fit("auto", steps=4, rows=16, ckpt_path=saved)).all()


def test_a_second_fit_goes_on_drawing() -> None:
    """Fit 2 steps, then fit the same Trainer on to step 4: the stages go on where they stopped."""
    whole = fit(steps=4, rows=16)
    L.seed_everything(0)
    module = Noisy(dropout_mlp())
    trainer = L.Trainer(**QUIET, max_steps=2, strategy=PipeStrategy(stages=3, microbatches=4, partition=[3, 3, 4]))
    trainer.fit(module, loader(dataset(rows=16), 8))
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module, loader(dataset(rows=16), 8))
    assert trainer.global_step == 4
    assert_same(torch.cat([p.detach().flatten() for p in module.parameters()]), whole)


class GPT2(L.LightningModule):
    """HuggingFace GPT-2 from a config with dropout 0.1 (embeddings, residuals, attention): traced and cut."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        transformers.logging.set_verbosity_error()
        self.model = transformers.GPT2LMHeadModel(gpt2_config(transformers, dropout=0.1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_huggingface_gpt2_with_dropout_replays_and_repeats() -> None:
    def run(plain: bool = False, **options: Any) -> torch.Tensor:
        L.seed_everything(0)
        module = GPT2()
        ids = torch.randint(0, 48, (24, 10), generator=torch.Generator().manual_seed(0))
        strategy = "auto" if plain else PipeStrategy(microbatches=4, split_points=["transformer.h.2"], **options)
        L.Trainer(**QUIET, max_steps=3, strategy=strategy).fit(module, loader(TensorDataset(ids), 8))
        return torch.cat([p.detach().flatten() for p in module.parameters()])

    never = run(checkpoint="never")
    assert_same(run(checkpoint="always"), never)
    assert_same(run(runner="linear"), never)
    assert (run(plain=True) - never).abs().max().item() > 1e-4  # the dropout is on
