"""Traced (non-Sequential) models over transport="rpc": stages in worker processes train as the unsplit model.

With RPC every worker unpickles its own copy of a tied weight (the GPT's embedding and head). The
copies get the sum of their gradients before they are applied, so every holder's optimizer makes
the same update; clipping counts the weight once; a checkpoint holds one tensor for it. One pool
of three worker processes serves every pipeline of this module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET
from processes import leftover_processes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from traced_models import KeywordNet, SkipCNN, TinyGPT, gpt_batch

from lightning_pipe import PipeStrategy
from lightning_pipe.base.microbatch import split
from lightning_pipe.comm.rpc import RpcCommunicator
from lightning_pipe.engine import StageProtocol
from lightning_pipe.partition.tracer import CallArgs
from lightning_pipe.pipeline.pipeline import Pipeline

SCHEDULES = ["gpipe", "1f1b"]
GPT_SPLIT = ["blocks.1", "blocks.3"]
Criterion = Callable[[Any, Any], torch.Tensor]


@pytest.fixture(scope="module")
def pool() -> Iterator[RpcCommunicator]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    communicator = RpcCommunicator(workers=3, keep_alive=True, threads=1).start(timeout=120)
    try:
        yield communicator
    finally:
        communicator.close()
        torch.set_num_threads(threads)
        assert leftover_processes() == [], "worker processes left behind"


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference_step(model: nn.Module, args: tuple, kwargs: dict, targets: Any, criterion: Criterion, n: int) -> None:
    """The unsplit model on the same microbatches (BatchNorm sees the same rows), mean loss."""
    rows = targets.shape[0]
    for (a, kw), y in zip(split((args, kwargs), n), split(targets, n), strict=True):
        (criterion(model(*a, **kw), y) * (y.shape[0] / rows)).backward()


def assert_copies_equal(pipe: Pipeline) -> None:
    """Every holder of a tied weight has the same value and the same gradient (bitwise)."""
    stages = pipe.coordinator.stages
    values, grads = stages.call(StageProtocol.state_dict), stages.call(StageProtocol.grads)
    for holders in pipe.tied:
        (rank, name), *others = holders
        for other_rank, other_name in others:
            assert torch.equal(values[rank][name], values[other_rank][other_name]), (name, other_name)
            assert torch.equal(grads[rank][name], grads[other_rank][other_name]), (name, other_name)


def assert_transparent(
    pool: RpcCommunicator,
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    targets: Any,
    criterion: Criterion,
    steps: int = 3,
    **pipeline: Any,
) -> Pipeline:
    """Gradients equal after step 1 (1e-5); parameters, buffers and optimizer state equal after ``steps``.

    SGD with momentum on the stages (`StageOptimizers`), the global norm clipped at 0.5 every step.
    """
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with Pipeline(model, transport=pool, timeout=60, sample=CallArgs(args, kwargs), **pipeline) as pipe:
        opt = pipe.optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for step in range(steps):
            opt.zero_grad()
            ref_opt.zero_grad()
            pipe.train_step(args, targets, criterion, microbatches=4, kwargs=kwargs)
            reference_step(ref, args, kwargs, targets, criterion, 4)
            if step == 0:
                got = pipe.grads()
                for name, q in ref.named_parameters(remove_duplicate=False):  # a tied weight under each key
                    torch.testing.assert_close(got[name], q.grad, rtol=1e-5, atol=1e-5, msg=name)
            norm, ref_norm = opt.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)  # a tied weight counts once
            opt.step()
            ref_opt.step()
            assert_copies_equal(pipe)
        state, want = pipe.state_dict(), ref.state_dict()
        assert list(state) == list(want)  # parameters and buffers (BatchNorm's running statistics)
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5, msg=name)
        got_opt, want_opt = opt.state_dict(), ref_opt.state_dict()
        assert got_opt["state"].keys() == want_opt["state"].keys()
        for index, saved in want_opt["state"].items():
            torch.testing.assert_close(got_opt["state"][index], saved, rtol=1e-5, atol=1e-5)
        assert all(p.grad is None for p in model.parameters()), "gradients stay on the stages"
        pipe.sync_module()  # the module (and so eval mode) gets the stages' parameters and running statistics
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=name)
    return pipe


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_with_tied_head_and_masks(pool: RpcCommunicator, schedule: str) -> None:
    torch.manual_seed(0)
    idx, mask, targets = gpt_batch()
    pipe = assert_transparent(
        pool, TinyGPT(), (idx,), {"mask": mask}, targets, lm_loss, stages=3, schedule=schedule, split_points=GPT_SPLIT
    )
    assert pipe.tied == [[(0, "wte.weight"), (2, "head.weight")]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cnn_with_skip_connections_and_batchnorm(pool: RpcCommunicator, schedule: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    checkpoint = "always" if schedule == "gpipe" else "never"  # recomputation must not count BatchNorm twice
    model = SkipCNN()
    pipe = assert_transparent(
        pool, model, (x,), {}, y, F.cross_entropy,
        stages=3, schedule=schedule, split_points=["mid", "up2"], checkpoint=checkpoint,
    )  # fmt: skip
    assert pipe.tied == []
    assert int(model.mid[1].num_batches_tracked) == 3 * 4  # one update per microbatch, as in the reference
    assert not torch.equal(model.mid[1].running_mean, torch.zeros_like(model.mid[1].running_mean))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_keyword_arguments_and_dict_output(pool: RpcCommunicator, schedule: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, w, y = torch.randn(8, 6, generator=g), torch.rand(8, generator=g), torch.randint(0, 3, (8,), generator=g)

    def loss(out: dict[str, Any], target: torch.Tensor) -> torch.Tensor:
        assert out["scale"] == 2.0  # the constant entry of the dict comes back as the model returned it
        return F.cross_entropy(out["logits"], target) + F.mse_loss(out["recon"], torch.zeros_like(out["recon"]))

    kwargs = {"weight": w, "scale": 2.0}
    model = KeywordNet()
    assert_transparent(pool, model, (x,), kwargs, y, loss, stages=2, schedule=schedule, partition="uniform")
    with Pipeline(model, stages=2, transport=pool, timeout=60, partition="uniform") as pipe:
        out = pipe.forward((x,), microbatches=2, kwargs=kwargs)
        torch.testing.assert_close(out["logits"], model(x, **kwargs)["logits"])
        # other ways of calling it are traced here and their code (and constants) sent to the workers
        for other in ({"weight": w, "scale": 3.0}, {"weight": w}):
            out = pipe.forward((x,), microbatches=2, kwargs=other)
            torch.testing.assert_close(out["logits"], model(x, **other)["logits"])
            assert out["scale"] == [other.get("scale", 1.0)] * 2
        assert len(pipe.partitioner.variants) == 3


def test_tied_weight_checkpoint_holds_one_tensor_and_loads_into_every_holder(
    pool: RpcCommunicator, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    idx, mask, targets = gpt_batch()
    trained = TinyGPT()
    sample = CallArgs((idx,), {"mask": mask})
    with Pipeline(trained, stages=3, transport=pool, timeout=60, split_points=GPT_SPLIT, sample=sample) as pipe:
        opt = pipe.optimizer(torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9))
        for _ in range(2):
            opt.zero_grad()
            pipe.train_step((idx,), targets, lm_loss, kwargs={"mask": mask})
            opt.step()
        state, opt_state = pipe.state_dict(), opt.state_dict()
    assert state["head.weight"] is state["wte.weight"]  # one tensor, as in the module's own state_dict
    torch.save(state, tmp_path / "gpt.pt")
    loaded = torch.load(tmp_path / "gpt.pt", weights_only=True)
    assert loaded["head.weight"].untyped_storage().data_ptr() == loaded["wte.weight"].untyped_storage().data_ptr()
    plain = TinyGPT()
    plain.load_state_dict(loaded)
    # resumed from the checkpoint on other initial values, it continues as the unsplit model does
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain_opt.load_state_dict(opt_state)
    torch.manual_seed(1)
    resumed = TinyGPT()
    with Pipeline(
        resumed, stages=3, schedule="gpipe", transport=pool, timeout=60, split_points=GPT_SPLIT, sample=sample
    ) as pipe:
        opt = pipe.optimizer(torch.optim.SGD(resumed.parameters(), lr=0.3, momentum=0.5))
        pipe.load_state_dict(loaded)
        opt.load_state_dict(opt_state)
        values = pipe.coordinator.stages.call(StageProtocol.state_dict)
        torch.testing.assert_close(values[0]["wte.weight"], loaded["wte.weight"], rtol=0, atol=0)
        torch.testing.assert_close(values[2]["head.weight"], loaded["wte.weight"], rtol=0, atol=0)
        pipe.train_step((idx,), targets, lm_loss, kwargs={"mask": mask})
        opt.step()
        assert_copies_equal(pipe)
        lm_loss(plain(idx, mask=mask), targets).backward()
        plain_opt.step()
        pipe.sync_module()
    assert resumed.head.weight is resumed.wte.weight
    for (name, p), q in zip(resumed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)


class Wrapper(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, mask, targets = batch
        return lm_loss(self.model(idx, mask=mask), targets)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_gpt_under_pipestrategy_rpc_matches_a_plain_trainer(pool: RpcCommunicator) -> None:
    """Gradient accumulation (the tied sum per step adds up) and clipping by the global norm (tied counted once).

    The strategy starts its own workers; one RPC world per process, so the module's pool ends first.
    """
    pool.close()
    torch.manual_seed(0)
    piped = Wrapper(TinyGPT())
    plain = copy.deepcopy(piped)
    data = DataLoader(TensorDataset(*gpt_batch(rows=32)), batch_size=8)
    args = dict(QUIET, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    strategy = PipeStrategy(
        stages=3, microbatches=4, schedule="1f1b", split_points=GPT_SPLIT, transport="rpc", timeout=120
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        L.Trainer(**args, strategy=strategy).fit(piped, data)
        L.Trainer(**args).fit(plain, data)
    finally:
        torch.set_num_threads(threads)
    assert len(piped.losses) == len(plain.losses) == 6
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(plain.losses), rtol=1e-5, atol=1e-5)
    assert piped.model.head.weight is piped.model.wte.weight
    for (name, p), q in zip(piped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)
    assert leftover_processes() == []
