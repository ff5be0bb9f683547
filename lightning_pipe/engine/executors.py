"""Executor modules: what a shard runs for a forward, a forward with loss, and a backward.

The argument and return order is the specification's (``seeds/executor-modules.md``); users may
replace any of them by handing their own classes to the `Partitioner`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pipe.base import tree
from lightning_pipe.engine.loss import Criterion, Loss, as_loss
from lightning_pipe.rng.generators import RandomState, replaying

Scaler = Any  # torch.amp.GradScaler or None


def call_module(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a batch: a tuple is passed as positional arguments, anything else as one."""
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        return model(*batch)
    return model(batch)


@dataclass
class Activation:
    """What a stage keeps between a microbatch's forward and its backward.

    ``inputs`` is the stage's input. Without activation checkpointing ``outputs`` holds the forward's
    result with its autograd graph; with checkpointing it is ``None`` and the backward recomputes the
    forward from ``inputs``. ``rng_state`` is the stage's generator state before the forward (a
    `RandomState`; None when the stage draws nothing), so the recomputation draws the same numbers.
    """

    inputs: Any
    outputs: Any = None
    rng_state: RandomState | torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpointed(self) -> bool:
        return self.outputs is None


class ForwardModule:
    """Runs a shard's forward: ``run(model, batch, device) -> output``."""

    type = "forward"

    def __init__(self, index: int) -> None:
        self.index = index

    def run(self, model: nn.Module, batch: Any, device: torch.device) -> Any:
        return call_module(model, batch)


class ForwardLossModule:
    """Forward, loss and backward at the end of the pipeline.

    ``run(model, optimizer, batch, labels, criterion, device, scaler=None)`` returns
    ``(scaler, grads, loss)``: ``grads`` are the gradients with respect to ``batch`` (one per leaf,
    None where none flows) that go back to the previous shard, and ``loss`` is detached. The
    criterion is a `Loss` (a plain function ``(output, labels) -> loss`` is wrapped in one): its
    ``compute_loss`` gives the loss, its ``compute_gradient`` backpropagates it, scaled by ``scaler``.
    """

    type = "forward_loss"

    def __init__(self, index: int) -> None:
        self.index = index

    def run(
        self,
        model: nn.Module,
        optimizer: Any,
        batch: Any,
        labels: Any,
        criterion: Loss | Criterion,
        device: torch.device,
        scaler: Scaler = None,
    ) -> tuple[Scaler, list[torch.Tensor | None] | None, torch.Tensor]:
        loss = self.loss(model, batch, labels, criterion)
        grads = tree.grads_of(batch) if self.backpropagate(loss, criterion, scaler) else None
        return scaler, grads, detached(loss)

    def loss(self, model: nn.Module, batch: Any, labels: Any, criterion: Loss | Criterion) -> Any:
        """``run``'s first half: the loss of ``model``'s output on ``batch`` (still in autograd's graph)."""
        return as_loss(criterion).compute_loss(call_module(model, batch), labels)

    def backpropagate(self, loss: Any, criterion: Loss | Criterion, scaler: Scaler = None) -> bool:
        """``run``'s second half: ``compute_gradient`` of ``loss``, scaled by ``scaler``; whether it ran (a loss that
        is a tensor in autograd's graph)."""
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            return False
        as_loss(criterion).compute_gradient(scaler.scale(loss) if scaler is not None else loss)
        return True


def detached(loss: Any) -> Any:
    """A loss to report: a tensor detached, anything else as it is."""
    return loss.detach() if isinstance(loss, torch.Tensor) else loss


def output_grads(
    loss_module: Any,
    model: nn.Module,
    optimizer: Any,
    output: Any,
    labels: Any,
    criterion: Loss,
    device: torch.device,
    scaler: Scaler = None,
) -> tuple[Scaler, list[torch.Tensor | None], Any]:
    """``loss_module.run(...)`` with the gradients ready to send back: one detached tensor or None per leaf."""
    scaler, grads, loss = loss_module.run(model, optimizer, output, labels, criterion, device, scaler)
    if not grads:
        return scaler, [None] * len(tree.flatten(output)[0]), loss
    return scaler, [g.detach() if isinstance(g, torch.Tensor) else None for g in grads], loss


class BackwardModule:
    """Backward of a shard: ``run(model, optimizer, batch, device, grads, scaler=None)``.

    ``batch`` is the shard's saved `Activation` (its checkpointed input); the forward is recomputed
    when the activation holds no outputs. Parameter gradients accumulate into ``p.grad``. Returns
    ``(scaler, grads)`` with ``grads`` the gradients with respect to the shard's input leaves.
    """

    type = "backward"

    def __init__(self, index: int) -> None:
        self.index = index

    def run(
        self,
        model: nn.Module,
        optimizer: Any,
        batch: Activation,
        device: torch.device,
        grads: list[torch.Tensor | None],
        scaler: Scaler = None,
    ) -> tuple[Scaler, list[torch.Tensor | None] | None]:
        outputs = batch.outputs
        if outputs is None:
            outputs = recompute(model, batch)
        pairs = [
            (out, grad)
            for out, grad in zip(tree.flatten(outputs)[0], grads, strict=True)
            if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
        ]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        return scaler, tree.grads_of(batch.inputs)


def recompute(model: nn.Module, activation: Activation) -> Any:
    """Run the forward again from a checkpointed input, drawing the random numbers the original forward drew."""
    with replaying(activation.rng_state), torch.enable_grad(), frozen_running_stats(model):
        return call_module(model, activation.inputs)


@contextlib.contextmanager
def frozen_running_stats(model: nn.Module) -> Iterator[None]:
    """Normalisation layers use the batch's statistics but leave their running statistics alone.

    The original forward already updated them; a recomputed forward would count the batch twice.
    """
    norms = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
    ]
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True
