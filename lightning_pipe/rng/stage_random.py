"""`StageRandom`: a stage's generators and when its forwards route their draws to them.

A shard that can draw (`detect.randomness` says ``"yes"``) runs every training forward under
`RandomRouting`. One whose modules say ``"no"`` never does: it pays nothing. One that runs code written
elsewhere (``"unknown"``) is probed: its first training forward runs under the mode, which notes whether
anything drew; if nothing did, its later training forwards run bare. Evaluation forwards of a shard that
can draw are probed the same way (dropout layers draw nothing in evaluation), so they can run compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lightning_pipe.rng.detect import Verdict, randomness
from lightning_pipe.rng.generators import RandomState, StageGenerators
from lightning_pipe.rng.routing import RandomRouting


class StageRandom:
    """Random draws of one stage: its own generators, and whether its forwards need routing."""

    def __init__(self, seed: int, stage: int, device: torch.device | str, module: nn.Module) -> None:
        self.generators = StageGenerators(seed, stage, device)
        self.module = module
        self.refresh()

    def refresh(self) -> None:
        """Read the module (again: a traced shard got the code of another call variant)."""
        self._code = getattr(self.module, "code_version", 0)
        verdict = randomness(self.module)
        #: per mode (training or not): "yes" routes, "no" runs bare, "unknown" routes its next forward as a probe
        self.verdicts: dict[bool, Verdict] = {True: verdict, False: "no" if verdict == "no" else "unknown"}

    def routes(self, training: bool) -> bool:
        """Whether a forward in this mode runs under `RandomRouting`."""
        if getattr(self.module, "code_version", 0) != self._code:
            self.refresh()
        return self.verdicts[training] != "no"

    @contextlib.contextmanager
    def drawing(self, training: bool) -> Iterator[None]:
        """Around a forward of the stage: its draws come from the stage's generators."""
        if not self.routes(training):
            yield
            return
        mode = RandomRouting(self.generators)
        with mode:
            yield
        if self.verdicts[training] == "unknown":  # this forward was a probe
            self.verdicts[training] = "yes" if mode.drew else "no"

    def snapshot(self, training: bool = True) -> RandomState | None:
        """The generators' state before a forward that will be recomputed; None when it draws nothing."""
        return self.generators.snapshot() if self.routes(training) else None
