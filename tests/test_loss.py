"""`Loss`: the coordinator's criterion contract (compute_loss, then compute_gradient), on every path a loss takes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import dataset, mlp
from torch import nn

from lightning_pipe import ConfigurationError, ForwardLossModule, Loss, Pipeline
from lightning_pipe.engine.loss import as_loss


class SmoothedCrossEntropy(Loss):
    """A user's Loss: label smoothing in compute_loss; compute_gradient records what it backpropagates."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor
        self.backpropagated: list[float] = []

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, label_smoothing=0.1)

    def compute_gradient(self, loss: torch.Tensor) -> None:
        self.backpropagated.append(float(loss.detach()))
        (loss * self.factor).backward()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = dataset(rows=10).tensors  # 10 rows in 4 microbatches: 3, 3, 2, 2, each weighted by its rows
    return x, y


def unsplit(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    reference = copy.deepcopy(net)
    loss = F.cross_entropy(reference(x), y, label_smoothing=0.1)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in reference.named_parameters()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("on_stage", [True, False], ids=["loss-on-last-stage", "loss-on-coordinator"])
def test_a_custom_loss_gives_the_unsplit_gradients(schedule: str, on_stage: bool) -> None:
    net = mlp()
    x, y = data()
    want_loss, want = unsplit(net, x, y)
    loss = SmoothedCrossEntropy()
    pipe = Pipeline(net, stages=2, schedule=schedule, timeout=30)
    pipe.communicator.shares_objects = on_stage
    with pipe:
        result = pipe.train_step(x, y, loss, microbatches=4)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, want[name], atol=1e-6, rtol=0, msg=name)
    # compute_gradient ran once per microbatch on the weighted loss, which is also what the step reports
    assert len(loss.backpropagated) == 4
    torch.testing.assert_close(torch.tensor(loss.backpropagated), torch.stack(result.losses), atol=1e-7, rtol=0)
    torch.testing.assert_close(sum(result.losses), want_loss, atol=1e-6, rtol=0)


def test_compute_gradient_is_what_backpropagates() -> None:
    net = mlp()
    x, y = data()
    _, want = unsplit(net, x, y)
    with Pipeline(net, stages=2, timeout=30) as pipe:
        pipe.train_step(x, y, SmoothedCrossEntropy(factor=3.0), microbatches=4)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, 3.0 * want[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("on_stage", [True, False], ids=["loss-on-last-stage", "loss-on-coordinator"])
def test_a_grad_scaler_scales_the_loss_compute_gradient_gets(on_stage: bool) -> None:
    net = mlp()
    x, y = data()
    _, want = unsplit(net, x, y)
    loss = SmoothedCrossEntropy()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    pipe = Pipeline(net, stages=2, timeout=30)
    pipe.communicator.shares_objects = on_stage
    with pipe:
        result = pipe.train_step(x, y, loss, microbatches=4, scaler=scaler)
    scaled = 1024.0 * torch.stack(result.losses)
    torch.testing.assert_close(torch.tensor(loss.backpropagated), scaled, rtol=1e-6, atol=0)
    for name, p in net.named_parameters():  # scaled gradients, as GradScaler.unscale_ expects them
        torch.testing.assert_close(p.grad / 1024.0, want[name], atol=1e-6, rtol=0, msg=name)


def test_a_function_is_wrapped_and_anything_else_is_refused() -> None:
    wrapped = as_loss(F.mse_loss)
    assert isinstance(wrapped, Loss) and wrapped.criterion is F.mse_loss
    own = SmoothedCrossEntropy()
    assert as_loss(own) is own
    with pytest.raises(ConfigurationError, match="criterion must be a lightning_pipe.Loss or a function"):
        as_loss(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"Loss has no criterion: pass Loss\(criterion\) or override"):
        Loss().compute_loss(torch.zeros(1), torch.zeros(1))


def test_the_forward_loss_module_keeps_the_seeds_argument_order() -> None:
    """run(model, optimizer, batch, labels, criterion, device, scaler) -> (scaler, grads, loss), Loss or function."""
    head = nn.Identity()
    for criterion in (SmoothedCrossEntropy(), lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1)):
        batch = torch.randn(4, 3, requires_grad=True)
        target = torch.tensor([0, 1, 2, 0])
        scaler, grads, loss = ForwardLossModule(1).run(head, None, batch, target, criterion, torch.device("cpu"), None)
        reference = batch.detach().clone().requires_grad_(True)
        want = F.cross_entropy(reference, target, label_smoothing=0.1)
        want.backward()
        assert scaler is None and not loss.requires_grad
        torch.testing.assert_close(loss, want.detach())
        assert grads is not None
        torch.testing.assert_close(grads[0], reference.grad)
