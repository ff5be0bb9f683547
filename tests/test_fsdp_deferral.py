"""A ``configure_model``'s ``fully_shard`` calls deferred (`lightning_pipe.engine.fsdp_deferral`) and applied per stage
(`lightning_pipe.engine.stage_shards.stage_units`), in this process: a gloo world of one rank, no launch.

The launched proof (Lightning's TP x FSDP recipe trained unchanged as 2 x 2 x 2, equal to the plain model) is
tests/test_llama_3d.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard  # as a user's module imports it: the wrapper itself

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.engine import fsdp_deferral
from lightning_pipe.engine.fsdp_deferral import ShardUnit, deferred, unavailable
from lightning_pipe.engine.stage_shards import StageShards, stage_units
from lightning_pipe.strategy.process_stage import ProcessStage
from lightning_pipe.strategy.tensor_parallel import refuse_self_sharded


@pytest.fixture
def mesh() -> Iterator[Any]:
    """A gloo world of one process and its mesh with launched mode's names (data_parallel x pipeline x tensor)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("data_parallel", "pipeline", "tensor_parallel"))
    finally:
        torch.distributed.destroy_process_group()


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 8), nn.Linear(8, 2))


def composable_keys(module: nn.Module) -> list[str]:
    """What torch's ``@contract`` wrapper wrote on ``module`` and its children (its state and registry entries)."""
    return [key for m in module.modules() for key in m.__dict__ if key.startswith("__composable_api")]


def the_wrapped() -> Any:
    """What ``fully_shard`` calls now: the function its wrapper's closure variable ``func`` holds."""
    return fully_shard.__closure__[fully_shard.__code__.co_freevars.index("func")].cell_contents  # type: ignore[index]


def test_the_calls_are_recorded_in_order_and_leave_the_modules_as_they_were(mesh: Any) -> None:
    """Under `ProcessStage.deferring` each call (a module, or a list of modules as one unit) is recorded with its
    keyword arguments and returns the module unchanged: no FSDP class, no state or registry entry left; a later real
    ``fully_shard`` of the same module shards it."""
    net, stage, data = model(), ProcessStage(), mesh["data_parallel"]
    real = the_wrapped()
    with stage.deferring(mesh):
        assert fully_shard(net[1], mesh=data, reshard_after_forward=False) is net[1]
        fully_shard([net[2], net[3]], mesh=data)
        fully_shard(net, mesh=data)
    assert the_wrapped() is real
    assert stage.units is not None
    assert [unit.modules for unit in stage.units] == [[net[1]], [net[2], net[3]], [net]]
    kept = {"mesh": data, "reshard_after_forward": False}
    assert [unit.kwargs for unit in stage.units] == [kept, {"mesh": data}, {"mesh": data}]
    assert not any(isinstance(m, FSDPModule) for m in net.modules()) and composable_keys(net) == []
    fully_shard(net[1], mesh=data)
    fully_shard(net, mesh=data)
    assert isinstance(net[1], FSDPModule) and isinstance(net, FSDPModule)
    assert fully_shard.state(net) is not None  # type: ignore[attr-defined]


def test_the_real_fully_shard_is_back_after_an_error_and_nothing_is_recorded_without_a_mesh(mesh: Any) -> None:
    """An exception inside ``configure_model`` leaves the real ``fully_shard`` in place; local and rpc mode (no device
    mesh) defer nothing: a call there shards, and `refuse_self_sharded` names the fix."""
    net, stage, real = model(), ProcessStage(), the_wrapped()
    with pytest.raises(KeyError), stage.deferring(mesh):
        fully_shard(net[0], mesh=mesh["data_parallel"])
        raise KeyError("configure_model failed")
    assert the_wrapped() is real and composable_keys(net) == []
    with stage.deferring(None):
        fully_shard(net[1], mesh=mesh["data_parallel"])
    assert isinstance(net[1], FSDPModule)
    with pytest.raises(ConfigurationError, match=r"with fully_shard \(1\) before PipeStrategy cut it.*launched"):
        refuse_self_sharded(net)
    # a process that serves a stage raises it when a stage is built there (its coordinator, refusing the same at
    # setup, releases it first): raised at bind, the release would be left for the next run to read
    with pytest.raises(ConfigurationError, match="before PipeStrategy cut it"):
        stage.bind(net, net)
    stage.bind(net, net, serving=True)
    with pytest.raises(ConfigurationError, match="before PipeStrategy cut it"):
        stage.prepare(None)


