"""`microbatch_weight`: a causal LM with -100 padding trains under PipeStrategy exactly as unsplit.

The oracle is the unsplit model (same seed, same data): its loss averages over the batch's labelled
tokens, so microbatches weighted by their rows (the default) give another step, and microbatches
weighted by their labelled tokens give the same one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, max_param_diff
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import ConfigurationError, Pipeline, PipeStrategy
from lightning_pipe.strategy.outputs import weighted_mean

transformers = pytest.importorskip("transformers")
VOCAB = 48


def labelled_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The recipe for a causal LM (docs/exactness.md): the labels are shifted by one inside the loss."""
    return (batch["labels"][:, 1:] != -100).sum()


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)


def ragged(rows: int = 24, longest: int = 12, seed: int = 0, short_first: int = 0) -> list[torch.Tensor]:
    """Token rows of random lengths 2..longest; the first ``short_first`` rows have one token (nothing to predict)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, longest + 1, (rows,), generator=g)
    lengths[:short_first] = 1
    return [torch.randint(1, VOCAB, (int(n),), generator=g) for n in lengths]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What HF's padding collators return: right-padded ids, an attention mask, labels -100 on padding."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)], labels[i, : len(r)] = r, 1, r
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def tiny_gpt2(seed: int = 0) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=4, n_head=2, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


class CausalLM(L.LightningModule):
    """An ordinary LightningModule: the loss and a token accuracy average over the labelled tokens.

    ``masked_mean``: the loss written out as ``(per_token * valid).sum() / valid.sum()``, whose gradient
    is NaN where no token is valid (cross_entropy's ``ignore_index`` gives a NaN loss but zero gradients).
    """

    def __init__(self, model: nn.Module, masked_mean: bool = False) -> None:
        super().__init__()
        self.model = model
        self.masked_mean = masked_mean

    def _token_stats(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits, labels = logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()
        valid = labels != -100
        accuracy = (logits.argmax(-1) == labels)[valid].float().sum() / valid.sum()  # NaN where none is valid
        if self.masked_mean:
            per_token = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
            return (per_token * valid).sum() / valid.sum(), accuracy
        return F.cross_entropy(logits, labels, ignore_index=-100), accuracy

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        loss, accuracy = self._token_stats(batch)
        self.log("train_loss", loss)
        self.log("train_acc", accuracy)
        return {"loss": loss, "accuracy": accuracy}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, accuracy = self._token_stats(batch)
        self.log("val_loss", loss)
        self.log("val_acc", accuracy)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Steps(L.Callback):
    """Per training step: the returned loss and accuracy, and the logged ones."""

    def __init__(self) -> None:
        self.values: list[list[float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        logged = trainer.callback_metrics
        values = (outputs["loss"], outputs["accuracy"], logged["train_loss"], logged["train_acc"])
        self.values.append([float(v) for v in values])


def fit(
    module: L.LightningModule, train: list[torch.Tensor], strategy: Any = None, val: list[torch.Tensor] | None = None
) -> tuple[Steps, dict[str, float]]:
    steps = Steps()
    args = dict(QUIET, max_steps=3, callbacks=[steps], num_sanity_val_steps=0, limit_val_batches=1)
    if strategy is not None:
        args["strategy"] = strategy
    trainer = L.Trainer(**args)
    val_loader = DataLoader(val, batch_size=8, collate_fn=collate) if val is not None else None
    trainer.fit(module, DataLoader(train, batch_size=8, collate_fn=collate), val_loader)
    return steps, {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_causal_lm_with_padding_equals_the_unsplit_model(schedule: str) -> None:
    """3 steps of a GPT-2 on ragged rows padded with -100: parameters, returned and logged values (training
    and validation) equal the unsplit run's to 1e-5 with the weights; weighted by rows they do not."""
    train, val = ragged(), ragged(rows=8, seed=1)
    plain = CausalLM(tiny_gpt2())
    piped, by_rows = copy.deepcopy(plain), copy.deepcopy(plain)
    want, want_val = fit(plain, train, val=val)
    strategy = PipeStrategy(stages=2, microbatches=4, schedule=schedule, microbatch_weight=labelled_tokens)
    got, got_val = fit(piped, train, strategy, val=val)
    assert strategy.last_step is not None and len(strategy.last_step.records) == 2  # it did run 2 stages
    assert len(got.values) == len(want.values) == 3
    torch.testing.assert_close(torch.tensor(got.values), torch.tensor(want.values), rtol=0, atol=1e-5)
    assert sorted(got_val) == ["val_acc", "val_loss"]
    for name in got_val:
        assert got_val[name] == pytest.approx(want_val[name], abs=1e-5)
    assert max_param_diff(piped, plain) < 1e-5
    # the default weights (rows) are not the token average: the same test fails without microbatch_weight
    rows, _ = fit(by_rows, train, PipeStrategy(stages=2, microbatches=4, schedule=schedule), val=val)
    assert max(abs(a[0] - b[0]) for a, b in zip(rows.values[1:], want.values[1:], strict=True)) > 1e-3
    assert max_param_diff(by_rows, plain) > 1e-3


@pytest.mark.parametrize("masked_mean", [False, True])
def test_a_microbatch_with_weight_zero_adds_nothing(masked_mean: bool) -> None:
    """Microbatch 0 of the first batch has no labelled token: its loss and accuracy are NaN (a mean over
    nothing). With weight 0 it adds no gradient and no logged value, so the run equals the unsplit one.
    Weighted by its rows, the step's loss and logged values are NaN, and so is every parameter where the
    loss's gradient is NaN too (``masked_mean``)."""
    train = ragged(short_first=2)
    plain = CausalLM(tiny_gpt2(), masked_mean)
    piped, by_rows = copy.deepcopy(plain), copy.deepcopy(plain)
    assert labelled_tokens(collate(train[:2])) == 0
    want, _ = fit(plain, train)
    got, _ = fit(piped, train, PipeStrategy(stages=2, microbatches=4, microbatch_weight=labelled_tokens))
    assert torch.tensor(got.values).isfinite().all()
    torch.testing.assert_close(torch.tensor(got.values), torch.tensor(want.values), rtol=0, atol=1e-5)
    assert max_param_diff(piped, plain) < 1e-5
    rows, _ = fit(by_rows, train, PipeStrategy(stages=2, microbatches=4))
    assert torch.tensor(rows.values[0]).isnan().all()
    assert all(p.isnan().all() for p in by_rows.model.transformer.h[0].parameters()) == masked_mean


class Weighted(L.LightningModule):
    """Rows ``(x, k)``: the step logs and returns ``sum(x * k) / sum(k)``, the batch's value where k counts."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))

    def _value(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, k = batch
        value = (x * k).sum() / k.sum()  # NaN where k is all 0
        loss = (self.model(x[:, None]).squeeze(1) * k).sum() / k.sum()
        return loss, value

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        loss, value = self._value(batch)
        self.log("train_value", value)
        return {"loss": loss, "value": value}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        value = self._value(batch)[1]
        self.log("val_value", value)
        return {"value": value}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_logged_and_returned_values_combine_with_the_weights() -> None:
    """``self.log`` values and the step's returned entries (training and validation) are the weighted
    means over the microbatches: the whole batch's ``sum(x * k) / sum(k)``, what the unsplit step gives;
    microbatch 1 (k = 0, its value NaN) is left out. Validation steps return their combined dict as well."""
    x = torch.arange(8, dtype=torch.float32)
    k = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 2.0, 5.0, 1.0])
    expected = float((x * k).sum() / k.sum())
    data = DataLoader(TensorDataset(x, k), batch_size=8)
    steps: list[Any] = []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
            steps.append((float(outputs["value"]), float(trainer.callback_metrics["train_value"])))

        def on_validation_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
            steps.append(float(outputs["value"]))

    strategy = PipeStrategy(stages=2, microbatches=4, microbatch_weight=lambda batch: batch[1].sum())
    trainer = L.Trainer(**QUIET, max_steps=1, callbacks=[Capture()], num_sanity_val_steps=0, strategy=strategy)
    trainer.fit(Weighted(), data, data)
    train, val = steps
    assert train == pytest.approx((expected, expected), abs=1e-6)
    assert val == pytest.approx(expected, abs=1e-6)
    assert float(trainer.callback_metrics["val_value"]) == pytest.approx(expected, abs=1e-6)


def test_weighted_mean_leaves_out_weight_zero_and_falls_back_to_equal_weights() -> None:
    nan = torch.tensor(float("nan"))
    assert float(weighted_mean([torch.tensor(2.0), nan, torch.tensor(5.0)], [0.25, 0.0, 0.75])) == 4.25
    # only microbatches of weight 0 logged the name: their values count equally
    assert float(weighted_mean([torch.tensor(2.0), torch.tensor(4.0)], [0.0, 0.0])) == 3.0


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.model(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_microbatch_weight_that_is_not_a_function_fails_at_construction() -> None:
    with pytest.raises(ConfigurationError, match=r"microbatch_weight=\.\.\.\) got 3, which is not callable"):
        PipeStrategy(stages=2, microbatch_weight=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "weight,message",
    [
        (lambda b: -1.0, r"returned -1.0 for microbatch 0; a weight must be a finite number >= 0"),
        (lambda b: float("nan"), r"returned nan for microbatch 0"),
        (lambda b: torch.tensor(float("inf")), r"returned inf for microbatch 0"),
        (lambda b: torch.tensor(0), r"returned 0 for every microbatch of the batch \(\[0.0, 0.0\]\)"),
        (lambda b: b[1].sum(0), r"returned Tensor of shape \(1,\) for microbatch 0; return a number or a 0-d"),
        (lambda b: "rows", r"returned str for microbatch 0"),
    ],
)
def test_bad_weights_fail_at_the_first_step_naming_the_argument(weight: Any, message: str) -> None:
    """The fit stops before any work with the argument and what it returned; the module is unchanged."""
    module = Regressor()
    before = copy.deepcopy(module)
    data = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=8)
    trainer = L.Trainer(**QUIET, max_steps=1, strategy=PipeStrategy(stages=2, microbatches=2, microbatch_weight=weight))
    with pytest.raises(ConfigurationError, match=r"PipeStrategy\(microbatch_weight=\.\.\.\) " + message):
        trainer.fit(module, data)
    assert max_param_diff(module, before) == 0


def token_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over the targets that are not -100, written out: NaN, gradient too, where none is."""
    valid = (targets != -100).flatten()
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none")
    return (per_token * valid).sum() / valid.sum()


def padded_tokens(short_first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate(ragged(rows=12, short_first=short_first))
    ids, labels = batch["input_ids"], batch["labels"]
    return ids[:, :-1], labels[:, 1:]  # inputs and next-token targets, -100 past each row's end


@pytest.mark.parametrize("short_first", [0, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_train_step_with_weights_equals_the_unsplit_gradients(schedule: str, short_first: int) -> None:
    """`Pipeline.train_step(microbatch_weight=...)`: the gradients of the token-averaged loss, also where a
    microbatch has no target (its loss is 0 and adds no gradient); weighted by rows they differ."""
    x, y = padded_tokens(short_first)
    plain = token_model()
    loss = token_loss(plain(x), y)
    loss.backward()
    model = token_model()
    with Pipeline(model, stages=2, schedule=schedule, partition="uniform") as pipe:
        result = pipe.train_step(x, y, token_loss, microbatches=4, microbatch_weight=lambda t: (t != -100).sum())
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
        assert float(sum(result.losses)) == pytest.approx(float(loss.detach()), abs=1e-6)
        if short_first:
            assert float(result.losses[0]) == 0.0
        model.zero_grad(set_to_none=True)
        pipe.train_step(x, y, token_loss, microbatches=4)
        grads = [p.grad for p in model.parameters()]
        if short_first:
            assert all(g.isnan().any() for g in grads)
        else:
            assert max((g - q.grad).abs().max().item() for g, q in zip(grads, plain.parameters(), strict=True)) > 1e-3


def test_pipeline_train_async_one_batch_with_weights_is_the_unsplit_step() -> None:
    """One batch through the asynchronous stream has no stale weights: the SGD step of the token average."""
    x, y = padded_tokens(short_first=3)
    plain = token_model()
    token_loss(plain(x), y).backward()
    torch.optim.SGD(plain.parameters(), lr=0.5).step()
    model = token_model()
    with Pipeline(model, stages=2, schedule="async", partition="uniform") as pipe:
        pipe.train_async(
            [(x, y)], token_loss, lambda ps: torch.optim.SGD(ps, lr=0.5), microbatches=4,
            microbatch_weight=lambda t: (t != -100).sum(),
        )  # fmt: skip
    assert max_param_diff(model, plain) < 1e-6


def test_pipeline_checks_its_weight_function() -> None:
    x, y = padded_tokens()
    with Pipeline(token_model(), stages=2, partition="uniform") as pipe:
        with pytest.raises(ConfigurationError, match=r"Pipeline.train_step\(microbatch_weight=...\) got 'y'"):
            pipe.train_step(x, y, token_loss, microbatch_weight="y")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match=r"train_step\(microbatch_weight=...\) returned -2.0 for micro"):
            pipe.train_step(x, y, token_loss, microbatch_weight=lambda t: -2.0)


def test_async_schedule_weights_its_microbatches() -> None:
    """schedule="async" through a Trainer, one batch an epoch: the stream drains at each epoch's end, so no
    step sees stale weights, and with the weights the 3 steps are the unsplit steps (weighted by rows, not)."""
    train = ragged(rows=8)
    plain = CausalLM(tiny_gpt2())
    piped, by_rows = copy.deepcopy(plain), copy.deepcopy(plain)
    want, _ = fit(plain, train)
    strategy = PipeStrategy(stages=2, microbatches=4, schedule="async", microbatch_weight=labelled_tokens)
    got, _ = fit(piped, train, strategy)
    assert len(got.values) == 3 and strategy.staleness()[0].updates == 3
    torch.testing.assert_close(torch.tensor(got.values), torch.tensor(want.values), rtol=0, atol=1e-5)
    assert max_param_diff(piped, plain) < 1e-5
    fit(by_rows, train, PipeStrategy(stages=2, microbatches=4, schedule="async"))
    assert max_param_diff(by_rows, plain) > 1e-3
