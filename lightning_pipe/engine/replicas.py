"""`StageReplicas`: a stage's gradients averaged over the R replicas of that stage (data parallel, DDP).

The forwards and backwards run on the plain module; after the stage's last backward of a step `reduce` arms
DDP's reducer and runs one backward of a zero-valued function of every parameter, so DDP averages the gradient
accumulated over the step once, whatever the schedule (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class DataParallel(Protocol):
    """A stage over its replicas (DDP: `StageReplicas`, FSDP: `engine.stage_shards.StageShards`)."""

    #: whether a backward may run as its input half, then its weight half (zero-bubble's split backwards, the early
    #: input gradient of a stage's last backward); where not, a split backward runs whole at its input half
    splits: bool

    def begin(self) -> None:
        """Before a training step's first action (torchft's quorum: `engine.quorum_replicas.QuorumReplicas`)."""

    def reduce(self, stages: Iterable[int]) -> None:
        """Combine the step's gradients of ``stages`` over the replicas, after the step's last backward."""


class StageReplicas:
    """DDP of each shard module of a stage worker over ``group`` (the data-parallel group of its stage)."""

    splits = True  # DDP arms its reducer after the step: a split backward changes nothing for it

    def __init__(self, modules: dict[int, nn.Module], group: Any, devices: dict[int, torch.device]) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.ddp: dict[int, DistributedDataParallel] = {}
        for index, module in modules.items():
            if not any(p.requires_grad for p in module.parameters()):
                continue  # nothing to average (DDP refuses such a module)
            device = devices[index]
            self.ddp[index] = DistributedDataParallel(
                module,
                device_ids=[device] if device.type == "cuda" else None,
                process_group=group,
                broadcast_buffers=False,  # BatchNorm statistics stay per replica (docs/exactness.md#batchnorm)
                find_unused_parameters=False,
            )

    def begin(self) -> None:
        """Nothing before a step: DDP reduces after it."""

    def reduce(self, stages: Iterable[int]) -> None:
        """Average the step's accumulated gradients of ``stages`` over the replicas (after their last backward)."""
        for index in stages:
            ddp = self.ddp.get(index)
            if ddp is None:
                continue
            params = [p for p in ddp.module.parameters() if p.requires_grad]
            ddp.reducer.prepare_for_backward([])  # a parameter without a gradient gets the touch's zeros
            touch = torch.stack([p.reshape(-1)[:1].sum() for p in params]).sum() * 0.0
            touch.backward()
