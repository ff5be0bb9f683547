"""`SharedWeights`: a weight that several stages of one process hold, under ``schedule="async"``.

With the local transport a tied weight is one parameter held by several stage threads, each updating on its
own time. The lowest stage holding it, its *owner*, steps it once per batch with the sum of every holder's
gradients of that batch; the others hand theirs over per microbatch and never step or clear it. In another
process (rpc) each stage steps its own copy and this is empty. Why nothing is lost or counted twice, and the
staleness it gives: docs/internals.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_pipe.base.errors import PipeTimeoutError
from lightning_pipe.engine.stage_inbox import StepAborted


class SharedWeights:
    """One asynchronous run's weights held by several stages of this process, and their hand-off."""

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._holders: dict[int, set[int]] = {}  # id(parameter) -> stages holding it
        self._handed: dict[tuple[int, int], torch.Tensor] = {}  # (id(parameter), batch) -> sum handed over
        self._counts: dict[tuple[int, int], int] = {}  # (id(parameter), batch) -> hand-overs so far
        self._stepped: dict[int, int] = {}  # id(parameter) -> the owner's updates of it in this run
        self._dropped = False

    def __getstate__(self) -> dict[str, Any]:
        return {"timeout": self.timeout}  # another process holds its own copies: nothing is shared with it

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["timeout"])  # type: ignore[misc]

    def register(self, stage: int, params: Iterable[nn.Parameter]) -> None:
        """``stage`` holds ``params`` in this run (called before any of its actions)."""
        with self._cond:
            for p in params:
                self._holders.setdefault(id(p), set()).add(stage)

    def roles(self, stage: int, params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(owned, handed)``: the parameters of ``stage`` that other stages hold too, which it steps and
        which it hands over. Complete from the stage's first backward on: every holder has registered by
        then (a lower stage ran the microbatch's forward, a higher stage its backward)."""
        owned: list[nn.Parameter] = []
        handed: list[nn.Parameter] = []
        with self._cond:
            for p in params:
                holders = self._holders.get(id(p), set())
                if len(holders) > 1:
                    (owned if min(holders) == stage else handed).append(p)
        return owned, handed

    def hand_over(self, p: nn.Parameter, batch: int, grad: torch.Tensor | None) -> None:
        """A non-owner's gradient of ``p`` for one microbatch of ``batch`` (None: it added nothing)."""
        key = (id(p), batch)
        with self._cond:
            if grad is not None:
                held = self._handed.get(key)
                self._handed[key] = grad if held is None else held + grad
            self._counts[key] = self._counts.get(key, 0) + 1
            self._cond.notify_all()

    def collect(self, p: nn.Parameter, batch: int, per_batch: int, stage: int) -> torch.Tensor | None:
        """The owner, at its update of ``batch``: the sum of the other holders' gradients of that batch."""
        key = (id(p), batch)
        with self._cond:
            expected = (len(self._holders[id(p)]) - 1) * per_batch
            self._wait(lambda: self._counts.get(key, 0) >= expected, f"stage {stage} waited {{}} for batch {batch}'s "
                       "gradients of a weight it shares with a later stage")  # fmt: skip
            self._counts.pop(key, None)
            return self._handed.pop(key, None)

    def stepped(self, p: nn.Parameter) -> None:
        """The owner updated ``p`` (once per batch)."""
        with self._cond:
            self._stepped[id(p)] = self._stepped.get(id(p), 0) + 1
            self._cond.notify_all()

    def wait_stepped(self, p: nn.Parameter, updates: int, stage: int) -> None:
        """Return once the owner of ``p`` has updated it ``updates`` times in this run."""
        with self._cond:
            self._wait(lambda: self._stepped.get(id(p), 0) >= updates, f"stage {stage} waited {{}} for update "
                       f"{updates} of a weight it shares with stage {min(self._holders[id(p)])}")  # fmt: skip

    def drop(self) -> None:
        """The run was aborted: wake every stage waiting here (it stops the step)."""
        with self._cond:
            self._dropped = True
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        if not self._cond.wait_for(lambda: self._dropped or ready(), timeout=self.timeout):
            raise PipeTimeoutError(
                what.format(f"{self.timeout:.1f} s") + "; raise PipeStrategy(timeout=...) if a stage legitimately "
                "takes that long"
            )
        if self._dropped:
            raise StepAborted
