"""Models that are not nn.Sequential under PipeStrategy in a Trainer: same losses and parameters as a plain run."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, gpt2_config
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from traced_models import KeywordNet, SkipCNN, TinyGPT, gpt_batch

from lightning_pipe import PipeStrategy, TracedPartitioner, TraceError

SCHEDULES = ["gpipe", "1f1b"]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Recorder(L.Callback):
    """The loss of every training step, and the gradients of the first."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.grads:  # (none here where the stages own their parameters: rpc)
            self.grads = [p.grad.detach().clone() for p in pl_module.parameters() if p.grad is not None]


class Wrapper(L.LightningModule):
    """An ordinary LightningModule around ``model``: ``step(model, batch)`` returns the loss."""

    def __init__(self, model: nn.Module, step: Any, lr: float = 0.1) -> None:
        super().__init__()
        self.model, self.step, self.lr = model, step, lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.step(self.model, batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step(self.model, batch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(module: L.LightningModule, data: DataLoader, strategy: Any = None, steps: int = 3, **args: Any) -> Recorder:
    recorder = Recorder()
    trainer_args = dict(QUIET, max_steps=steps, callbacks=[recorder], num_sanity_val_steps=0, **args)
    if strategy is not None:
        trainer_args["strategy"] = strategy
    L.Trainer(**trainer_args).fit(module, data)
    return recorder


def assert_same_run(piped: L.LightningModule, plain: L.LightningModule, got: Recorder, want: Recorder) -> None:
    assert len(got.losses) == len(want.losses) > 0
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5, atol=1e-5)
    for g, w in zip(got.grads, want.grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for p, q in zip(piped.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def assert_pipelined(strategy: PipeStrategy, stages: int) -> TracedPartitioner:
    """The run went through a traced split into ``stages`` stages (every rank ran actions)."""
    assert isinstance(strategy.partitioner, TracedPartitioner)
    assert len(strategy.last_step.records) == stages and all(strategy.last_step.records)
    return strategy.partitioner


def gpt_step(model: nn.Module, batch: Any) -> torch.Tensor:
    idx, mask, targets = batch
    logits = model(idx, mask=mask)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_with_keyword_mask_and_tied_head(schedule: str, tmp_path: Any) -> None:
    torch.manual_seed(0)
    piped = Wrapper(TinyGPT(), gpt_step)
    plain = copy.deepcopy(piped)
    data = DataLoader(TensorDataset(*gpt_batch(rows=24)), batch_size=8)
    strategy = PipeStrategy(stages=3, microbatches=4, schedule=schedule, split_points=["blocks.1", "blocks.3"])
    got = fit(piped, data, strategy, val_check_interval=2, limit_val_batches=1)
    want = fit(plain, data, val_check_interval=2, limit_val_batches=1)
    assert_same_run(piped, plain, got, want)
    assert piped.model.head.weight is piped.model.wte.weight
    assert assert_pipelined(strategy, 3).tied == [[(0, "wte.weight"), (2, "head.weight")]]
    # a checkpoint written under PipeStrategy holds the plain model's keys and loads without it
    trainer = L.Trainer(**QUIET, max_steps=1, strategy=PipeStrategy(stages=2, microbatches=2))
    trainer.fit(piped, data)
    trainer.save_checkpoint(tmp_path / "gpt.ckpt")
    state = torch.load(tmp_path / "gpt.ckpt", weights_only=True)["state_dict"]
    assert set(state) == set(plain.state_dict())
    fresh = Wrapper(TinyGPT(), gpt_step)
    fresh.load_state_dict(state)
    idx, mask, _ = gpt_batch()
    torch.testing.assert_close(fresh.model(idx, mask=mask), piped.model(idx, mask=mask))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cnn_with_skips_and_batchnorm_matches_accumulated_microbatches(schedule: str) -> None:
    """BatchNorm sees one microbatch at a time: the plain run accumulates over batches of that size."""
    torch.manual_seed(0)
    step = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
    piped = Wrapper(SkipCNN(), step)
    plain = copy.deepcopy(piped)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 3, 8, 8, generator=g), torch.randint(0, 3, (24,), generator=g))
    strategy = PipeStrategy(stages=3, microbatches=4, schedule=schedule, split_points=["mid", "up2"])
    got = fit(piped, DataLoader(data, batch_size=8), strategy)
    want = fit(plain, DataLoader(data, batch_size=2), steps=3, accumulate_grad_batches=4)
    assert_pipelined(strategy, 3)
    for g_, w in zip(got.grads, want.grads, strict=True):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-5)
    for p, q in zip(piped.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    for a, b in zip(piped.buffers(), plain.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_keyword_arguments_and_dict_output(schedule: str) -> None:
    torch.manual_seed(0)

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        x, w, y = batch
        out = model(x, weight=w, scale=0.5)
        return F.cross_entropy(out["logits"], y) + 0.1 * out["recon"].pow(2).mean()

    piped = Wrapper(KeywordNet(), step)
    plain = copy.deepcopy(piped)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(
        TensorDataset(torch.randn(24, 6, generator=g), torch.rand(24, generator=g), torch.randint(0, 3, (24,))),
        batch_size=8,
    )
    strategy = PipeStrategy(stages=2, microbatches=4, schedule=schedule, partition="uniform")
    got = fit(piped, data, strategy)
    want = fit(plain, data)
    assert_same_run(piped, plain, got, want)
    assert_pipelined(strategy, 2)


class DemoLM(L.LightningModule):
    """Lightning's demo Transformer (nn.Transformer inside), trained as `LightningTransformer` trains it."""

    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=vocab, ninp=16, nhead=2, nhid=16, nlayers=2, dropout=0.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        output = self.model(inputs, target)
        return F.nll_loss(output, target.view(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("stages", [2, 4])
def test_lightning_demo_transformer(stages: int) -> None:
    torch.manual_seed(0)
    piped = DemoLM()
    plain = copy.deepcopy(piped)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (16, 9), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    strategy = PipeStrategy(stages=stages, microbatches=4, partition="uniform")
    got = fit(piped, data, strategy, steps=4)
    want = fit(plain, data, steps=4)
    assert_same_run(piped, plain, got, want)
    assert_pipelined(strategy, stages)


def test_huggingface_gpt2_from_a_config() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = gpt2_config(transformers)
    torch.manual_seed(0)

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        (ids,) = batch
        return model(input_ids=ids, labels=ids).loss  # as a transformers user writes it

    piped = Wrapper(transformers.GPT2LMHeadModel(config), step)
    plain = copy.deepcopy(piped)
    data = DataLoader(TensorDataset(torch.randint(0, 48, (24, 10), generator=torch.Generator().manual_seed(0))), 8)
    strategy = PipeStrategy(microbatches=4, split_points=["transformer.h.2"])  # 2 stages
    got = fit(piped, data, strategy)
    want = fit(plain, data)
    assert_same_run(piped, plain, got, want)
    lm = piped.model
    assert lm.lm_head.weight is lm.transformer.wte.weight
    assert assert_pipelined(strategy, 2).tied == [[(0, "transformer.wte.weight"), (1, "lm_head.weight")]]


def test_untraceable_model_fails_before_training_with_the_line(tmp_path: Any) -> None:
    from test_traced import Outer, Vmapped

    step = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    with pytest.raises(TraceError, match=r"(?s)torch.vmap\(torch.sin\).*leaf_modules="):
        fit(Wrapper(Vmapped(), step), data, PipeStrategy(stages=2, microbatches=2))
    # naming the untraceable submodule as a leaf: no warning, and it trains as the plain model does
    torch.manual_seed(0)
    piped = Wrapper(Outer(), step)
    plain = copy.deepcopy(piped)
    partitioner = TracedPartitioner("uniform", leaf_modules=["inner"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fit(piped, data, PipeStrategy(stages=3, microbatches=2, partition=partitioner))
    assert not [w for w in caught if "trace" in str(w.message)]
    assert_same_run(piped, plain, got, fit(plain, data))
    assert [shard.layers for shard in partitioner.partition(piped.model, ["cpu"] * 3, torch.randn(2, 4))] == [
        ["first"],
        ["inner"],
        ["last"],
    ]


class PaddedGPT(Wrapper):
    """Trains with a padding mask; validates and predicts without one (a second way of calling the model)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        idx, _, targets = batch
        self.log("val_loss", F.cross_entropy(self.model(idx).flatten(0, 1), targets.flatten()))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).argmax(-1)


def test_steps_that_call_the_model_in_different_ways() -> None:
    torch.manual_seed(0)
    piped = PaddedGPT(TinyGPT(), gpt_step)
    plain = copy.deepcopy(piped)
    data = DataLoader(TensorDataset(*gpt_batch(rows=16)), batch_size=8)
    results = []
    for module, strategy in ((piped, PipeStrategy(stages=2, microbatches=2)), (plain, "auto")):
        trainer = L.Trainer(**QUIET, max_steps=2, strategy=strategy, limit_val_batches=1, num_sanity_val_steps=0)
        trainer.fit(module, data, data)
        if isinstance(strategy, PipeStrategy):
            assert len(strategy.partitioner.variants) == 2  # with and without the mask
        results.append((trainer.callback_metrics["val_loss"], torch.cat(trainer.predict(module, data))))
    torch.testing.assert_close(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_a_traced_model_whose_stages_own_their_parameters_takes_its_first_step() -> None:
    """rpc: the first training step cuts the model (the pipeline is built inside the step's closure) and its
    optimizer step must reach the stages built there, not the LightningModule's own copy; each of three SGD
    steps then equals the plain run (before the fix the first update was lost and every later loss differed)."""
    torch.manual_seed(0)
    piped = Wrapper(TinyGPT(), gpt_step)
    plain = copy.deepcopy(piped)
    data = DataLoader(TensorDataset(*gpt_batch(rows=24)), batch_size=8)
    strategy = PipeStrategy(stages=2, microbatches=2, split_points=["blocks.2"], transport="rpc", timeout=120)
    got = fit(piped, data, strategy)
    want = fit(plain, data)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5, atol=1e-5)
    for p, q in zip(piped.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
