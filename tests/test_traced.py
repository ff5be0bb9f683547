"""Models that are not nn.Sequential, split through their traced graph: gradients equal the unsplit model's."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from traced_models import KeywordNet, SkipCNN, TinyGPT, gpt_batch

from lightning_pipe.base.errors import ConfigurationError, PartitionError
from lightning_pipe.base.microbatch import split
from lightning_pipe.engine import StageProtocol
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.partition.tracer import CallArgs, TraceError
from lightning_pipe.pipeline.pipeline import Pipeline

SCHEDULES = ["gpipe", "1f1b"]
Criterion = Callable[[Any, Any], torch.Tensor]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny ops: intra-op threads only add synchronisation (and stage threads already run in parallel)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_step(model: nn.Module, args: tuple, kwargs: dict, targets: Any, criterion: Criterion, n: int) -> None:
    """The unsplit model on the same microbatches (BatchNorm sees the same rows), mean loss."""
    rows = targets.shape[0]
    for (a, kw), y in zip(split((args, kwargs), n), split(targets, n), strict=True):
        (criterion(model(*a, **kw), y) * (y.shape[0] / rows)).backward()


def assert_transparent(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    targets: Any,
    criterion: Criterion,
    steps: int = 3,
    microbatches: int = 4,
    **pipeline: Any,
) -> Pipeline:
    """Gradients equal after one step (1e-5); parameters and buffers equal after ``steps`` SGD steps."""
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    with Pipeline(model, **pipeline) as pipe:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            pipe.train_step(args, targets, criterion, microbatches=microbatches, kwargs=kwargs)
            reference_step(ref, args, kwargs, targets, criterion, microbatches)
            if step == 0:
                for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                    assert p.grad is not None, name
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
            opt.step()
            ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    for a, b in zip(model.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return pipe


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_with_tied_head_and_masks(schedule: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    idx, mask, targets = gpt_batch()
    pipe = assert_transparent(
        model, (idx,), {"mask": mask}, targets, lm_loss,
        stages=3, schedule=schedule, split_points=["blocks.1", "blocks.3"],
    )  # fmt: skip
    # the embedding (stage 0) and the head (stage 2) still share one Parameter, as in the model
    assert model.head.weight is model.wte.weight
    assert pipe.shards[0].module.wte.weight is pipe.shards[2].module.head.weight
    assert pipe.partitioner.tied == [[(0, "wte.weight"), (2, "head.weight")]]
    # the attention bias (mask and causal buffer) is made in stage 0 and forwarded to stages 1 and 2
    assert len(pipe.shards[1].module.inputs) == 2 and len(pipe.shards[2].module.inputs) == 2
    # shard keys are the model's own keys
    keys = set(model.state_dict())
    for shard in pipe.shards:
        assert set(shard.module.state_dict()) <= keys


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cnn_with_skip_connections_and_batchnorm(schedule: str) -> None:
    torch.manual_seed(0)
    model = SkipCNN()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    pipe = assert_transparent(
        model, (x,), {}, y, F.cross_entropy,
        stages=3, schedule=schedule, split_points=["mid", "up2"], checkpoint="except_last",
    )  # fmt: skip
    # down1's output is forwarded through stage 1 (which does not use it) to stage 2
    assert "down1_2" in pipe.shards[1].module.inputs and "down1_2" in pipe.shards[2].module.inputs
    uses = [line.strip()[:6] for line in pipe.shards[1].module.code().splitlines() if "down1_2" in line]
    assert uses == ["def fo", "return"]  # stage 1 only receives and returns it
    # eval mode uses the running statistics, as the unsplit model does
    model.eval()
    with Pipeline(model, stages=3, schedule=schedule, split_points=["mid", "up2"], sample=x) as pipe:
        pipe.coordinator.stages.call(StageProtocol.train, False)
        torch.testing.assert_close(pipe.forward(x, microbatches=2), model(x))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_keyword_arguments_and_dict_output(schedule: str) -> None:
    torch.manual_seed(0)
    model = KeywordNet()
    g = torch.Generator().manual_seed(0)
    x, w, y = torch.randn(8, 6, generator=g), torch.rand(8, generator=g), torch.randint(0, 3, (8,), generator=g)
    seen: list[Any] = []

    def loss(out: dict[str, Any], target: torch.Tensor) -> torch.Tensor:
        seen.append(out["scale"])
        return F.cross_entropy(out["logits"], target) + F.mse_loss(out["recon"], torch.zeros_like(out["recon"]))

    assert_transparent(
        model, (x,), {"weight": w, "scale": 2.0}, y, loss, stages=2, schedule=schedule, partition="uniform"
    )
    assert set(seen) == {2.0}  # the constant entry of the dict comes back as the model returned it
    with Pipeline(model, stages=2, partition="uniform") as pipe:
        out = pipe.forward((x,), microbatches=2, kwargs={"weight": w, "scale": 2.0})
        assert set(out) == {"logits", "recon", "scale"}
        torch.testing.assert_close(out["logits"], model(x, weight=w, scale=2.0)["logits"])
        # other ways of calling it are traced as variants, cut at the same places
        for kwargs in ({"weight": w, "scale": 3.0}, {"weight": w}):
            out = pipe.forward((x,), microbatches=2, kwargs=kwargs)
            torch.testing.assert_close(out["logits"], model(x, **kwargs)["logits"])
            assert out["scale"] == [kwargs.get("scale", 1.0)] * 2  # one per microbatch
        assert len(pipe.partitioner.variants) == 3
        with pytest.raises(PartitionError, match="does not match KeywordNet.forward"):
            pipe.forward((x,), kwargs={"mask": w})


@pytest.mark.parametrize("method", ["uniform", "params", "memory", "time", [2, 3, 3]])
def test_balancing_methods_on_the_traced_graph(method: Any) -> None:
    model = TinyGPT(layers=4)
    idx, mask, _ = gpt_batch()
    shards = TracedPartitioner(method).partition(model, ["cpu"] * 3, CallArgs((idx,), {"mask": mask}))
    layers = [layer for shard in shards for layer in shard.layers]
    assert layers == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]
    assert all(shard.layers for shard in shards)
    if isinstance(method, list):
        assert [len(s.layers) for s in shards] == method


def test_partition_errors_name_the_fix() -> None:
    model = TinyGPT(layers=2)
    idx, mask, _ = gpt_batch()
    call = CallArgs((idx,), {"mask": mask})
    with pytest.raises(PartitionError, match="sum to the 6 layers"):
        TracedPartitioner([1, 1]).partition(model, ["cpu"] * 2, call)
    with pytest.raises(PartitionError, match="calls only 6 layers"):
        TracedPartitioner("uniform").partition(model, ["cpu"] * 7, call)
    with pytest.raises(PartitionError, match="give stages - 1 = 1 split points"):
        TracedPartitioner(split_points=["blocks.0", "blocks.1"]).partition(model, ["cpu"] * 2, call)
    with pytest.raises(PartitionError, match="not in the order"):
        TracedPartitioner(split_points=["blocks.1", "blocks.0"]).partition(model, ["cpu"] * 3, call)
    with pytest.raises(PartitionError, match="not called by the traced forward"):
        TracedPartitioner(split_points=["nothing"]).partition(model, ["cpu"] * 2, call)
    with pytest.raises(PartitionError, match="example call"):
        TracedPartitioner().partition(model, ["cpu"] * 2, None)


def test_tied_weight_on_two_devices_is_refused_by_the_local_transport() -> None:
    """Stage threads share the one Parameter; two devices would each move it (checked before anything moves)."""
    model = TinyGPT(layers=2)
    idx, mask, _ = gpt_batch()
    pipe = Pipeline(model, stages=2, devices=["cpu", "cuda:0"], sample=CallArgs((idx,), {"mask": mask}))
    with pytest.raises(ConfigurationError, match=r"stage 0 \(cpu\) as 'wte.weight', stage 1 \(cuda:0\) as 'head"):
        pipe.start()
    pipe.close()
    assert model.wte.weight.device.type == "cpu"


class Vmapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.vmap(torch.sin)(self.a(x)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.inner, self.last = nn.Linear(4, 4), Vmapped(), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.inner(self.first(x)))


def test_untraceable_code_in_the_forward_is_named() -> None:
    with pytest.raises(TraceError) as info:
        TracedPartitioner().partition(Vmapped(), ["cpu"] * 2, torch.randn(3, 4))
    message = str(info.value)
    assert "return self.b(torch.vmap(torch.sin)(self.a(x)))" in message  # the line that stopped the tracer
    assert "test_traced.py" in message and "top-level forward of Vmapped" in message
    assert "leaf_modules=" in message and "split_points=" in message and "nn.Sequential" in message


def test_untraceable_submodule_is_kept_whole() -> None:
    torch.manual_seed(0)
    model, x = Outer(), torch.randn(6, 4)
    with pytest.warns(UserWarning, match="could not trace into 'inner'"):
        shards = TracedPartitioner("uniform").partition(model, ["cpu"] * 3, x)
    assert [s.layers for s in shards] == [["first"], ["inner"], ["last"]]
    out: Any = (0, x)  # (call variant, inputs)
    for shard in shards:
        out = shard.module(*out)
    torch.testing.assert_close(out[1], model(x))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = -h
        return self.b(h)


def test_control_flow_on_tensor_values_warns() -> None:
    with pytest.warns(UserWarning, match=r"if h.sum\(\) > 0"):
        TracedPartitioner("uniform").partition(DataDependent(), ["cpu"] * 2, torch.randn(3, 4))


class TrainingBranch(nn.Module):
    """Dropout written as functional code on ``self.training``: traced once per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.training:
            h = F.dropout(h, 0.5, training=True)
        return self.b(h)


