"""`PipeStrategy`'s parts, each used alone: no Trainer, no strategy around them."""

from __future__ import annotations

from typing import Any

import torch
from helpers import Classifier, mlp

from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.strategy.building import Destination, PipelineBuilder
from lightning_pipe.strategy.checkpoints import CHECKPOINT_KEY, Checkpoints
from lightning_pipe.strategy.layout import Layout
from lightning_pipe.strategy.modes.launched_mode import LaunchedMode
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.random_state import RandomStreams
from lightning_pipe.strategy.strategy import PipeStrategy
from lightning_pipe.strategy.training import Training

ONE, TWO = (PipeConfig.of({"timeout": 30.0, "virtual_stages": v}) for v in (1, 2))  # virtual stages per rank


def builder(**overrides: Any) -> PipelineBuilder:
    arguments: dict[str, Any] = {"partition": "uniform", "checkpoint": "never", "timeout": 30.0}
    return PipelineBuilder(PipeConfig.of({**arguments, **overrides}))


def ran_eager(part: PipelineBuilder) -> list[dict[str, int]]:
    trace = part.execution_trace()
    return [trace[s].runs["eval"] for s in range(2)]


def test_the_builder_builds_the_lightning_modules_pipeline_and_hands_it_over_once_built() -> None:
    net = Classifier(mlp(depth=4))
    built: list[Pipeline] = []
    part = builder()
    placement = Destination(["cpu", "cpu"], torch.device("cpu"), None, lambda: "local", built.append)
    assert part.setup(net, placement) is net.model  # the child with the most parameters
    assert part.outside(net) == []  # every parameter is in the pipelined module
    x = torch.randn(8, 8)
    part.build_early(None)  # an nn.Sequential needs no sample: built at setup
    pipeline = part.pipeline
    try:
        assert pipeline is not None and built == [pipeline] and pipeline.balance == [3, 4]
        assert part.build(x) is pipeline  # one pipeline per fit
        assert part.pipeline_input((x,), {}) is x
        out = pipeline.unpack(pipeline.coordinator.forward_step([x]).outputs[0])
        torch.testing.assert_close(out, net.model(x), rtol=0, atol=1e-6)
        assert ran_eager(part) == [{"eager": 1}] * 2  # one forward on each stage
    finally:
        part.keep_trace()
        part.close()
    assert part.pipeline is None and ran_eager(part) == [{"eager": 1}] * 2  # kept after close


def test_random_states_go_through_a_checkpoint_before_any_pipeline_exists() -> None:
    training = Training()  # a flushed schedule's: no stream ever owns the stages
    random = RandomStreams(training)
    checkpoints = Checkpoints(builder(), StageOptimization(), random, training)
    plain = {"state_dict": {}}
    assert checkpoints.saving(plain) is plain  # nothing to add: no stage has drawn yet
    states = {"stages": [{"cpu": torch.tensor([1, 2, 3])}]}
    checkpoints.loaded({**plain, CHECKPOINT_KEY: {"random_state": states}})
    assert random.saved is states  # the stages of the next pipeline start from them
    assert checkpoints.saving(plain) == {**plain, CHECKPOINT_KEY: {"random_state": states}}
    random.keep(None)  # no pipeline ran: what was loaded stays
    assert random.saved is states


def test_the_world_places_stages_by_the_layout_without_joining_any_process_group() -> None:
    devices = [torch.device("cuda", i) for i in range(4)]  # placement only: no CUDA needed
    parts = PipeStrategy(stages=2).processes.parts  # the strategy's parts a mode holds
    coordinator = LaunchedMode(Layout.of(4, 2, 2, 1, 4), devices, ONE, parts)
    assert coordinator.layout.coordinates and coordinator.device == torch.device("cuda", 2)
    assert coordinator.stage_devices() == ["cuda:3", "cuda:2"]  # stage 0 on the replica's second process
    assert "replica 1: rank 2 -> pipeline rank 1 (coordinator), rank 3 -> pipeline rank 0" in coordinator.describe()
    interleaved = LaunchedMode(Layout.of(4, 0, 4, 2, 4), devices, TWO, parts)
    assert interleaved.stage_devices() == ["cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    tensor = torch.ones(2)
    alone = coordinator.collectives  # not connected: nothing to agree on
    assert alone.reduce(tensor) is tensor and alone.broadcast("x") == "x"
    server = LaunchedMode(Layout.of(4, 3, 2, 1, 4), devices, ONE, parts)
    assert not server.layout.coordinates and server.device == torch.device("cuda", 3)


def test_the_accelerator_sets_up_a_device_of_its_own_kind_when_stages_mix_kinds() -> None:
    """``devices=["cpu", "cuda:0"]`` under ``accelerator="cpu"``: the loss lives on cuda:0, but Lightning's CPU
    accelerator sets up (and accepts) only the cpu; a cuda accelerator with its first stage on the cpu sets up the
    first cuda stage's device. Same kind: the coordinator's device, as Lightning does."""
    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert PipelineBuilder.accelerator_device(cuda0, [cpu], ["cpu", "cuda:0"]) == cpu
    assert PipelineBuilder.accelerator_device(cpu, [cuda0], ["cpu", "cuda:1", "cpu"]) == cuda1
    assert PipelineBuilder.accelerator_device(cuda1, [cuda0, cuda1], ["cuda:0", "cuda:1"]) == cuda1
    assert PipelineBuilder.accelerator_device(cpu, None, ["cpu", "cpu"]) == cpu
