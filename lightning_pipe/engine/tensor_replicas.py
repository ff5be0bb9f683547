"""`TensorStageReplicas`: a tensor-parallel stage's gradients averaged over its R replicas (3-D launched mode).

torch's `DistributedDataParallel` does not take DTensor parameters, which a stage has once a tensor parallel plan
split its modules over the stage's tensor ranks. Each tensor rank's replica group (the processes of the same stage
and tensor rank in every replica) holds the same local parts of the same parameters, so averaging is one
all-reduce of each gradient's local part over that group, after the stage's last backward of the step, as
`lightning_pipe.engine.replicas.StageReplicas` reduces once per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_pipe.base.dtensor_shards import is_sharded, local_of


class TensorStageReplicas:
    """Averages the gradients of each shard module of a stage worker over ``group`` (its replica group)."""

    splits = True  # reduced after the step's backwards, whichever halves they ran in

    def __init__(self, modules: dict[int, nn.Module], group: Any) -> None:
        self.modules = modules
        self.group = group
        self.size = dist.get_world_size(group)

    def begin(self) -> None:
        """Nothing before a step: the gradients are all-reduced after it."""

    def reduce(self, stages: Iterable[int]) -> None:
        """Average the step's accumulated gradients of ``stages`` over the replicas (after their last backward)."""
        for index in stages:
            module = self.modules.get(index)
            if module is None:
                continue
            for param in module.parameters():
                if param.grad is None:
                    continue  # every replica runs the same steps: none of them has this gradient
                local = local_of(param.grad)
                dist.all_reduce(local, group=self.group)
                local.div_(self.size)


def has_dtensors(modules: Iterable[nn.Module]) -> bool:
    """Whether any parameter of ``modules`` is a DTensor (a tensor parallel plan split it)."""
    return any(is_sharded(p) for module in modules for p in module.parameters())
