"""Per-stage random generators in the engine (`Pipeline`, no Lightning): dropout is reproducible and replayed.

The oracle: a run with activation recomputation (``checkpoint="always"``) computes the gradients of the
forward it replaces only if the recomputed forward draws the same masks, so it must equal the run
that keeps the forward's graph (``"never"``); and every runner must compute the same thing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_pipe.rng.stage_random as stage_random
from lightning_pipe import Pipeline
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.rng import RandomRouting

P = 0.3


def dropout_mlp(p: float = P) -> nn.Sequential:
    """Three stages of [Linear, Dropout, Tanh] and a head (partition [3, 3, 4]): dropout in every stage."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width_in in (8, 32, 32):
        layers += [nn.Linear(width_in, 32), nn.Dropout(p), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 3))


class FunctionalBlock(nn.Module):
    """Dropout through ``F.dropout`` and attention dropout: no dropout module for detection to see."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.proj(x)), P, self.training)
        q = h.view(h.shape[0], 2, 2, -1)  # (rows, heads, tokens, features)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=P if self.training else 0.0)
        return x + a.reshape(h.shape)


def functional_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), FunctionalBlock(), FunctionalBlock(), nn.Linear(16, 3))


def data(rows: int = 24, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


def train(model: nn.Module, steps: int = 3, **options: Any) -> torch.Tensor:
    """``steps`` SGD steps through a pipeline; the trained parameters, flat."""
    x, y = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    options = {"stages": 3, "partition": [3, 3, 4], "seed": 7, **options}
    with Pipeline(model, **options) as pipe:
        for _ in range(steps):
            optimizer.zero_grad()
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            optimizer.step()
    return flat(model)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def unsplit(model: nn.Module, steps: int = 3) -> torch.Tensor:
    x, y = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return flat(model)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "schedule", [{"schedule": "1f1b"}, {"schedule": "gpipe"}, {"schedule": "zero-bubble"}], ids=lambda s: s["schedule"]
)
def test_recomputation_replays_the_forward_draws(schedule: dict[str, Any]) -> None:
    never = train(dropout_mlp(), checkpoint="never", **schedule)
    always = train(dropout_mlp(), checkpoint="always", **schedule)
    assert_same(always, never)
    # the masks are the stages' own, not the unsplit model's: dropout is on and the oracle is not vacuous
    assert (never - unsplit(dropout_mlp())).abs().max().item() > 1e-3


def test_interleaved_stages_replay_their_draws() -> None:
    options = {"stages": 4, "partition": [3, 3, 2, 2], "schedule": "interleaved-1f1b", "virtual_stages": 2}
    assert_same(
        train(dropout_mlp(), checkpoint="always", **options), train(dropout_mlp(), checkpoint="never", **options)
    )


@pytest.mark.parametrize("runner", ["dataflow", "linear"])
def test_runners_agree(runner: str) -> None:
    assert_same(train(dropout_mlp(), runner=runner), train(dropout_mlp(), runner="parallel"))


def test_the_seed_decides_the_draws() -> None:
    first, again = train(dropout_mlp()), train(dropout_mlp())
    assert torch.equal(first, again)
    assert (train(dropout_mlp(), seed=8) - first).abs().max().item() > 1e-3


def test_dropout_without_modules_is_found_and_replayed() -> None:
    """F.dropout and attention dropout in user modules: the stages' first forward finds them (a probe)."""
    options = {"stages": 2, "partition": [2, 2]}
    never = train(functional_model(), checkpoint="never", **options)
    assert_same(train(functional_model(), checkpoint="always", **options), never)
    assert_same(train(functional_model(), runner="linear", **options), never)
    assert (never - unsplit(functional_model())).abs().max().item() > 1e-3


