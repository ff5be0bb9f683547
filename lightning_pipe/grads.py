"""`GradStash`: keeps a step's parameter gradients aside until Lightning's ``backward``.

Lightning zeroes gradients after ``training_step`` and before ``backward``; the pipeline computes
them during ``training_step``. The stash saves whatever ``p.grad`` held (an accumulation window),
lets the step write fresh gradients, then restores the old ones and keeps the new aside until
`apply` adds them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class GradStash:
    def __init__(self, params: Iterable[nn.Parameter] = ()) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._saved: list[torch.Tensor | None] = []
        self._step: list[torch.Tensor | None] = []

    def begin(self) -> None:
        """Before the step: set the current gradients aside and start from none."""
        self._saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def end(self) -> None:
        """After the step: keep its gradients aside and put the earlier ones back."""
        self._step = [p.grad for p in self.params]
        for p, grad in zip(self.params, self._saved, strict=True):
            p.grad = grad
        self._saved = []

    def apply(self, scale: float = 1.0) -> None:
        """Add the last step's gradients, times ``scale``, to ``p.grad``."""
        for p, grad in zip(self.params, self._step, strict=False):
            if grad is None:
                continue
            grad = grad * scale if scale != 1.0 else grad
            p.grad = grad if p.grad is None else p.grad + grad
        self._step = []

    def discard(self) -> None:
        self._step = []
