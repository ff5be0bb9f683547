"""transport="rpc" on CUDA: stages on GPUs, activations between GPUs of their own over NCCL (skipped without).

The last stage runs in the coordinator's process (`rpc.home`), stage 0 in a worker process. Two stages
on one GPU cannot share an NCCL group (one GPU per process): their tensors cross over gloo through host
memory, and the log says so. On two GPUs the stages' activations and gradients go GPU to GPU (the
coordinator's process joins the NCCL group with the last stage's device); the transport's counters
(`TransportStats.host_bytes`) show none crossing through host memory, and the last stage's output never
leaves the coordinator's process.
"""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import QUIET, Classifier, checked_mlp, loader, max_param_diff, mlp, twins
from processes import leftover_processes

from lightning_pipe import Pipeline, PipeStrategy
from lightning_pipe.comm import MessageKind
from lightning_pipe.comm.rpc import RpcCommunicator

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_rpc_stages_on_one_gpu_train_like_a_plain_trainer(caplog: pytest.LogCaptureFixture) -> None:
    """Each stage checks that its input is on the GPU (`RunsOn`): a silent CPU fallback fails the step."""
    model, partition = checked_mlp("cuda")
    piped, plain = twins(Classifier(model))
    strategy = PipeStrategy(
        stages=2, microbatches=2, transport="rpc", devices=["cuda:0", "cuda:0"], partition=partition, timeout=120
    )
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        L.Trainer(**(QUIET | {"accelerator": "gpu", "devices": 1}), max_steps=3, strategy=strategy).fit(piped, loader())
    L.Trainer(**(QUIET | {"accelerator": "gpu", "devices": 1}), max_steps=3).fit(plain, loader())
    assert max_param_diff(piped.cpu(), plain.cpu()) < 1e-5
    assert "ranks 0, 1 share cuda:0" in caplog.text and "through host memory" in caplog.text
    assert leftover_processes() == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: NCCL between the stages")
def test_rpc_stages_on_two_gpus_send_gpu_to_gpu(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp(width=64)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    communicator = RpcCommunicator()
    devices = ["cuda:0", "cuda:1"]
    with caplog.at_level(logging.INFO, logger="lightning_pipe"):
        with Pipeline(model, stages=2, devices=devices, transport=communicator, timeout=120) as pipe:
            pipe.train_step(x, y, F.cross_entropy, microbatches=4)
            pipe.coordinator.settle()
            stats = communicator.stats()
            grads = pipe.grads()
    assert "between ranks 0, 1 (CUDA devices of their own) over NCCL" in caplog.text
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].cpu(), p.grad, rtol=0, atol=1e-5, msg=name)
    assert stats[0].tensor_bytes[MessageKind.ACTIVATION] > 0 and stats[1].tensor_bytes[MessageKind.GRAD] > 0
    assert stats[0].host_bytes[MessageKind.ACTIVATION] == 0  # stage 0 -> stage 1: cuda:0 to cuda:1
    assert stats[1].host_bytes[MessageKind.GRAD] == 0  # stage 1 -> stage 0
    # the last stage computed the losses in the coordinator's process: its output crossed nothing
    assert MessageKind.OUTPUT not in stats[1].messages and sum(stats[1].host_bytes.values()) == 0
    assert leftover_processes() == []