@pytest.mark.parametrize("given", ["none", "whole", "tensor"])
def test_a_call_over_another_mesh_than_the_stages_replicas_is_refused_naming_it(mesh: Any, given: str) -> None:
    """No mesh (torch's default: the whole world), the 3-D mesh or the tensor dimension: each fails inside
    ``configure_model``, naming ``self.device_mesh["data_parallel"]``; nothing is left on the module."""
    net, stage = model(), ProcessStage()
    kwargs = {"none": {}, "whole": {"mesh": mesh}, "tensor": {"mesh": mesh["tensor_parallel"]}}[given]
    shown = {"none": "no mesh", "whole": r"mesh=a DeviceMesh\(1, 1, 1\)", "tensor": r"over \('tensor_parallel',\)"}
    with pytest.raises(ConfigurationError, match=rf"{shown[given]}.*pass mesh=self.device_mesh\[\"data_parallel\"\]"):
        with stage.deferring(mesh):
            fully_shard(net, **kwargs)
    assert stage.units is None and composable_keys(net) == []


def test_a_torch_whose_fully_shard_differs_defers_nothing_and_the_refusal_says_why(
    mesh: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.fsdp

    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard", lambda module, **kwargs: module)
    why = unavailable()
    assert why is not None and "changed fully_shard's wrapper" in why and fsdp_deferral.TESTED_WITH in why
    with deferred(lambda kwargs: None) as units:
        assert units is None
    net = model()
    fully_shard(net[0], mesh=mesh["data_parallel"])  # the real one: the module's import was not deferred
    with pytest.raises(ConfigurationError, match="defers the fully_shard calls of configure_model, but torch"):
        refuse_self_sharded(net, why)


def test_each_stage_applies_the_units_it_holds_and_a_unit_over_stages_becomes_its_root(mesh: Any) -> None:
    """Stage 0 holds net[0] and net[1], stage 1 the rest: net[1] is stage 0's own unit, net[2] stage 1's; the whole
    model and a list split between the stages span them (the first such unit's arguments are the root's)."""
    net = model()
    first, second = nn.Sequential(net[0], net[1]), nn.Sequential(net[2], net[3])
    units = [ShardUnit(net[1], {"a": 1}), ShardUnit(net[2], {"b": 2}), ShardUnit([net[1], net[3]], {"c": 3}),
             ShardUnit(net, {"d": 4})]  # fmt: skip
    assert stage_units(first, units) == ([units[0]], {"c": 3})
    assert stage_units(second, units) == ([units[1]], {"c": 3})
    assert stage_units(nn.Sequential(net[3]), units[:2]) == ([], None)  # another stage's units only: just a root
    assert stage_units(second, [ShardUnit(second, {"e": 5})]) == ([], {"e": 5})  # the stage module itself: its root


def test_a_stage_sharded_with_the_recorded_units_computes_the_plain_gradients(mesh: Any) -> None:
    """`StageShards` with the recorded units (one replica: the gradients are the plain module's, whatever the
    grouping): the stage's own unit and its root are FSDP modules, another stage's unit is not touched; the user's
    ``reshard_after_forward`` is kept and the Trainer's precision policy fills in the policy they gave none of."""
    net, plain, stage, data = model(), model(), ProcessStage(), mesh["data_parallel"]
    with stage.deferring(mesh):
        fully_shard(net[1], mesh=data, reshard_after_forward=False)
        fully_shard(net[2], mesh=data)
        fully_shard(net, mesh=data)
    assert stage.units is not None
    first = nn.Sequential(net[0], net[1])
    shards = StageShards({0: first}, data, None, stage.units)
    assert isinstance(first, FSDPModule) and isinstance(net[1], FSDPModule) and not isinstance(net[2], FSDPModule)
    assert fully_shard.state(net[1])._fsdp_param_groups[0].post_forward_mesh_info is None  # type: ignore[attr-defined]
    x = torch.randn(3, 4)
    first(x).square().sum().backward()
    shards.reduce([0])
    plain[:2](x).square().sum().backward()
    for got, expected in zip(first.parameters(), plain[:2].parameters(), strict=True):
        assert torch.allclose(got.grad.full_tensor(), expected.grad, atol=1e-6)  # type: ignore[union-attr]


def test_what_a_self_sharded_module_cannot_run_is_refused_at_setup_naming_the_fix(mesh: Any) -> None:
    """`ProcessStage.sharded` is the one answer to "are this process's stages FSDP stages": ``data_parallel="fsdp"``
    or recorded units, with a second replica only. Where it is the module's own calls (known once configure_model
    ran), the builder refuses one file and a split-backward schedule as ``data_parallel="fsdp"`` is refused when the
    strategy is made (each naming a fix that works for that module), and ``schedule="auto"`` drops split backwards."""
    from lightning_pipe.strategy.arguments import FSDP_ARGUMENT, SELF_SHARDED
    from lightning_pipe.strategy.building import PipelineBuilder
    from lightning_pipe.strategy.pipe_config import PipeConfig
    from lightning_pipe.strategy.strategy import PipeStrategy

    def config(**options: Any) -> PipeConfig:
        return PipeStrategy(stages=2, **options).config

    stage = ProcessStage("ddp")
    with stage.deferring(mesh):
        fully_shard(model()[0], mesh=mesh["data_parallel"])
    assert stage.units and stage.sharded is None  # one replica: nothing is sharded
    stage.replicate_over(object(), mesh["data_parallel"])
    assert stage.sharded == SELF_SHARDED and ProcessStage("fsdp", None).sharded is None
    fsdp = ProcessStage("fsdp")
    fsdp.replicate_over(object(), mesh["data_parallel"])
    assert fsdp.sharded == FSDP_ARGUMENT
    with pytest.raises(ConfigurationError, match=r"configure_model.s fully_shard calls .*save_distributed_ch.*"
                       r"consolidate"):  # fmt: skip
        PipelineBuilder(config(save_distributed_checkpoint=False)).selection.stages_sharded(stage.sharded)
    for schedule in ("zero-bubble", "zbv"):
        builder = PipelineBuilder(config(schedule=schedule, virtual_stages=2 if schedule == "zbv" else 1))
        with pytest.raises(ConfigurationError, match=rf"schedule='{schedule}'\).*'looped-bfs' with FSDP, or "
                           r"configure_model without its fully_shard calls"):  # fmt: skip
            builder.selection.stages_sharded(stage.sharded)
    builder = PipelineBuilder(config(schedule="auto"))
    assert builder.selection.schedule.split_backward
    builder.selection.stages_sharded(stage.sharded)
    assert not builder.selection.schedule.split_backward  # the probe and the choice leave out zero-bubble and its kin
    PipelineBuilder(config(schedule="1f1b")).selection.stages_sharded(stage.sharded)  # a whole backward: FSDP runs it
    v = PipelineBuilder(PipeStrategy(stages=4, virtual_stages=2, schedule="auto", microbatches=8).config)
    assert v.selection.rank_placement == "v"  # placed (before configure_model) for ZB-V, which splits its backward
    with pytest.raises(ConfigurationError, match=r"placed the stages for .*'v'.*AutoSchedule\(split_backward=False\)"):
        v.selection.stages_sharded(stage.sharded)


def test_a_later_run_runs_the_stages_a_run_sharded_again_and_refuses_another_cut_naming_the_fix(mesh: Any) -> None:
    """After a run sharded this process's stage (FSDP units and root), a later run (validate, test, predict, a further
    fit) cuts the module anew: a stage holding the same modules gets the earlier root in its place (FSDP's units and
    shards as they are; torch cannot undo ``fully_shard``), with the earlier values; a cut that moves a sharded module
    into another stage is refused naming the fix; a stage of modules FSDP never touched is left to be sharded."""
    from types import SimpleNamespace

    from lightning_pipe.strategy.process_stage import reuse

    net, data = model(), mesh["data_parallel"]
    earlier = nn.Sequential(net[0], net[1])
    StageShards({0: earlier}, data)
    assert isinstance(earlier, FSDPModule) and isinstance(net[1], FSDPModule)
    x = torch.randn(3, 4)
    with torch.no_grad():
        before = earlier(x)
    again = SimpleNamespace(index=0, module=nn.Sequential(net[0], net[1]))  # the later run's cut, bound here
    assert reuse([again], {0: earlier}) == {0: earlier} and again.module is earlier
    with torch.no_grad():
        assert torch.equal(StageShards({}, data, earlier={0: earlier}).modules[0](x), before)
    other = SimpleNamespace(index=1, module=nn.Sequential(net[2], net[3]))
    assert reuse([other], {0: earlier}) == {} and not isinstance(other.module, FSDPModule)
    moved = SimpleNamespace(index=0, module=nn.Sequential(net[1], net[2]))  # another partition: net[1] elsewhere
    with pytest.raises(ConfigurationError, match=r"trainer.validate\(MyModule\(\), dataloader, ckpt_path=path\)"):
        reuse([moved], {0: earlier})
    refuse_self_sharded(net, ours={id(m) for m in earlier.modules()})  # the earlier run's own units: not refused
    with pytest.raises(ConfigurationError, match="before PipeStrategy cut it"):
        refuse_self_sharded(net)
