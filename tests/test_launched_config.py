"""The mode rule and launched mode's layout, checked when the Trainer is built (no process is started)."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.strategy.launcher import PipeLauncher
from lightning_pipe.strategy.layout import LAUNCHED, LOCAL, RPC, Layout, choose_mode


def trainer(strategy: PipeStrategy, devices: int = 4, num_nodes: int = 1) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False)


@pytest.mark.parametrize(
    ("transport", "processes", "mode"),
    [(None, 1, LOCAL), (None, 4, LAUNCHED), ("local", 4, LOCAL), ("rpc", 4, RPC), ("p2p", 1, LAUNCHED)],
)
def test_the_mode_follows_the_process_count_unless_a_transport_is_named(
    transport: str | None, processes: int, mode: str
) -> None:
    assert choose_mode(transport, processes) == mode


def test_a_trainer_with_four_devices_runs_two_replicas_of_two_stages() -> None:
    strategy = PipeStrategy(stages=2)
    trainer(strategy)
    layout = strategy.layout
    assert strategy.mode.name == LAUNCHED and isinstance(strategy.launcher, PipeLauncher)
    assert layout is not None and (layout.replicas, layout.ranks_per_pipeline) == (2, 2)
    assert layout.coordinates and layout.pipeline_ranks() == [1, 0] and layout.replica_ranks() == [0, 2]
    assert layout.pipeline_rank == 1  # the coordinator holds the last stage
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert strategy.world_size == 1  # as Lightning's loop sees it: its collectives span the coordinators
    assert strategy.resolve_devices() == ["cpu", "cpu"]


def test_transport_local_keeps_one_process_with_the_trainers_devices() -> None:
    strategy = PipeStrategy(transport="local")
    trainer(strategy)
    assert strategy.mode.name == LOCAL and strategy.launcher is None and strategy.layout is None
    assert strategy.resolve_devices() == ["cpu"] * 4


def test_a_layout_that_does_not_divide_fails_naming_the_numbers_and_the_fix() -> None:
    with pytest.raises(ConfigurationError) as caught:
        trainer(PipeStrategy(stages=3))
    message = str(caught.value)
    assert "stages=3" in message and "4 processes" in message and "not a multiple of 3" in message
    assert "pick stages from 1, 2, 4" in message


def test_a_pipeline_stays_in_a_node_and_replicas_span_nodes() -> None:
    layout = Layout.of(world_size=8, global_rank=5, stages=4, virtual_stages=1, devices_per_node=4)
    assert (layout.replica, layout.pipeline_rank, layout.coordinates) == (1, 2, False)
    assert layout.pipeline_ranks() == [7, 6, 5, 4] and layout.coordinator_ranks == [0, 4]
    assert layout.replica_ranks() == [1, 5]  # stage 2's data-parallel group
    assert layout.describe(7) == "global rank 7 (pipeline rank 0 of replica 1)"
    assert "replica 1: rank 4 -> pipeline rank 3 (coordinator), rank 5 -> pipeline rank 2" in layout.picture()
    interleaved = Layout.of(world_size=4, global_rank=0, stages=4, virtual_stages=2, devices_per_node=4)
    assert (interleaved.replicas, interleaved.ranks_per_pipeline) == (2, 2)


def test_a_v_placed_pipeline_is_coordinated_by_the_rank_of_stages_0_and_last() -> None:
    """zbv and dualpipev put the last stage on pipeline rank 0: the first process of a block holds it."""
    layout = Layout.of(world_size=8, global_rank=5, stages=8, virtual_stages=2, devices_per_node=4, placement="v")
    assert (layout.coordinator, layout.pipeline_rank, layout.coordinates) == (0, 3, False)
    assert layout.pipeline_ranks() == [4, 7, 6, 5] and layout.coordinator_ranks == [0, 4]
    assert layout.replica_ranks() == [1, 5]  # pipeline rank 3's data-parallel group
    assert "replica 1: rank 4 -> pipeline rank 0 (coordinator), rank 5 -> pipeline rank 3" in layout.picture()
    assert Layout.of(
        world_size=2, global_rank=0, stages=4, virtual_stages=2, devices_per_node=2, placement="v"
    ).coordinates


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"devices": ["cpu", "cpu"]}, "devices=[...]"),
        ({"runner": "linear"}, "runner='linear'"),
        ({"schedule": "async"}, "schedule='async'"),
    ],
)
def test_what_launched_mode_cannot_do_fails_when_the_trainer_is_built(options: dict, names: str) -> None:
    with pytest.raises(ConfigurationError, match="launched mode") as caught:
        trainer(PipeStrategy(stages=2, **options))
    assert names in str(caught.value)


def test_an_unknown_transport_names_the_choices() -> None:
    with pytest.raises(ConfigurationError, match="p2p"):
        PipeStrategy(transport="tcp")


def test_a_worker_of_several_stages_is_placed_on_its_process_device() -> None:
    """Virtual stages in launched mode: the spec holds a runtime per stage; each moves to the process's device."""
    from types import SimpleNamespace

    from lightning_pipe.comm.process_device import retarget
    from lightning_pipe.runtime import runtime_registry

    runtimes = {0: runtime_registry.create("cpu"), 2: runtime_registry.create("cpu")}
    spec = SimpleNamespace(shards=[SimpleNamespace(device="cuda:0")], runtime=runtimes)
    retarget(spec, "cpu")
    assert spec.shards[0].device == "cpu"
    assert spec.runtime == runtimes and all(spec.runtime[s] is runtimes[s] for s in runtimes)  # already there
    retarget(spec, "meta")
    assert sorted(spec.runtime) == [0, 2] and {r.device_spec for r in spec.runtime.values()} == {"meta"}
