"""Local mode ends cleanly: a process that ran several local-mode fits exits with code 0, every time.

A script running four local-mode fits in one process (interleaved-1f1b, zero-bubble, 1f1b, async on
digits) passed its checks and then died with SIGABRT ("terminate called without an active exception")
in 1 of 4 runs. The microbatch driver threads (`lightning_pipe.strategy.session.DriverThreads`) were
told to end at teardown but not joined: right after ``fit`` returned some were still alive (seen after
a 1f1b fit), daemon threads that the interpreter's shutdown stops wherever they next take the GIL, which
inside torch's C++ aborts the process. Now whoever starts a thread joins it before ``fit`` returns.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from launching import ROOT, base_env
from local_exits import CASES
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipeStrategy
from lightning_pipe.strategy.session import Driver, DriverThreads

RUNS = 16
CRASHES = ("terminate called", "Fatal Python error", "Aborted", "core dumped")


def pipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("lightning_pipe-")]


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.model(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("case", CASES, ids=[case["schedule"] for case in CASES])
def test_no_thread_of_a_local_fit_is_alive_when_fit_returns(case: dict) -> None:
    """Checked at once, without waiting: the conftest fixture gives a thread 10 s to end, the exit gives none."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=PipeStrategy(microbatches=4, timeout=60, **case), max_steps=3,
        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))
    assert pipe_threads() == []


def test_closing_driver_threads_joins_them() -> None:
    threads = DriverThreads()
    drivers = [Driver(lambda: None, index, lambda: torch.no_grad(), 10.0, threads=threads) for index in range(3)]
    for driver in drivers:
        assert driver.start() == ("return", None)
    threads.close()
    assert pipe_threads() == []


@pytest.mark.slow
def test_sixteen_processes_with_local_fits_exit_with_code_0(tmp_path: Path) -> None:
    """`local_exits.py`: 16 forked children, 2 of the 4 fits each, each ending through the interpreter's shutdown."""
    pytest.importorskip("sklearn", reason="the digits data come with scikit-learn (lightning_pipe[test])")
    command = [sys.executable, str(ROOT / "tests" / "local_exits.py"), "--out", str(tmp_path), "--runs", str(RUNS)]
    run = subprocess.run(command, env=base_env(), capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    codes = [line.split()[2] for line in run.stdout.splitlines() if line.startswith("exit ")]
    assert codes == ["0"] * RUNS, output[-4000:]
    assert not [line for line in output.splitlines() if any(crash in line for crash in CRASHES)], output[-4000:]
    assert {(tmp_path / f"threads-{i}").read_text() for i in range(RUNS)} == {""}