def test_eval_mode_has_its_own_graph() -> None:
    torch.manual_seed(0)
    model, x = TrainingBranch(), torch.randn(6, 4)
    with Pipeline(model, stages=2, partition="uniform", sample=x) as pipe:
        assert "dropout" in pipe.shards[0].module.code(True) and "dropout" not in pipe.shards[0].module.code(False)
        pipe.coordinator.stages.call(StageProtocol.train, False)
        model.eval()
        torch.testing.assert_close(pipe.forward(x, microbatches=2), model(x))
    assert not any(name.startswith("_tensor_constant") for name in vars(model))  # the model is left as it was


def test_tracing_leaves_the_model_unchanged() -> None:
    from lightning.pytorch.demos import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab_size=20, ninp=8, nhead=2, nhid=8, nlayers=1, dropout=0.0)
    x = torch.randint(0, 20, (2, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TracedPartitioner("uniform").partition(model, ["cpu"] * 2, (x, x))
    assert model.src_mask is None and model.pos_encoder.pe is None  # caches the forward sets stay unset
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])


class RowLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.stack([row * 2 for row in h]))


def test_loops_over_rows_warn() -> None:
    with pytest.warns(UserWarning, match=r"(?s)fixed to the example's size.*for row in h"):
        TracedPartitioner("uniform").partition(RowLoop(), ["cpu"] * 2, torch.randn(3, 4))


def test_split_point_inside_a_block_traces_into_it() -> None:
    torch.manual_seed(0)
    model, (idx, mask, targets) = TinyGPT(layers=2), gpt_batch()
    pipe = assert_transparent(
        model, (idx,), {"mask": mask}, targets, lm_loss, steps=1, stages=2, split_points=["blocks.0.mlp"]
    )
    assert pipe.shards[1].layers[:3] == ["blocks.0.mlp.0", "blocks.0.mlp.1", "blocks.0.mlp.2"]
    assert "blocks.0.qkv" in pipe.shards[0].layers  # the first half of the block runs in stage 0
