"""PipeStrategy(transport="rpc") with stages in separate `lightning-pipe worker` processes, as on other machines."""

from __future__ import annotations

import copy
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, dataset, loader, mlp
from lightning.pytorch.plugins.precision import MixedPrecision
from processes import leftover_processes
from rpc_models import OverflowsAtStep, worker_env
from torch import nn

from lightning_pipe import PipeStrategy

TOKEN = "this-run"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(port: int, token: str, devices: str = "cpu") -> subprocess.Popen[str]:
    """`lightning-pipe worker` (the console script if installed, else ``python -m lightning_pipe``)."""
    script = shutil.which("lightning-pipe")
    command = [script] if script else [sys.executable, "-m", "lightning_pipe"]
    command += ["worker", "--coordinator", f"127.0.0.1:{port}", "--token", token, "--devices", devices, "--wait", "120"]
    return subprocess.Popen(command, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Scheduled(Classifier):
    """SGD with momentum and a StepLR: the stages must follow the scheduler's learning rate."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(module: L.LightningModule, strategy: Any, path: Path, steps: int = 3, ckpt: Path | None = None) -> L.Trainer:
    args: dict[str, Any] = dict(
        QUIET, max_steps=steps, gradient_clip_val=0.05, limit_val_batches=1, accumulate_grad_batches=2
    )
    if strategy is not None:
        args["strategy"] = strategy
    trainer = L.Trainer(**args)
    trainer.fit(module, loader(dataset(rows=48), 12), loader(dataset(rows=24, seed=3), 12), ckpt_path=ckpt)
    trainer.save_checkpoint(path)
    return trainer


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[int, subprocess.Popen[str], subprocess.Popen[str]]]:
    """One worker process offering two slots, and a stray one from another run (wrong token).

    The run has 3 stages: the workers serve stages 0 and 1, the coordinator's process holds the last one.
    """
    port = free_port()
    good, stray = worker(port, TOKEN, devices="cpu,cpu"), worker(port, "another-run")
    try:
        yield port, good, stray
    finally:
        for process in (good, stray):
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=30)


def test_trains_on_worker_processes_and_checkpoints_for_a_plain_trainer(
    workers: tuple[int, subprocess.Popen[str], subprocess.Popen[str]], tmp_path: Path
) -> None:
    port, good, stray = workers
    piped, plain = Scheduled(mlp()), Scheduled(mlp())
    strategy = PipeStrategy(
        stages=3, microbatches=4, transport="rpc", coordinator=f"127.0.0.1:{port}", token=TOKEN, timeout=120
    )
    trainer = fit(piped, strategy, tmp_path / "piped.ckpt")
    fit(plain, None, tmp_path / "plain.ckpt")

    # the stray was refused, the run went on; the workers left when it ended
    _, err = stray.communicate(timeout=60)
    assert stray.returncode == 2 and "refused this worker" in err and "wrong token" in err
    out, err = good.communicate(timeout=60)
    assert good.returncode == 0, err
    assert leftover_processes() == []

    # after fit the LightningModule holds what the stages trained, as with any strategy
    for (name, p), q in zip(piped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)

    # the checkpoint is the unsplit model's, optimizer state included, and resumes in a plain Trainer
    got, want = (
        torch.load(tmp_path / "piped.ckpt", weights_only=False),
        torch.load(tmp_path / "plain.ckpt", weights_only=False),
    )
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, atol=1e-5, rtol=0)
    for index, state in want["optimizer_states"][0]["state"].items():
        torch.testing.assert_close(
            got["optimizer_states"][0]["state"][index]["momentum_buffer"], state["momentum_buffer"], atol=1e-5, rtol=0
        )
    resumed, continued = Scheduled(mlp(seed=9)), Scheduled(mlp(seed=9))
    fit(resumed, None, tmp_path / "r.ckpt", steps=5, ckpt=tmp_path / "piped.ckpt")
    fit(continued, None, tmp_path / "c.ckpt", steps=5, ckpt=tmp_path / "plain.ckpt")
    for p, q in zip(resumed.parameters(), continued.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0)


def test_grad_scaler_skips_the_step_that_overflowed_on_one_stage() -> None:
    """16-mixed with a GradScaler: the overflow of step 2 happens on stage 0 only; the scaler skips it there too."""

    def module(calls_per_step: int) -> Classifier:
        torch.manual_seed(0)
        layers = [nn.Linear(8, 16), nn.Tanh(), OverflowsAtStep(1, calls_per_step), nn.Linear(16, 16), nn.Tanh()]
        return Classifier(nn.Sequential(*layers, nn.Linear(16, 3)))

    def trainer(**kwargs: Any) -> L.Trainer:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        return L.Trainer(**QUIET, max_steps=3, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], **kwargs)

    piped, plain = module(calls_per_step=4), module(calls_per_step=1)
    before = copy.deepcopy(plain.state_dict())
    strategy = PipeStrategy(stages=2, microbatches=4, partition=[3, 3], transport="rpc", timeout=120)
    piped_trainer, plain_trainer = trainer(strategy=strategy), trainer()
    piped_trainer.fit(piped, loader(dataset(rows=48), 12))
    plain_trainer.fit(plain, loader(dataset(rows=48), 12))
    assert (
        piped_trainer.precision_plugin.scaler.get_scale() == plain_trainer.precision_plugin.scaler.get_scale() == 512.0
    )
    for (name, p), q in zip(piped.named_parameters(), plain.parameters(), strict=True):
        assert not torch.equal(p, before[name]), f"{name} never moved"
        torch.testing.assert_close(p, q, atol=2e-3, rtol=0, msg=name)
    assert leftover_processes() == []
