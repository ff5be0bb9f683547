"""`CoordinatorCollectives`: Lightning's collectives in launched mode, among the coordinators.

The coordinators (the first process of each replica's block) run Lightning's loop; the processes serving a stage do
not, so Lightning's collectives span the coordinators' group (`lightning_pipe.strategy.process_groups`) only. With
one replica, or in a serving process, there is nothing to agree on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from typing_extensions import override

from lightning_pipe.strategy.layout import Layout
from lightning_pipe.strategy.modes.mode import Collectives
from lightning_pipe.strategy.process_groups import ProcessGroups


class CoordinatorCollectives(Collectives):
    """The collectives of this process (at ``layout``'s global rank, on ``device``) once ``groups`` exist (set when
    the processes join: `LaunchedMode.connect`)."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.groups: ProcessGroups | None = None

    def _coordinator_group(self) -> Any:
        """The coordinators' group; None where there is nothing to agree on (one replica, or a serving rank)."""
        layout = self.layout
        if len(layout.coordinator_ranks) == 1 or self.groups is None or not layout.coordinates:
            return None
        return self.groups.coordinators

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._coordinator_group() is None:
            return decision
        votes = self.reduce(torch.tensor(int(decision), device=self.device), reduce_op="sum")
        return bool(votes == len(self.layout.coordinator_ranks)) if all else bool(votes)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        coordinators = self._coordinator_group()
        if coordinators is None or not isinstance(tensor, torch.Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group or coordinators, reduce_op=reduce_op)

    @override
    def barrier(self) -> None:
        coordinators = self._coordinator_group()
        if coordinators is not None:
            self.wait(coordinators)

    def wait(self, group: Any) -> None:
        """A barrier of ``group`` (None: every process), on this process's device where NCCL needs one."""
        if self.device.type == "cuda":
            dist.barrier(group=group, device_ids=[self.device.index or 0])
        else:
            dist.barrier(group=group)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        coordinators = self._coordinator_group()
        if coordinators is None:
            return obj
        box = [obj]
        ranks = self.layout.coordinator_ranks  # Lightning names a global rank; only coordinators take part
        dist.broadcast_object_list(box, src=src if src in ranks else ranks[0], group=coordinators)
        return box[0]

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        coordinators = self._coordinator_group()
        if coordinators is None:
            return tensor
        return _all_gather_ddp_if_available(tensor, group=group or coordinators, sync_grads=sync_grads)
