"""`Loss`: the coordinator's criterion (the seed's Loss class), a microbatch's loss and then its gradient.

When the last stage's output of a microbatch reaches the coordinator (or the last stage, where it
shares the coordinator's objects), the forward-loss executor module calls ``compute_loss(output,
target)`` and then ``compute_gradient(loss)``; the gradients that backward leaves on the output go
back through the pipeline. A plain function ``(output, target) -> loss`` is wrapped in a `Loss`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from typing_extensions import override

from lightning_pipe.base.errors import ConfigurationError

Criterion = Callable[[Any, Any], Any]  # (output, target) -> loss


class Loss:
    """A microbatch's loss and its gradient.

    Override ``compute_loss`` (or pass ``criterion``) and, to change how the gradient is taken,
    ``compute_gradient``. A `Pipeline` weights each microbatch's loss by its share of the batch
    before ``compute_gradient`` sees it, so that the gradients of a mean-reduced loss are the whole
    batch's; under mixed precision with a GradScaler, ``compute_gradient`` receives the scaled loss.

    Args:
        criterion: ``(output, target) -> loss``, what the default ``compute_loss`` calls.
    """

    def __init__(self, criterion: Criterion | None = None) -> None:
        self.criterion = criterion

    def compute_loss(self, output: Any, target: Any) -> Any:
        """Called with one microbatch's output of the last stage and its target; returns its loss.

        A scalar tensor is backpropagated; anything else (``None``: nothing to learn from this
        microbatch) is reported as is without a backward.
        """
        if self.criterion is None:
            raise ConfigurationError(
                f"{type(self).__name__} has no criterion: pass Loss(criterion) or override compute_loss(output, target)"
            )
        return self.criterion(output, target)

    def compute_gradient(self, loss: torch.Tensor) -> None:
        """Called with the loss to backpropagate; the gradients with respect to the output flow back to the stages."""
        loss.backward()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.criterion!r})" if self.criterion else f"{type(self).__name__}()"


def as_loss(criterion: Loss | Criterion) -> Loss:
    """``criterion`` as a `Loss`: a Loss as it is, a function ``(output, target) -> loss`` wrapped."""
    if isinstance(criterion, Loss):
        return criterion
    if callable(criterion):
        return Loss(criterion)
    raise ConfigurationError(
        "criterion must be a lightning_pipe.Loss or a function (output, target) -> loss, "
        f"got {type(criterion).__name__}"
    )


class WeightedLoss(Loss):
    """``loss`` on each microbatch, times that microbatch's weight; targets are ``(weight, target)`` pairs.

    ``prepare`` turns the received output into what ``loss`` expects (a traced module's packed
    output back into the module's own structure); ``context`` is entered around ``compute_loss``
    (the backends' op substitution).
    """

    def __init__(
        self,
        loss: Loss,
        prepare: Callable[[Any], Any] | None = None,
        context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        super().__init__()
        self.loss = loss
        self.prepare = prepare
        self.context = context

    @override
    def compute_loss(self, output: Any, target: tuple[float, Any]) -> Any:
        weight, own = target
        with self.context():
            loss = self.loss.compute_loss(self.prepare(output) if self.prepare else output, own)
        if loss is None:
            return None
        # weight 0: nothing to add, not even a gradient (a mean over nothing is NaN, and NaN * 0 too)
        return loss * weight if weight != 0 else torch.zeros_like(loss.detach())

    @override
    def compute_gradient(self, loss: torch.Tensor) -> None:
        self.loss.compute_gradient(loss)

    @override
    def __repr__(self) -> str:
        return f"WeightedLoss({self.loss!r})"


def backpropagates_plainly(criterion: Loss | Criterion) -> bool:
    """Whether ``criterion``'s gradient is ``loss.backward()`` (`Loss.compute_gradient`, through a `WeightedLoss`):
    then one backward may go through the loss and the last stage at once (`engine.stage_actions`)."""
    while isinstance(criterion, WeightedLoss):
        criterion = criterion.loss
    return not isinstance(criterion, Loss) or type(criterion).compute_gradient is Loss.compute_gradient
