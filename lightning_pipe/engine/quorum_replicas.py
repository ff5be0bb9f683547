"""`QuorumReplicas`: a stage's gradients averaged over the replica groups in torchft's quorum (fault tolerance).

Each pipeline replica is a torchft replica group; stage ``s`` of every group averages with stage ``s`` of the others
through a torchft ``Manager`` (its managed process group, over the replica groups that are in the quorum). Before
a training step's first action `begin` joins the step's quorum (synchronously: a group that joins heals right there,
the Manager loading a live peer's state through `lightning_pipe.strategy`'s callbacks, so its forwards already run on
the healed parameters and its batch counts); after the stage's last backward `reduce` all-reduces the gradients (one
flat buffer) over the groups in the quorum and asks ``should_commit``; the stage's optimizer steps only where the
step committed (`should_step`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class QuorumReplicas:
    """`DataParallel` over torchft's quorum: ``manager`` is this process's ``torchft.Manager`` (any object with its
    ``start_quorum``, ``allreduce`` and ``should_commit``)."""

    splits = True  # the gradients are reduced after the step, whatever the backwards were

    def __init__(self, modules: dict[int, nn.Module], manager: Any) -> None:
        self.modules = modules
        self.manager = manager
        self.committed = True  # the last step's should_commit

    def begin(self) -> None:
        """Join this step's quorum (every process of every group in it, before its forwards)."""
        self.manager.start_quorum()

    def reduce(self, stages: Iterable[int]) -> None:
        """Average the step's gradients over the groups in the step's quorum, decide whether to commit."""
        params = [p for i in stages if i in self.modules for p in self.modules[i].parameters() if p.requires_grad]
        grads = []
        for p in params:
            if p.grad is None:  # every group sends the same layout of values
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()  # summed, divided by the groups in the quorum
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.committed = bool(self.manager.should_commit())  # a healing group loads its peer's state here

    def should_step(self) -> bool:
        """Whether this step's optimizer step goes ahead (False: a group failed during the step; torchft drops it)."""
        return self.committed
