"""``checkpoint="auto"``: stages recompute only where their device lacks the memory for the planned activation peak.

CUDA devices are the same code with another runtime: ``fakegpu:<i>`` devices (tests/rpc_models.py) run on the
cpu and report a free-memory number the test chooses, as ``torch.cuda.mem_get_info`` would.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, dataset, loader, max_param_diff
from processes import leftover_processes
from rpc_models import FakeGpuRuntime
from torch import nn
from traced_models import TinyGPT, gpt_batch

from lightning_pipe import Pipeline, PipeStrategy
from lightning_pipe.engine import StageProtocol
from lightning_pipe.engine.runners import worker_lists
from lightning_pipe.engine.stash import StageBytes
from lightning_pipe.pipeline.memory_plan import plan as memory_plan
from lightning_pipe.pipeline.recompute import RecomputePlan, plan_recompute
from lightning_pipe.runtime import DeviceMemory, runtime_registry
from lightning_pipe.schedule import get_schedule

M = 4  # microbatches


@pytest.fixture(autouse=True)
def fake_gpu() -> Iterator[None]:
    runtime_registry.register("fakegpu", FakeGpuRuntime)
    yield
    runtime_registry._classes.pop("fakegpu", None)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32)) for _ in range(4)],
        nn.Linear(32, 3),
    )


def data(rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 32, generator=g), torch.randint(0, 3, (rows,), generator=g)


# the decision, on fake numbers
def lists(schedule: str = "1f1b", stages: int = 2) -> list[list[Any]]:
    return worker_lists(get_schedule(schedule)(stages, M, 1).actions(), stages, list(range(stages)))


def memory(**free: int | None) -> dict[int, DeviceMemory | None]:
    """``memory(gpu0=..., gpu1=...)``: stage i on device ``gpu<i>`` with that many bytes free (None: no limit)."""
    return {int(k[3:]): DeviceMemory(k, v, v) if v is not None else None for k, v in free.items()}


SIZES = {0: StageBytes(full=1000, inputs=100), 1: StageBytes(full=800, inputs=100)}


def test_decision_from_free_memory_per_device() -> None:
    """1F1B, 2 stages x 4 microbatches: rank 0 holds 2 microbatches at its peak, rank 1 one."""
    roomy = plan_recompute(lists(), SIZES, memory(gpu0=10**6, gpu1=10**6), ["gpu0", "gpu1"], "1f1b", M)
    assert [(d.held, d.planned, d.recompute) for d in roomy.stages] == [(2, 2000, False), (1, 800, False)]
    assert roomy.devices == {"gpu0": (2000, 2000, 10**6), "gpu1": (800, 800, 10**6)}
    # gpu0 has 2000 bytes free: 90% of it is less than the planned 2000; recomputing, stage 0 holds 2 inputs
    # and rebuilds one microbatch at a time in the backward: 2 * 100 + 1000
    short = plan_recompute(lists(), SIZES, memory(gpu0=2000, gpu1=10**6), ["gpu0", "gpu1"], "1f1b", M)
    assert short.flags == [True, False]
    assert short.devices["gpu0"] == (2000, 1200, 2000)
    # nothing fits: every stage recomputes, the most that can be saved
    assert plan_recompute(lists(), SIZES, memory(gpu0=10, gpu1=10), ["gpu0", "gpu1"]).flags == [True, True]
    # no limit (cpu): never, whatever the numbers
    cpu = plan_recompute(lists(), SIZES, {0: None, 1: None}, ["cpu", "cpu"])
    assert cpu.flags == [False, False] and cpu.devices == {} and [d.free for d in cpu.stages] == [None, None]
    assert "no limit" in cpu.table()


def test_stages_sharing_a_device_recompute_the_largest_saving_first() -> None:
    shared = {0: DeviceMemory("gpu", 3000, 3000), 1: DeviceMemory("gpu", 3000, 3000)}
    # 2000 + 800 planned > 90% of 3000: stage 0 saves 2 x 900, stage 1 1 x 700; stage 0 alone is enough
    decided = plan_recompute(lists(), SIZES, shared, ["gpu", "gpu"])
    assert decided.flags == [True, False]
    assert decided.devices["gpu"] == (2800, 1200 + 800, 3000)
    assert decided.devices["gpu"][1] <= 0.9 * 3000


def test_split_backward_keeps_the_recomputed_graph_until_w() -> None:
    sizes = {0: StageBytes(1000, 100, split=50), 1: StageBytes(800, 100, split=40)}
    roomy = plan_recompute(lists("zero-bubble"), sizes, memory(gpu0=10**6, gpu1=10**6), ["gpu0", "gpu1"])
    want = memory_walk_peaks("zero-bubble", {0: 1000, 1: 800}, {0: 50, 1: 40})
    assert [roomy.devices[f"gpu{s}"][0] for s in range(2)] == want
    short = plan_recompute(lists("zero-bubble"), sizes, memory(gpu0=want[0], gpu1=10**6), ["gpu0", "gpu1"])
    assert short.flags == [True, False]
    # recomputed: 100 held per microbatch, and from I until W the rebuilt graph (900 more) and the 50
    assert short.devices["gpu0"][1] == memory_walk_peaks("zero-bubble", {0: 100, 1: 100}, {0: 950, 1: 40})[0]


def memory_walk_peaks(schedule: str, stash: dict[int, int], split: dict[int, int]) -> list[int]:
    from lightning_pipe.schedule.stash_walk import walk

    return [walk(actions, stash, split)[0] for actions in lists(schedule)]


# the numbers come from the stages, and match the static memory plan
def test_measured_numbers_are_the_memory_plans() -> None:
    x, y = data()
    net = model()
    never = memory_plan(copy.deepcopy(net), x, stages=2, microbatches=M, checkpoint="never", partition="uniform")
    always = memory_plan(copy.deepcopy(net), x, stages=2, microbatches=M, checkpoint="always", partition="uniform")
    with Pipeline(net, stages=2, partition="uniform") as pipe:  # checkpoint="auto" by default, cpu devices
        pipe.train_step(x, y, F.cross_entropy, microbatches=M)  # the first step measures
        decided = pipe.choices.checkpoint.plan  # type: ignore[union-attr]
        assert decided is None
        pipe.train_step(x, y, F.cross_entropy, microbatches=M)  # decides before this one
        decided = pipe.choices.checkpoint.plan  # type: ignore[union-attr]
    assert isinstance(decided, RecomputePlan) and decided.flags == [False, False]
    for d, n, a in zip(decided.stages, never.stages, always.stages, strict=True):
        want = (n.activation_bytes, a.activation_bytes, n.peak_held, None)
        assert (d.bytes.full, d.bytes.inputs, d.held, d.free) == want
        assert d.planned == n.peak_held * n.activation_bytes


# end to end: the decision is applied from the second step on, and gradients stay exact
def reference_grads(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    net.zero_grad()
    for xs, ys in zip(x.chunk(M), y.chunk(M), strict=True):
        (F.cross_entropy(net(xs), ys) * (len(ys) / len(y))).backward()
    return [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]


def train_runs(pipe: Pipeline) -> list[int]:
    trace = pipe.execution_trace(reset=True)
    return [sum(trace[s].runs.get("train", {}).values()) for s in range(2)]


def run_steps(net: nn.Module, steps: int, **kwargs: Any) -> tuple[Pipeline, list[list[int]]]:
    """``steps`` SGD steps piped and unsplit side by side: gradients equal at every step; forward runs per step."""
    x, y = data()
    ref = copy.deepcopy(net)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref))
    runs = []
    with Pipeline(net, stages=2, partition="uniform", devices=["fakegpu:0", "fakegpu:1"], **kwargs) as pipe:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            pipe.train_step(x, y, F.cross_entropy, microbatches=M)
            for p, g in zip(net.parameters(), reference_grads(ref, x, y), strict=True):
                torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-6)
            opt.step()
            ref_opt.step()
            runs.append(train_runs(pipe))
    return pipe, runs


def test_recomputes_where_the_device_is_short_and_stays_exact(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FAKE_GPU_FREE", f"0={10**9},1={10**9}")
    pipe, runs = run_steps(model(), 3)
    roomy = pipe.choices.checkpoint.plan  # type: ignore[union-attr]
    assert roomy is not None and roomy.flags == [False, False]
    # step 1 runs as except_last on devices with a limit (stage 0: forward + recompute); then nothing recomputes
    assert runs == [[2 * M, M], [M, M], [M, M]]
    # now fakegpu:0 has exactly its planned peak free: above 90% of it, so stage 0 recomputes from step 2 on
    monkeypatch.setenv("FAKE_GPU_FREE", f"0={roomy.stages[0].planned},1={10**9}")
    caplog.set_level(logging.INFO, logger="lightning_pipe")
    pipe, runs = run_steps(model(), 3)
    short = pipe.choices.checkpoint.plan  # type: ignore[union-attr]
    assert short is not None and short.flags == [True, False]
    assert runs == [[2 * M, M], [2 * M, M], [2 * M, M]]
    assert short.devices[short.stages[0].device][1] < roomy.stages[0].planned  # what recomputing saves
    logged = [r.getMessage() for r in caplog.records if "checkpoint='auto'" in r.getMessage()]
    assert len(logged) == 1 and "yes" in logged[0] and "fakegpu:0" in logged[0]


def test_traced_model_is_decided_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    gpt = TinyGPT()
    gpt.head.weight = nn.Parameter(gpt.wte.weight.detach().clone())  # untied: the stages are on two devices
    ref = copy.deepcopy(gpt)
    idx, mask, targets = gpt_batch()

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    monkeypatch.setenv("FAKE_GPU_FREE", "0=1000,1=1000000000")  # stage 0 is short, stage 1 is not
    devices = ["fakegpu:0", "fakegpu:1"]
    with Pipeline(gpt, stages=2, split_points=["blocks.2"], devices=devices) as pipe:
        for _ in range(2):
            gpt.zero_grad()
            pipe.train_step((idx,), targets, loss, microbatches=M, kwargs={"mask": mask})
        decided = pipe.choices.checkpoint.plan  # type: ignore[union-attr]
        assert train_runs(pipe) == [2 * M * 2, M * 2]  # stage 0 recomputed in both steps
    assert decided is not None and decided.flags == [True, False]
    assert all(d.bytes.full > d.bytes.inputs > 0 for d in decided.stages)
    ref.zero_grad()
    for a, kw, y in zip(idx.chunk(M), mask.chunk(M), targets.chunk(M), strict=True):
        (loss(ref(a, mask=kw), y) / M).backward()
    for (name, p), q in zip(gpt.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_rpc_workers_read_their_own_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """transport="rpc": each process that holds a stage reads the free memory of its device and measures its stage
    (stage 0 in its worker process, the last stage in the coordinator's)."""
    monkeypatch.setenv("FAKE_GPU_FREE", "0=1000,1=1000000000")  # inherited by the worker processes
    net = model()
    x, y = data()
    want = reference_grads(copy.deepcopy(net), x, y)
    devices = ["fakegpu:0", "fakegpu:1"]
    with Pipeline(net, stages=2, partition="uniform", devices=devices, transport="rpc", timeout=120) as pipe:
        for _ in range(2):
            pipe.train_step(x, y, F.cross_entropy, microbatches=M)
            pipe.coordinator.stages.call(StageProtocol.zero_grad)
        pipe.train_step(x, y, F.cross_entropy, microbatches=M)
        grads = pipe.grads()
        decided = pipe.choices.checkpoint.plan  # type: ignore[union-attr]
        pids = set(pipe.communicator.pids.values())  # type: ignore[attr-defined]
    assert leftover_processes() == []
    assert decided is not None and decided.flags == [True, False]
    measured_in = [d.device.split("/")[0] for d in decided.stages]
    assert len(pids) == 1 and measured_in == [f"pid{pid}" for pid in [*pids, os.getpid()]]
    for (name, _), g in zip(net.named_parameters(), want, strict=True):
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=name)


# under Lightning: the default, logged once per fit
def test_strategy_default_never_recomputes_on_cpu_and_logs_once_per_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[str] = []
    monkeypatch.setattr("lightning_pipe.strategy.training.rank_zero_info", logged.append)
    piped, plain = Classifier(), Classifier()
    for _ in range(2):  # two fits: one line each
        strategy = PipeStrategy(stages=2, microbatches=M)
        assert strategy.checkpoint == "auto"
        L.Trainer(**QUIET, max_steps=3, strategy=strategy).fit(piped, loader(dataset(rows=96), batch_size=16))
        L.Trainer(**QUIET, max_steps=3).fit(plain, loader(dataset(rows=96), batch_size=16))
        trace = strategy.execution_trace()
        assert [trace[s].runs["train"] for s in range(2)] == [{"eager": 3 * M}] * 2  # no forward ran twice
    assert max_param_diff(piped, plain) < 1e-6
    assert len(logged) == 2 and all("checkpoint='auto'" in line and "no limit" in line for line in logged)
