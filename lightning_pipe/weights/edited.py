"""`StateEdits`: what a checkpoint hook did to a checkpoint's ``state_dict``; `EditedSource` reads through it.

Lightning hands the checkpoint to ``LightningModule.on_load_checkpoint`` before the model's state is loaded, so a
hook can migrate a checkpoint: rename keys, drop them, add tensors, convert or scale them. Under `PipeStrategy` the
stages read their own tensors where they run, from the file or folder, so what the hook did is described against
what the checkpoint stores: a key whose tensor the hook left as it was (the same object, under its own name or
another) is read from the checkpoint by its stored name; a tensor the hook made is given by value, to the stage
that holds it only (`only`); a stored key the hook removed is not read. A hook that only renames keys moves no
tensor and reads none.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pipe.weights.sources import WeightSource


@dataclass
class StateEdits:
    """A hook's edits, by key of the checkpoint's ``state_dict``.

    ``moved``: a key the hook put a stored tensor under, unchanged, and that tensor's stored key (a rename, or a
    second name); ``dropped``: stored keys whose own entry the hook removed or replaced; ``given``: the values the
    hook made (converted, scaled, added), by key.
    """

    moved: dict[str, str] = field(default_factory=dict)
    dropped: frozenset[str] = frozenset()
    given: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def between(cls, stored: Mapping[str, Any], edited: Mapping[str, Any]) -> StateEdits | None:
        """The edits that turn ``stored`` (what the hook was handed) into ``edited`` (what it left); None: none."""
        origin = {id(value): key for key, value in stored.items()}
        moved: dict[str, str] = {}
        given: dict[str, Any] = {}
        for key, value in edited.items():
            was = origin.get(id(value))
            if was == key:
                continue
            if was is not None:
                moved[key] = was
            else:
                given[key] = value
        missing = object()
        dropped = frozenset(key for key, value in stored.items() if edited.get(key, missing) is not value)
        if not moved and not given and not dropped:
            return None
        return cls(moved, dropped, given)

    def only(self, keys: Collection[str]) -> StateEdits:
        """These edits with the given values of ``keys`` only (what one stage reads: no process holds another's)."""
        return StateEdits(self.moved, self.dropped, {k: v for k, v in self.given.items() if k in keys})

    def apply(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (values by stored key; a part of the checkpoint) under the keys these edits give: a moved value
        under its new key too, a dropped one left out. Given values are not added (the process holding them
        writes them)."""
        out = {k: v for k, v in state.items() if k not in self.dropped}
        for new, old in self.moved.items():
            if old in state:
                out[new] = state[old]
        return out

    def new_name(self, key: str) -> str:
        """The key a parameter stored as ``key`` is written under (its optimizer state follows its tensor)."""
        if key in self.dropped:
            for new, old in self.moved.items():
                if old == key:
                    return new
        return key

    def handed_over(self) -> None:
        """The workers' specs hold the given values they read (`only`): let go of them here (the coordinator would
        otherwise keep every stage's converted tensors for the whole fit)."""
        self.given.clear()

    def stored_name(self, key: str) -> str:
        """The name the checkpoint stores ``key``'s tensor under (its optimizer state too)."""
        return self.moved.get(key, key)

    def describe(self) -> str:
        parts = []
        if self.moved:
            parts.append(f"{len(self.moved)} renamed")
        if self.given:
            parts.append(f"{len(self.given)} given")
        removed = self.dropped - set(self.given)
        if removed:
            parts.append(f"{len(removed)} removed")
        return ", ".join(parts)


class EditedSource(WeightSource):
    """``source`` (a checkpoint's ``state_dict`` by its keys) as the hook left it (``edits``)."""

    def __init__(self, source: WeightSource, edits: StateEdits) -> None:
        self.source, self.edits = source, edits
        kept = (key for key in source.keys() if key not in edits.dropped)
        self._keys = dict.fromkeys([*kept, *edits.moved, *edits.given])

    def keys(self) -> Collection[str]:
        return self._keys.keys()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def get(self, key: str) -> torch.Tensor:
        if key in self.edits.given:
            return self.edits.given[key]  # type: ignore[no-any-return]
        if key not in self._keys:
            raise KeyError(f"{self.describe()} has no tensor {key!r}")
        return self.source.get(self.edits.stored_name(key))

    def read(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        stored = [k for k in keys if k not in self.edits.given]
        got = self.source.read([self.edits.stored_name(k) for k in stored]) if stored else {}
        read = {k: got[self.edits.stored_name(k)] for k in stored}
        return {k: self.edits.given[k] if k in self.edits.given else read[k] for k in keys}

    def read_shard(self, key: str, target: torch.Tensor) -> bool:
        if key in self.edits.given:
            return False  # given whole: the caller cuts its shard
        return self.source.read_shard(self.edits.stored_name(key), target)

    def release(self, tensor: torch.Tensor) -> None:
        if not any(tensor is value for value in self.edits.given.values()):
            self.source.release(tensor)

    def close(self) -> None:
        self.source.close()

    def describe(self) -> str:
        return f"{self.source.describe()} as on_load_checkpoint left it ({self.edits.describe()})"
