"""A local training step's path, from the strategy's hook to a stage's backward and back, in few modules.

The path is what a newcomer follows with a debugger: the package's modules on the call stack of the
thread that hands a step's messages to the communicator (from Lightning's ``training_step``,
``backward`` and ``optimizer_step`` hooks), and on the stack of the stage thread when it starts
autograd. Counted at run time rather than with ``ast``: the calls between the parts go through objects
the strategy holds, which a static reading cannot resolve.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipe import PipeStrategy

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pipe"
MOST_MODULES = 13  # 12 until the last stage's losses became their own module (`engine.stage_losses`)
#: the communicator's calls that hand a message over (`lightning_pipe.comm.base.Endpoint`)
_HANDING_OVER = {"send", "send_many"}


def _modules_on_stack() -> list[str]:
    return [
        Path(frame.filename).resolve().relative_to(PACKAGE).as_posix()
        for frame in traceback.extract_stack()
        if Path(frame.filename).resolve().is_relative_to(PACKAGE)
    ]


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _PathRecorder:
    """Collects the package's modules on the stacks that carry one training step."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.recording = False
        self.comm = PACKAGE / "comm"

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if self.recording and event == "call" and code.co_name in _HANDING_OVER:
            if Path(code.co_filename).resolve().is_relative_to(self.comm):
                self.modules.update(_modules_on_stack())

    def autograd(self, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.recording and threading.current_thread().name.startswith("lightning_pipe-stage"):
                self.modules.update(_modules_on_stack())
            return original(*args, **kwargs)

        return call

    def hooks(self, strategy: type) -> Iterator[tuple[str, Any]]:
        for name in ("training_step", "backward", "optimizer_step"):
            original = getattr(strategy, name)

            def hook(self_: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.recording = True
                try:
                    return _original(self_, *args, **kwargs)
                finally:
                    self.recording = False

            yield name, hook


def test_a_local_training_step_passes_through_at_most_12_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _PathRecorder()
    monkeypatch.setattr(torch.autograd, "backward", recorder.autograd(torch.autograd.backward))
    monkeypatch.setattr(torch.autograd, "grad", recorder.autograd(torch.autograd.grad))
    for name, hook in recorder.hooks(PipeStrategy):
        monkeypatch.setattr(PipeStrategy, name, hook)
    sys.setprofile(recorder.profile)
    threading.setprofile(recorder.profile)
    try:
        trainer = L.Trainer(
            strategy=PipeStrategy(stages=2, microbatches=2),
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(_Net(), torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    path = sorted(recorder.modules)
    assert any(m.startswith("strategy/") for m in path) and any(m.startswith("comm/") for m in path), path
    assert any(m.startswith("engine/") for m in path), path
    print(f"{len(path)} modules on a local training step's path: {path}")
    assert len(path) <= MOST_MODULES, f"{len(path)} modules on a training step's path: {path}"
