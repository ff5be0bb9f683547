"""transport="rpc" as a new user meets it: a script without a main guard trains, and stderr shows only what matters.

Each test runs a training script as ``python script.py`` in a subprocess (bounded by a timeout; its
worker processes are reaped), exactly as a user would start it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from processes import session_members
from rpc_models import worker_env

TENSORPIPE = re.compile(r"tensorpipe|pipe closed|\beof\b|RPC agent", re.IGNORECASE)

# no `if __name__ == "__main__":` guard; the model, a layer holding a lambda, an optimizer subclass and the loss
# function are defined in the script itself, so the workers can only get them by value
UNGUARDED_FIT = """
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy


class Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class HalfStepSGD(torch.optim.SGD):
    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] = group["lr"] / 2
        out = super().step(closure)
        for group in self.param_groups:
            group["lr"] = group["lr"] * 2
        return out


def script_loss(logits, y):
    return F.cross_entropy(logits, y)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(16), Apply(lambda x: x * 0.5), Block(16), nn.Linear(16, 3))


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return script_loss(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", script_loss(self.model(x), y))

    def configure_optimizers(self):
        return HalfStepSGD(self.parameters(), lr=0.2)


g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
net = Net()
trainer = L.Trainer(
    accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, strategy=PipeStrategy(stages=2, microbatches=2, transport="rpc", timeout=60),
)
trainer.fit(net, DataLoader(data, batch_size=16))

reference = make_model()  # the same updates without the pipeline
optimizer = HalfStepSGD(reference.parameters(), lr=0.2)
for x, y in DataLoader(data, batch_size=16):
    optimizer.zero_grad()
    script_loss(reference(x), y).backward()
    optimizer.step()
for (name, got), want in zip(net.model.state_dict().items(), reference.state_dict().values()):
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)
print(f"trained {trainer.global_step} steps, equal to the unsplit model")
# a second RPC world in the same process (a coordinator that ended one world before) ends as quietly
metrics = trainer.validate(net, DataLoader(data, batch_size=16), verbose=False)
print(f"validated: val_loss {metrics[0]['val_loss']:.4f}")
"""

UNGUARDED_STAGE_ERROR = """
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe import Pipeline


class FailsOnMarker(nn.Module):
    def forward(self, x):
        if (x[:, 0] == 123.0).any():
            raise ValueError("bad row reached the stage")
        return x


x, y = torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)
x[5, 0] = 123.0
model = nn.Sequential(nn.Identity(), FailsOnMarker(), nn.Linear(4, 2))
with Pipeline(model, stages=2, partition=[1, 2], transport="rpc", timeout=60) as pipe:
    pipe.train_step(x, y, F.cross_entropy, microbatches=4)
"""


def run_script(tmp_path: Path, source: str, timeout: float = 420.0) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as ``python train.py``; fail if it outlives ``timeout`` or leaves a process behind."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the script and its workers form one session: found and killed together
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(process.pid)
        out, err = process.communicate()
        raise AssertionError(f"the script ran past {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
    until = time.monotonic() + 15
    while session_members(process.pid) and time.monotonic() < until:
        time.sleep(0.1)
    left = session_members(process.pid)
    _kill_session(process.pid)
    assert left == [], f"the script left processes behind: {left}"
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _kill_session(sid: int) -> None:
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_script_without_main_guard_trains_like_the_unsplit_model_and_stderr_stays_clean(tmp_path: Path) -> None:
    result = run_script(tmp_path, UNGUARDED_FIT)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "trained 4 steps, equal to the unsplit model" in result.stdout
    assert "validated: val_loss" in result.stdout
    assert "bootstrapping" not in result.stderr
    noise = [line for line in result.stderr.splitlines() if TENSORPIPE.search(line)]
    assert noise == [], "TensorPipe warnings on a clean shutdown:\n" + "\n".join(noise)


def test_stage_error_is_shown_once_without_tensorpipe_noise(tmp_path: Path) -> None:
    result = run_script(tmp_path, UNGUARDED_STAGE_ERROR)
    assert result.returncode == 1, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("lightning_pipe.base.errors.StageError")]
    assert len(errors) == 1, result.stderr
    assert "failed in action 1F2 (microbatch 2): ValueError: bad row reached the stage" in errors[0]
    assert "--- traceback in stage 1 on" in result.stderr  # the stage's own traceback, once
    assert result.stderr.count("--- traceback in stage") == 1
    noise = [line for line in result.stderr.splitlines() if TENSORPIPE.search(line)]
    assert noise == [], "TensorPipe warnings after a stage error:\n" + "\n".join(noise)
