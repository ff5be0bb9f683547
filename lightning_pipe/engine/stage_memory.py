"""`StageMemory`: a stage worker's memory accounting: its stash meter and which of its stages recompute.

For ``checkpoint="auto"`` the coordinator decides (`lightning_pipe.pipeline.recompute`); the worker measures where
the device is: what a microbatch of each stage keeps alive with and without recomputation, and the free
memory of its device.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_pipe.engine.executors import Activation, recompute
from lightning_pipe.engine.messages import StageSpec
from lightning_pipe.engine.stash import StageBytes, StashMeter, signature
from lightning_pipe.engine.versions import WorkerVersions
from lightning_pipe.runtime import BaseRuntime, DeviceMemory


class StageMemory:
    """The stash meter of a worker's stages, their recomputation flags and the control calls about memory.

    ``recompute[s]``: stage ``s`` recomputes its forward in the backward (``checkpoint=``). Explicit modes
    are as given; ``"auto"`` stages start as ``"except_last"`` where memory is limited, else never, until
    the coordinator decides (``set_recompute``).
    """

    def __init__(
        self, spec: StageSpec, shards: dict[int, Any], runtimes: dict[int, BaseRuntime], versions: WorkerVersions
    ) -> None:
        self.shards = shards
        self.runtimes = runtimes
        self.versions = versions  # an asynchronous run's stashed weights are weights, not activations
        self.stash = StashMeter()
        last = spec.num_stages - 1
        self._measuring = {s for s in shards if spec.checkpoint[s] is None}  # "auto", until decided
        self.recompute = {
            s: (s != last and runtimes[s].device_memory() is not None) if s in self._measuring else bool(flag)
            for s, flag in ((s, spec.checkpoint[s]) for s in shards)
        }

    def size(self, s: int, activation: Activation, checkpointed: bool) -> int:
        """The bytes ``activation`` of stage ``s`` keeps alive (measured once per input signature)."""
        key = signature(s, checkpointed, activation.inputs)
        if self.stash.known(key):  # every forward: the parameters are listed only to measure a new signature
            return self.stash.measure(key, activation, ())
        params = list(self.shards[s].module.parameters())
        if self.versions.active:
            params += self.versions.weights(s)
        return self.stash.measure(key, activation, params)

    def measure_auto(self, s: int, model: torch.nn.Module, saved: Activation) -> None:
        """``"auto"``: a microbatch's bytes with and without recomputation, once per input signature.

        Called before the backward. A recomputed activation is recomputed here on ``model`` (and kept for
        the backward, which then does not recompute it again) to measure the graph it rebuilds.
        """
        if s not in self._measuring or self.versions.active:
            return
        if self.stash.known(signature(s, False, saved.inputs)) and self.stash.known(signature(s, True, saved.inputs)):
            return
        if saved.outputs is None:
            saved.outputs = recompute(model, saved)
        self.size(s, saved, False)
        self.size(s, Activation(saved.inputs), True)

    def call_stash_sizes(self) -> dict[int, StageBytes]:
        """Per stage of this rank measured so far: what its largest microbatch keeps alive."""
        sizes = {s: self.stash.stage_bytes(s) for s in self.shards}
        return {s: size for s, size in sizes.items() if size is not None}

    def call_stash_held(self) -> dict[int, tuple[int, int]]:
        """Per stage of this rank measured so far: the bytes its largest microbatch stashes as the stage runs now
        (its inputs only where it recomputes) and the more it keeps from ``I`` until ``W`` (``schedule="auto"``)."""
        held = {}
        for s in self.shards:
            nbytes = self.stash.largest(s, "inputs" if self.recompute[s] else "full")
            if nbytes is not None:
                held[s] = (nbytes, self.stash.largest(s, "split") or 0)
        return held

    def call_stash_peak(self) -> int:
        """Most bytes of stashed tensors this rank held at once during the last training step."""
        return self.stash.peak

    def call_device_memory(self) -> dict[int, DeviceMemory | None]:
        """Per stage of this rank: its device's memory, read here (in the worker process that owns the device)."""
        return {s: self.runtimes[s].device_memory() for s in self.shards}

    def call_set_recompute(self, flags: dict[int, bool]) -> None:
        """From the next step on, these of this rank's stages recompute their forward in the backward (decided)."""
        for s, flag in flags.items():
            if s in self.recompute:
                self.recompute[s] = bool(flag)
                self._measuring.discard(s)
