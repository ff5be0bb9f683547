"""`StageReplicas`: a stage's gradients averaged over the R replicas of that stage (data parallel).

In launched mode every stage runs in R processes, one per pipeline replica, each on its own shard of
the data. Each shard module is wrapped in torch's `DistributedDataParallel` over the data-parallel
group of its stage: DDP's reducer buckets the gradients and averages them over the replicas with
its own collectives. The pipeline runs many backwards per step (one per microbatch, or its I and W
halves); DDP must reduce once, after the last one, on the sum of all of them. The forwards and
backwards therefore run on the plain module (DDP arms nothing) and `reduce` arms the reducer
(``prepare_for_backward``, as torch.distributed.pipelining does before its last backward) and then
runs one backward of a zero-valued function of every parameter: each parameter's gradient hook fires
once, the reducer averages the gradient accumulated over the step, and the zero adds nothing. This
works the same for every schedule, activation recomputation and split backward (``zero-bubble``,
whose weight half accumulates some gradients outside autograd's hooks).

A parameter that got no gradient in the step is reduced as zero (every replica agrees on the set).
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
