"""lightning_pipe.rng without a pipeline: routed draws equal torch's own, per thread; what detection sees."""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.rng import RandomRouting, StageGenerators, StageRandom, randomness, replaying
from lightning_pipe.rng.catalog import GENERATOR_OPS, RandomOpKind, kind_of

X = torch.randn(4, 6, 8, 8, generator=torch.Generator().manual_seed(0))
Q = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(1))
MASK = torch.rand(5, 5, generator=torch.Generator().manual_seed(2)) > 0.3


def _mha() -> nn.MultiheadAttention:
    torch.manual_seed(3)
    return nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)


# every way of drawing a stage may use, and what torch draws for it from its default generator
DRAWS: dict[str, Callable[[], torch.Tensor]] = {
    "nn.Dropout": lambda: nn.Dropout(0.2)(X),
    "F.dropout": lambda: F.dropout(X, 0.3, True),
    "F.dropout inplace": lambda: F.dropout(X.clone(), 0.3, True, inplace=True),
    "F.dropout1d": lambda: F.dropout1d(X[0], 0.3, True),
    "F.dropout2d": lambda: F.dropout2d(X, 0.3, True),
    "F.dropout3d": lambda: F.dropout3d(X, 0.3, True),
    "F.alpha_dropout": lambda: F.alpha_dropout(X, 0.3, True),
    "F.feature_alpha_dropout": lambda: F.feature_alpha_dropout(X, 0.3, True),
    "torch.dropout": lambda: torch.dropout(X, 0.3, True),
    "torch.native_dropout": lambda: torch.native_dropout(X, 0.3, True)[0],
    "torch.rand": lambda: torch.rand(3, 4),
    "torch.randn_like": lambda: torch.randn_like(X),
    "torch.randint": lambda: torch.randint(0, 10, (5,)),
    "torch.randperm": lambda: torch.randperm(10),
    "torch.normal": lambda: torch.normal(torch.zeros(3), torch.ones(3)),
    "torch.multinomial": lambda: torch.multinomial(torch.ones(10), 3),
    "torch.poisson": lambda: torch.poisson(torch.ones(5) * 3),
    "torch.bernoulli": lambda: torch.bernoulli(torch.full((6,), 0.4)),
    "Tensor.bernoulli_": lambda: torch.empty(5).bernoulli_(0.3),
    "Tensor.uniform_": lambda: torch.empty(5).uniform_(),
    "Tensor.exponential_": lambda: torch.empty(5).exponential_(),
    "nn.init.kaiming_uniform_": lambda: nn.init.kaiming_uniform_(torch.empty(4, 4)),
    "torch.ops.aten.bernoulli_": lambda: torch.ops.aten.bernoulli_.float(torch.empty(6), 0.5),
    "torch.ops.aten.rand.default": lambda: torch.ops.aten.rand.default([5]),
    "torch.ops.aten.native_dropout": lambda: torch.ops.aten.native_dropout.default(X, 0.3, True)[0],
    "F.rrelu": lambda: F.rrelu(X, training=True),
    "F.gumbel_softmax": lambda: F.gumbel_softmax(X, tau=1.0),
    "F.fractional_max_pool2d": lambda: F.fractional_max_pool2d(X, 3, output_size=(5, 5), return_indices=True)[1],
    "F.sdpa": lambda: F.scaled_dot_product_attention(Q, Q, Q, dropout_p=0.3),
    "F.sdpa bool mask": lambda: F.scaled_dot_product_attention(Q, Q, Q, attn_mask=MASK, dropout_p=0.3),
    "F.sdpa causal": lambda: F.scaled_dot_product_attention(Q, Q, Q, is_causal=True, dropout_p=0.3),
    "torch.distributions": lambda: torch.distributions.Gamma(torch.ones(4), torch.ones(4)).sample(),
}


