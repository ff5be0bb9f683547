"""`StageShards`: a stage sharded over its R replicas with FSDP2 (``PipeStrategy(data_parallel="fsdp")``).

Each repeated block of the stage is its own ``fully_shard`` unit, the stage module the root over the rest; or, where
the LightningModule's ``configure_model`` called ``fully_shard`` itself (Lightning's TP x FSDP recipe, its calls
recorded: `lightning_pipe.engine.fsdp_deferral`), its units as the stage holds them (`stage_units`). Gradient
reduction is off during a step's many backwards; after the stage's last backward `reduce` runs FSDP's post-backward
itself, as torch.distributed.pipelining does: one reduce-scatter per unit (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_pipe.engine.fsdp_deferral import ShardUnit
from lightning_pipe.engine.fsdp_internals import post_backward


class StageShards:
    """FSDP2 of each shard module of a stage worker over ``mesh`` (the 1-D mesh of its stage's replicas): each repeated
    block a unit, or ``units`` (the user's ``fully_shard`` calls, `stage_units`), the shard module the root; and
    ``earlier``: the root modules (by stage index) of stages an earlier run in this process sharded, as they are.

    FSDP runs a block's backward with its gathered parameters and frees them after: a weight gradient computed
    after the input gradient (a split backward) would miss them. So a stage sharded here never splits a
    backward (``splits``): zero-bubble's split backwards run whole at their input half (the same gradients;
    the weight halves' place in the schedule stays empty).
    """

    splits = False

    def __init__(
        self,
        modules: dict[int, nn.Module],
        mesh: Any,
        mixed_precision: Any = None,
        units: list[ShardUnit] | None = None,
        earlier: dict[int, nn.Module] | None = None,
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = mixed_precision if mixed_precision is not None else MixedPrecisionPolicy()
        self.modules: dict[int, Any] = {}
        for index, module in modules.items():
            if not any(p.requires_grad for p in module.parameters()):
                continue
            if units is None:
                for block in blocks(module):
                    fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
                root = fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
            else:  # the user's units (their keyword arguments, the Trainer's precision where they gave none)
                inside, root_kwargs = stage_units(module, units)
                for unit in inside:
                    fully_shard(unit.target, **{"mp_policy": policy, **unit.kwargs})
                root = fully_shard(module, **{"mesh": mesh, "mp_policy": policy, **(root_kwargs or {})})
            self.modules[index] = root
        self.modules.update(earlier or {})  # sharded by an earlier run in this process: run again as they are
        for root in self.modules.values():
            root.set_requires_gradient_sync(False)  # reduced once per step, in `reduce`

    def begin(self) -> None:
        """Nothing before a step: FSDP gathers each block when it runs and reduces after the step."""

    def reduce(self, stages: Iterable[int]) -> None:
        """Reduce-scatter the step's accumulated gradients of ``stages`` (after their last backward)."""
        for index in stages:
            module = self.modules.get(index)
            if module is None:
                continue
            module.set_is_last_backward(True)
            module.set_requires_gradient_sync(True)
            post_backward(module)  # FSDP's post-backward, run where autograd would have (its private state)
            module.set_requires_gradient_sync(False)


def stage_units(stage: nn.Module, units: list[ShardUnit]) -> tuple[list[ShardUnit], dict[str, Any] | None]:
    """The user's ``fully_shard`` units as the stage module ``stage`` holds them: those lying wholly inside it (every
    module of the unit one of the stage's), in the user's order (innermost first, as FSDP2 requires); and the keyword
    arguments of the stage's root, those of the first unit that spans stages (holds some of the stage's parameters
    and more: the whole model, the LightningModule, a list split between stages; None where none does). A unit that
    holds nothing of the stage (another stage's) is left out: this process does not hold it."""
    modules, own = {id(m) for m in stage.modules()}, {id(p) for p in stage.parameters()}
    inside: list[ShardUnit] = []
    root: dict[str, Any] | None = None
    for unit in units:
        held = [id(m) in modules and m is not stage for m in unit.modules]
        if held and all(held):
            inside.append(unit)
        elif root is None and (any(held) or any(id(p) in own for m in unit.modules for p in m.parameters())):
            root = unit.kwargs
    return inside, root


def blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``module``: the elements of a list of modules (an ``nn.ModuleList``, an
    ``nn.Sequential``, or any module whose children are named 0, 1, ..., as a traced stage holds them) that
    have parameters, outermost first (a block's own lists are part of it)."""
    found: list[nn.Module] = []

    def visit(node: nn.Module) -> None:
        names = list(node._modules)
        listed = isinstance(node, (nn.ModuleList, nn.Sequential)) or (bool(names) and all(n.isdigit() for n in names))
        for child in node.children():
            if listed and any(True for _ in child.parameters()):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


def mixed_precision_policy(precision: str | None) -> Any:
    """FSDP's policy for a Lightning precision, as Lightning's FSDP strategy maps them.

    ``"*-true"`` gathers and reduces in that dtype; ``"*-mixed"`` keeps fp32 parameters (autocast computes in
    the low precision) and reduces gradients in fp32, so a mixed run's gradients match DDP's.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {"16-true": torch.float16, "bf16-true": torch.bfloat16}.get(str(precision))
    if low is not None:
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
    return MixedPrecisionPolicy()
