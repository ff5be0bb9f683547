"""A stage's own random generators: seeded from the run's seed and the stage index, saved, restored, replayed."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lightning_pipe.rng.routing import RandomRouting

#: set by Lightning's ``seed_everything`` (read as an environment variable: the engine does not import Lightning)
SEED_ENV = "PL_GLOBAL_SEED"
_NONE = object()


def run_seed(seed: int | None = None) -> int:
    """The run's seed: ``seed``; else ``PL_GLOBAL_SEED`` (``seed_everything`` ran); else ``torch.initial_seed()``."""
    if seed is not None:
        return int(seed)
    try:
        return int(os.environ[SEED_ENV])
    except (KeyError, ValueError):
        return int(torch.initial_seed())


def derive_seed(seed: int, *parts: object) -> int:
    """A 64-bit seed of its own for ``parts`` (a stage and a device, a step and a microbatch) of a run."""
    digest = hashlib.sha256("/".join(map(str, ("lightning_pipe", seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class StageGenerators:
    """The generators of one stage: one for CPU draws, one for its device, others made on first use.

    Each is keyed by ``"cpu"``, the stage device's type (``"cuda"``: a saved state moves with the
    stage to another device index) or the full name of another device.
    """

    def __init__(self, seed: int, stage: int, device: torch.device | str) -> None:
        self.seed, self.stage = seed, stage
        self.device = _indexed(torch.device(device))
        self._generators: dict[str, torch.Generator] = {}
        self._by_device: dict[torch.device, torch.Generator | None] = {}  # any device name -> its generator
        self.get(torch.device("cpu"))
        self.get(self.device)

    def get(self, device: torch.device) -> torch.Generator | None:
        """The generator for draws on ``device``; None where torch has none (``meta``)."""
        generator = self._by_device.get(device, _NONE)
        if generator is _NONE:
            generator = self._by_device[device] = self._create(self.key(_indexed(device)))
        return generator  # type: ignore[return-value]

    def _create(self, key: str) -> torch.Generator | None:
        if key not in self._generators:
            try:
                generator = torch.Generator(device=self._device(key))
            except RuntimeError:  # a device type without generators
                return None
            self._generators[key] = generator.manual_seed(derive_seed(self.seed, self.stage, key))
        return self._generators[key]

    def key(self, device: torch.device) -> str:
        if device.type == "cpu":
            return "cpu"
        return device.type if device == self.device else str(device)

    def _device(self, key: str) -> torch.device:
        return self.device if key == self.device.type else torch.device(key)

    def state(self) -> dict[str, torch.Tensor]:
        """Each generator's state by key (what a checkpoint holds)."""
        return {key: generator.get_state() for key, generator in self._generators.items()}

    def load_state(self, states: dict[str, torch.Tensor]) -> None:
        for key, state in states.items():
            generator = self.get(self._device(key))
            if generator is not None:
                generator.set_state(state.cpu())

    def snapshot(self) -> RandomState:
        """The current state, to replay the next draws (activation recomputation)."""
        return RandomState(self.seed, self.stage, self.device, self.state())


@dataclass(frozen=True)
class RandomState:
    """A stage's generator states before a forward; `replay` draws the same numbers again."""

    seed: int
    stage: int
    device: torch.device
    states: dict[str, torch.Tensor]

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Route this thread's draws to fresh generators in this state (the stage's own ones go on undisturbed)."""
        generators = StageGenerators(self.seed, self.stage, self.device)
        generators.load_state(self.states)
        with RandomRouting(generators):
            yield


@contextlib.contextmanager
def replaying(state: RandomState | torch.Tensor | None) -> Iterator[None]:
    """Around a recomputed forward: the draws of the forward it replaces.

    ``state`` is a stage's `RandomState`, None (the stage draws nothing), or a CPU state of torch's
    default generator (what executor modules stored before stages had generators of their own).
    """
    if state is None:
        yield
    elif isinstance(state, torch.Tensor):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            yield
    else:
        with state.replay():
            yield


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``: generators belong to one device index."""
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    module = getattr(torch, device.type, None)
    current = getattr(module, "current_device", None)
    return torch.device(device.type, current()) if current is not None else device