def _routed(draw: Callable[[], torch.Tensor], seed: int) -> tuple[torch.Tensor, bool]:
    generators = StageGenerators(0, 0, "cpu")
    cpu = generators.get(torch.device("cpu"))
    assert cpu is not None
    cpu.manual_seed(seed)
    torch.manual_seed(seed + 1)  # the process-wide generator is elsewhere: a draw from it would differ
    mode = RandomRouting(generators)
    with mode:
        out = draw()
    return out, mode.drew


@pytest.mark.parametrize("name", list(DRAWS))
def test_routed_draws_equal_torch_draws_from_the_same_state(name: str) -> None:
    """Routed to a stage generator in state S, a call draws exactly what torch draws from its default generator in S."""
    torch.manual_seed(123)
    expected = DRAWS[name]()
    got, drew = _routed(DRAWS[name], 123)
    assert drew
    assert torch.equal(got, expected)
    other, _ = _routed(DRAWS[name], 124)
    assert not torch.equal(other, expected)


def test_multihead_attention_dropout_draws_from_the_stage() -> None:
    """nn.MultiheadAttention with dropout runs its explicit path (float rounding apart, torch's result)."""
    x = torch.randn(2, 5, 8)
    module = _mha()
    torch.manual_seed(7)
    expected = module(x, x, x, need_weights=False)[0]
    got, drew = _routed(lambda: module(x, x, x, need_weights=False)[0], 7)
    assert drew
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_gradients_flow_through_routed_draws() -> None:
    """Below autograd the routed dropout returns what the native kernel returns: the backward is torch's."""
    grads = []
    for routed in (False, True):
        x = X.clone().requires_grad_()
        if routed:
            out, _ = _routed(lambda x=x: torch.native_dropout(x, 0.3, True)[0] + F.dropout(x, 0.2), 5)
        else:
            torch.manual_seed(5)
            out = torch.native_dropout(x, 0.3, True)[0] + F.dropout(x, 0.2)
        out.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_calls_that_draw_nothing_pass_through() -> None:
    with RandomRouting(StageGenerators(0, 0, "cpu")) as mode:
        F.dropout(X, 0.0, True)
        F.dropout(X, 0.5, False)
        nn.Dropout(0.5).eval()(X)
        F.scaled_dot_product_attention(Q, Q, Q)
        torch.tanh(X) @ torch.ones(8, 8)
    assert not mode.drew


def test_threads_draw_from_their_own_generators_while_others_use_the_global_one() -> None:
    """Two stage threads and a thread drawing from the global generator: each stage gets its own sequence."""
    expected = {}
    for stage in (0, 1):
        generators = StageGenerators(5, stage, "cpu")
        with RandomRouting(generators):
            expected[stage] = [F.dropout(torch.ones(64), 0.5).sum().item() for _ in range(200)]
    got: dict[int, list[float]] = {}
    stop = threading.Event()

    def stage_thread(stage: int) -> None:
        generators = StageGenerators(5, stage, "cpu")
        with RandomRouting(generators):
            got[stage] = [F.dropout(torch.ones(64), 0.5).sum().item() for _ in range(200)]

    def noise() -> None:
        while not stop.is_set():
            torch.rand(64)

    threads = [threading.Thread(target=stage_thread, args=(s,)) for s in (0, 1)]
    noisy = threading.Thread(target=noise)
    noisy.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stop.set()
    noisy.join(30)
    assert got == expected
    assert expected[0] != expected[1]


def test_replay_draws_the_snapshot_again_and_leaves_the_stage_sequence() -> None:
    generators = StageGenerators(1, 2, "cpu")
    with RandomRouting(generators):
        F.dropout(X, 0.5)
    state = generators.snapshot()
    with RandomRouting(generators):
        first = F.dropout(X, 0.5)
    with replaying(state):
        again = F.dropout(X, 0.5)
    with RandomRouting(generators):
        after = F.dropout(X, 0.5)
    assert torch.equal(first, again)
    assert not torch.equal(after, first)  # the stage's own sequence went on
    restored = StageGenerators(1, 2, "cpu")
    restored.load_state(state.states)
    with RandomRouting(restored):
        assert torch.equal(F.dropout(X, 0.5), first)


