"""The schedules of issue 28 (looped-bfs, interleaved-zero-bubble, zbv, dualpipev) give the unsplit step.

Two chunks per rank on 2 and 4 ranks, microbatches 2p and 4p on one pipeline each: a GPT with a tied
embedding and head (in a V both on rank 0; looped, on two ranks), a padding mask and a token-weighted
loss, with and without recomputation; and dropout under recomputation draws what a run without it draws.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from traced_models import TinyGPT, gpt_batch

from lightning_pipe import Pipeline

NEW = ["looped-bfs", "interleaved-zero-bubble", "zbv", "dualpipev"]
IGNORE = -100


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny ops: intra-op threads only add synchronisation (and stage threads already run in parallel)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over the labelled tokens (padding is ``-100``)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def labelled(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE).sum()


@pytest.mark.parametrize("schedule", NEW)
def test_gpt_with_tied_head_masks_and_token_weights_equals_unsplit(schedule: str) -> None:
    for ranks, checkpoint in ((2, "never"), (4, "always")):
        torch.manual_seed(0)
        model = TinyGPT(dim=8, layers=2 * ranks - 1)  # 2 x ranks stages: embedding + blocks, blocks, ..., head
        reference = copy.deepcopy(model)
        idx, mask, targets = gpt_batch(rows=4 * ranks)
        targets = targets.masked_fill(mask == 0, IGNORE)  # microbatches hold different numbers of tokens
        targets[0] = IGNORE  # and the first row none
        lm_loss(reference(idx, mask), targets).backward()
        split_points = [f"blocks.{b}" for b in range(1, 2 * ranks - 1)] + ["ln_f"]
        with Pipeline(
            model, stages=2 * ranks, virtual_stages=2, schedule=schedule, split_points=split_points,
            checkpoint=checkpoint, timeout=60,
        ) as pipe:  # fmt: skip
            for microbatches in (2 * ranks, 4 * ranks):
                model.zero_grad(set_to_none=True)
                pipe.train_step(
                    (idx,), targets, lm_loss, microbatches, kwargs={"mask": mask}, microbatch_weight=labelled
                )
                for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                    msg = f"{schedule}, {ranks} ranks, {microbatches} microbatches: {name}"
                    torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0, msg=msg)
            assert pipe.partitioner.tied == [[(0, "wte.weight"), (2 * ranks - 1, "head.weight")]]


def dropout_mlp(stages: int) -> nn.Sequential:
    """[Linear, Dropout, Tanh] per stage: every stage draws."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(stages):
        layers += [nn.Linear(8 if i == 0 else 16, 16), nn.Dropout(0.3), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def dropout_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def dropout_grads(stages: int, microbatches: int, **options: object) -> list[torch.Tensor]:
    model = dropout_mlp(stages)
    x, y = dropout_batch()
    balance = [3] * (stages - 1) + [4]
    with Pipeline(model, stages=stages, partition=balance, seed=7, timeout=60, **options) as pipe:  # type: ignore[arg-type]
        pipe.train_step(x, y, F.cross_entropy, microbatches=microbatches)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("schedule", NEW)
def test_dropout_under_recomputation_draws_what_gpipe_draws(schedule: str) -> None:
    """Each stage draws from its own generators: the V placement and the split backward change nothing."""
    for microbatches in (4, 8):
        want = dropout_grads(4, microbatches, schedule="gpipe", checkpoint="never")
        got = dropout_grads(4, microbatches, schedule=schedule, virtual_stages=2, checkpoint="always")
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    without_dropout = dropout_mlp(4).eval()  # the oracle is not vacuous: the masks change the gradients
    x, y = dropout_batch()
    F.cross_entropy(without_dropout(x), y).backward()
    assert any((g - p.grad).abs().max() > 1e-3 for g, p in zip(got, without_dropout.parameters(), strict=True))
