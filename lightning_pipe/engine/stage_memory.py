"""A stage worker's side of ``checkpoint="auto"``: which of its stages recompute, and the numbers to decide on.

The coordinator decides (`lightning_pipe.checkpointing`); the worker measures where the device is: what a
microbatch of each stage keeps alive with and without recomputation, and the free memory of its device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_pipe.engine.plan import StageSpec
from lightning_pipe.engine.stash import StageBytes, StashMeter, signature
from lightning_pipe.executors import Activation, recompute
from lightning_pipe.runtime import BaseRuntime, DeviceMemory


class StageMemoryCalls:
    """Mixed into `StageWorker`: the recomputation flags of its stages and ``call_<name>`` methods about memory."""

    spec: StageSpec
    shards: dict[int, Any]
    runtimes: dict[int, BaseRuntime]
    stash: StashMeter
    _asynchronous: bool

    if TYPE_CHECKING:

        def _model(self, s: int, m: int) -> torch.nn.Module: ...

        def _stash_size(self, s: int, activation: Activation, checkpointed: bool) -> int: ...

    def _init_recompute(self) -> None:
        """Explicit modes as given; ``"auto"`` stages start as ``"except_last"`` where memory is limited, else never."""
        last = self.spec.num_stages - 1
        self._measuring = {s for s in self.shards if self.spec.checkpoint[s] is None}  # "auto", until decided
        self.recompute = {
            s: (s != last and self.runtimes[s].device_memory() is not None) if s in self._measuring else bool(flag)
            for s, flag in ((s, self.spec.checkpoint[s]) for s in self.shards)
        }

    def _measure_auto(self, s: int, m: int, saved: Activation) -> None:
        """``"auto"``: a microbatch's bytes with and without recomputation, once per input signature.

        Called before the backward. A recomputed activation is recomputed here (and kept for the backward,
        which then does not recompute it again) to measure the graph it rebuilds.
        """
        if s not in self._measuring or self._asynchronous:
            return
        if self.stash.known(signature(s, False, saved.inputs)) and self.stash.known(signature(s, True, saved.inputs)):
            return
        if saved.outputs is None:
            saved.outputs = recompute(self._model(s, m), saved)
        self._stash_size(s, saved, False)
        self._stash_size(s, Activation(saved.inputs), True)

    def call_stash_sizes(self) -> dict[int, StageBytes]:
        """Per stage of this rank measured so far: what its largest microbatch keeps alive."""
        sizes = {s: self.stash.stage_bytes(s) for s in self.shards}
        return {s: size for s, size in sizes.items() if size is not None}

    def call_device_memory(self) -> dict[int, DeviceMemory | None]:
        """Per stage of this rank: its device's memory, read here (in the worker process that owns the device)."""
        return {s: self.runtimes[s].device_memory() for s in self.shards}

    def call_set_recompute(self, flags: dict[int, bool]) -> None:
        """From the next step on, these of this rank's stages recompute their forward in the backward (decided)."""
        for s, flag in flags.items():
            if s in self.recompute:
                self.recompute[s] = bool(flag)
                self._measuring.discard(s)