def test_stages_and_seeds_give_independent_streams() -> None:
    def first_draw(seed: int, stage: int) -> torch.Tensor:
        with RandomRouting(StageGenerators(seed, stage, "cpu")):
            return torch.rand(8)

    assert torch.equal(first_draw(0, 1), first_draw(0, 1))
    assert not torch.equal(first_draw(0, 1), first_draw(0, 2))
    assert not torch.equal(first_draw(0, 1), first_draw(1, 1))


class _Custom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _Noisy(nn.Module):
    """Draws only from its second call on: its first (probed) forward looks quiet."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.randn_like(x) if self.calls > 1 else x


@pytest.mark.parametrize(
    ("module", "verdict"),
    [
        (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LayerNorm(4)), "no"),
        (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), "yes"),
        (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)), "no"),
        (nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1), "yes"),
        (nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), "no"),
        (nn.MultiheadAttention(8, 2, dropout=0.1), "yes"),
        (nn.ModuleList([nn.Linear(2, 2), nn.RReLU()]), "yes"),
        (nn.Sequential(nn.Linear(4, 4), _Custom()), "unknown"),
    ],
)
def test_detection_reads_the_modules(module: nn.Module, verdict: str) -> None:
    assert randomness(module) == verdict


def test_a_stage_without_randomness_runs_bare_after_its_probe() -> None:
    """ "unknown" code is probed once per mode; quiet -> no mode afterwards; drawing -> routed from then on."""
    quiet = StageRandom(0, 0, "cpu", nn.Sequential(nn.Linear(4, 4), _Custom()))
    assert quiet.routes(True) and quiet.routes(False)
    with quiet.drawing(True):
        quiet.module(torch.ones(2, 4))
    assert not quiet.routes(True) and quiet.routes(False)
    assert quiet.snapshot(True) is None

    drawing = StageRandom(0, 0, "cpu", nn.Sequential(nn.Linear(4, 4), _Custom()))
    with drawing.drawing(True):
        torch.rand(3)
    assert drawing.verdicts == {True: "yes", False: "unknown"}


def test_randomness_first_drawn_after_the_probe_comes_from_the_process_generator() -> None:
    """The documented limit: a module that draws nothing in its probed forward is not routed afterwards."""
    random = StageRandom(0, 0, "cpu", nn.Sequential(_Noisy()))
    x = torch.zeros(4)
    with random.drawing(True):
        random.module(x)
    torch.manual_seed(11)
    expected = torch.randn_like(x)
    torch.manual_seed(11)
    with random.drawing(True):
        got = random.module(x)
    assert torch.equal(got, expected)  # drawn from torch's default generator, not the stage's


def test_every_aten_op_with_a_generator_is_routed() -> None:
    """The catalog follows this torch: each public function of an aten op taking a generator gets one."""
    for name in GENERATOR_OPS:
        for namespace in (torch, torch.Tensor, torch._C._nn):
            fn = getattr(namespace, name, None)
            if fn is not None and not inspect.ismodule(fn):
                assert kind_of(fn) is RandomOpKind.INJECT, f"{namespace.__name__}.{name}"


_DRAWING_SOURCE = re.compile(
    r"\b(rand|randn|randint|randperm|bernoulli|multinomial|poisson|rrelu)\(|"
    r"\.(bernoulli_|uniform_|normal_|exponential_|random_|geometric_|cauchy_|log_normal_)\(|"
    r"_VF\.\w*dropout|\bdropout_p\b"
)


def test_every_functional_that_draws_is_routed() -> None:
    """torch.nn.functional functions whose source draws random numbers are all in the catalog."""
    missing = []
    for name in dir(F):
        fn: Any = getattr(F, name)
        if not inspect.isfunction(fn) or fn.__module__ != F.__name__:
            continue
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        body = source.split('"""')[-1]  # the code after the docstring
        if _DRAWING_SOURCE.search(body) and kind_of(fn) is RandomOpKind.PASS:
            missing.append(name)
    assert missing == []