class Traced(nn.Module):
    """Not an nn.Sequential: traced and cut at a split point; the dropout is a call in the graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.inp(x)), P, self.training)
        h = F.dropout(torch.tanh(self.mid(h)), P, self.training)
        return self.out(h)


def test_traced_model_dropout_is_detected_and_replayed() -> None:
    def options() -> dict[str, Any]:
        return {"stages": 2, "partition": TracedPartitioner(split_points=["mid"])}

    never = train(Traced(), checkpoint="never", **options())
    assert_same(train(Traced(), checkpoint="always", **options()), never)
    assert (never - unsplit(Traced())).abs().max().item() > 1e-3
    pipe = Pipeline(Traced(), sample=torch.randn(4, 8), **options())
    assert [shard.module.random_calls for shard in pipe.shards] == [["dropout"], ["dropout"]]


def test_async_training_replays_its_draws() -> None:
    def run(checkpoint: str) -> torch.Tensor:
        model = dropout_mlp()
        g = torch.Generator().manual_seed(3)
        batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
        with Pipeline(model, stages=3, partition=[3, 3, 4], schedule="async", checkpoint=checkpoint, seed=1) as pipe:
            pipe.train_async(batches, F.cross_entropy, lambda ps: torch.optim.SGD(ps, lr=0.2), microbatches=4)
        return flat(model)

    never = run("never")
    assert_same(run("always"), never)
    assert torch.equal(run("never"), never)


def test_compiled_backend_leaves_stages_that_draw_to_eager() -> None:
    """backend="inductor": a training forward that draws runs eager, logged and traced with the reason."""
    never = train(dropout_mlp(), checkpoint="never")
    model = dropout_mlp()
    x, y = data()
    with Pipeline(model, stages=3, partition=[3, 3, 4], seed=7, backend="inductor", checkpoint="always") as pipe:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        for _ in range(3):
            optimizer.zero_grad()
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            optimizer.step()
        trace = pipe.execution_trace()
    assert_same(flat(model), never)
    for s in range(3):  # 12 forwards and their 12 recomputations
        assert trace[s].runs["train"] == {"eager": 24}
        assert "random numbers" in trace[s].declined[("train", "inductor")]


def test_random_state_continues_the_sequences() -> None:
    """Saved after step 1 and loaded into a new pipeline, steps 2-3 draw what an uninterrupted run draws."""
    whole = train(dropout_mlp())
    model = dropout_mlp()
    x, y = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    with Pipeline(model, stages=3, partition=[3, 3, 4], seed=7) as pipe:
        optimizer.zero_grad()
        pipe.train_step(x, y, F.cross_entropy, microbatches=4)
        optimizer.step()
        saved = pipe.random_state()
    assert saved["seed"] == 7 and sorted(saved["stages"]) == [0, 1, 2]
    with Pipeline(model, stages=3, partition=[3, 3, 4], seed=7) as pipe:
        pipe.load_random_state(copy.deepcopy(saved))
        for _ in range(2):
            optimizer.zero_grad()
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            optimizer.step()
    assert torch.equal(flat(model), whole)


def test_random_state_of_other_stages_warns() -> None:
    with Pipeline(dropout_mlp(), stages=3, partition=[3, 3, 4]) as pipe:
        saved = pipe.random_state()
    with Pipeline(dropout_mlp(), stages=2, partition=[6, 4]) as pipe, pytest.warns(UserWarning, match="stages"):
        pipe.load_random_state(saved)


@pytest.fixture
def routed_forwards(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the forwards that run under `RandomRouting` (stage threads of this process)."""
    count: list[int] = []

    class Counting(RandomRouting):
        def __enter__(self) -> Any:
            count.append(1)
            return super().__enter__()

    monkeypatch.setattr(stage_random, "RandomRouting", Counting)
    yield count


class Plain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


def own_modules() -> nn.Sequential:
    """Stages 0 and 1 (partition [2, 2, 3]) run a module of their own that draws nothing; stage 2 torch.nn layers."""
    return nn.Sequential(
        nn.Linear(8, 8), Plain(), nn.Linear(8, 8), Plain(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    )


@pytest.mark.parametrize(
    ("make", "partition", "routed"),
    [
        (lambda: dropout_mlp(0.0), [3, 3, 4], 0),  # torch.nn layers that draw nothing: never routed
        (own_modules, [2, 2, 3], 2),  # stages 0 and 1 probed once (their first forward); stage 2 never
        (dropout_mlp, [3, 3, 4], 3 * 3 * 4),  # every forward (3 steps x 4 microbatches) of every stage
    ],
    ids=["torch-layers", "own-modules", "dropout"],
)
def test_only_stages_that_draw_pay_for_routing(
    routed_forwards: list[int], make: Any, partition: list[int], routed: int
) -> None:
    train(make(), partition=partition, checkpoint="never")
    assert len(routed_forwards) == routed
