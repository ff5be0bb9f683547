"""The stash: what a stage keeps between a microbatch's forward and its backward, measured in bytes.

A stage holds, per microbatch, its input, its output and every tensor autograd saved for the
backward (or only the input under activation checkpointing). `stash_bytes` counts them once each,
parameters excluded; `StashMeter` follows a worker's live total and its peak during a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.base import tree
from lightning_pipe.base.dtensor_shards import local_of
from lightning_pipe.engine.executors import Activation

Key = tuple[int, int]  # (stage, microbatch)


def saved_tensors(outputs: Any) -> list[torch.Tensor]:
    """Tensors held by the autograd graph behind ``outputs`` (read from each node's ``_saved_*`` slots)."""
    roots = [t.grad_fn for t in tree.tensors(outputs) if t.grad_fn is not None]
    seen, queue, found = set(roots), deque(roots), []
    while queue:
        node = queue.popleft()
        for name in dir(node):
            if name.startswith("_saved_"):
                found.extend(_tensors_in(getattr(node, name, None)))
        if hasattr(node, "saved_tensors"):  # custom autograd.Function
            try:
                found.extend(_tensors_in(node.saved_tensors))
            except RuntimeError:  # already freed
                pass
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return found


def stash_bytes(activation: Activation, params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes an `Activation` keeps alive: inputs, outputs and saved tensors, each once, no parameters."""
    exclude = {ptr for p in params if (ptr := _storage(p)) is not None}
    tensors = tree.tensors(activation.inputs)
    if activation.outputs is not None:
        tensors += tree.tensors(activation.outputs) + saved_tensors(activation.outputs)
    return unique_bytes(tensors, exclude)


def unique_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Sum of ``numel * element_size`` over distinct tensors (same data pointer and size count once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        ptr = _storage(t)
        if t.device.type == "meta" or ptr is None or ptr in exclude:
            continue
        size = t.numel() * t.element_size()
        key = (t.data_ptr(), size)
        if key not in seen:
            seen.add(key)
            total += size
    return total


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s memory starts; None where it holds none of its own here: freed (FSDP gathers a block's
    parameters for its forward and frees them after) or a shard's wrapper (a DTensor: its local tensor counts)."""
    local = local_of(tensor)
    try:
        storage = local.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):
        return None


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


@dataclass(frozen=True)
class StageBytes:
    """What one microbatch of a stage keeps alive until its backward (the largest measured)."""

    full: int  # without recomputation: inputs, outputs and the tensors autograd saved
    inputs: int  # with recomputation: the inputs only
    split: int = 0  # more, from the input gradient (I) until the weight gradient (W)


class StashMeter:
    """Live stash bytes of one worker, per (stage, microbatch), and the peak of the current step."""

    def __init__(self) -> None:
        self.live: dict[Key, int] = {}
        self.current = 0
        self.peak = 0
        self._sizes: dict[tuple[Any, ...], int] = {}
        self._largest: dict[tuple[int, str], int] = {}  # (stage, "full" | "inputs" | "split") -> most bytes seen

    def measure(self, signature: tuple[Any, ...], activation: Activation, params: Iterable[torch.Tensor]) -> int:
        """Stash bytes of ``activation``; measured once per ``signature`` (stage, mode, input shapes)."""
        if signature not in self._sizes:
            self._sizes[signature] = size = stash_bytes(activation, params)
            self.note(signature[0], "inputs" if signature[1] else "full", size)
        return self._sizes[signature]

    def known(self, signature: tuple[Any, ...]) -> bool:
        return signature in self._sizes

    def note(self, stage: int, part: str, nbytes: int) -> None:
        """Keep the largest ``part`` of a microbatch of ``stage`` seen (microbatches may differ in rows)."""
        key = (stage, part)
        self._largest[key] = max(self._largest.get(key, 0), nbytes)

    def largest(self, stage: int, part: str) -> int | None:
        """The most bytes of ``part`` (``"full"``, ``"inputs"`` or ``"split"``) a microbatch of ``stage`` kept; None:
        not measured."""
        return self._largest.get((stage, part))

    def stage_bytes(self, stage: int) -> StageBytes | None:
        """The largest microbatch of ``stage`` measured with and without recomputation; None until both were."""
        full, inputs = self._largest.get((stage, "full")), self._largest.get((stage, "inputs"))
        if full is None or inputs is None:
            return None
        return StageBytes(full, inputs, self._largest.get((stage, "split"), 0))

    def hold(self, key: Key, nbytes: int) -> None:
        """``key`` keeps ``nbytes`` more from now on."""
        self.live[key] = self.live.get(key, 0) + nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def release(self, key: Key) -> None:
        self.current -= self.live.pop(key, 0)

    def reset(self) -> None:
        """Start a step: nothing held, peak zero."""
        self.live.clear()
        self.current = self.peak = 0


def signature(stage: int, checkpointed: bool, inputs: Any) -> tuple[Any, ...]:
    """What determines a stage's stash size: its index, checkpointing and its input shapes and dtypes."""
    leaves = tree.flatten(inputs)[0]
    shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in leaves)
    return (stage, checkpointed, shapes)
