"""`KeyReport`: a checkpoint's keys against the model's, compared before any tensor is read.

Lightning's ``LightningModule.strict_loading`` (default True) decides what a mismatch does: a parameter or
persistent buffer the model has and the checkpoint lacks, or a key the checkpoint has and the model lacks,
raises; with ``strict_loading = False`` the missing tensors keep their initial values and the unexpected keys
are ignored, and the run says so once. The keys come from the checkpoint's metadata, never from its tensors:
a sharded folder's ``.metadata``, a safetensors header, the pickle of a ``torch.save`` file mapped into
memory (`lightning_pipe.weights.sources`: every source's ``keys()``).

Every process compares the same keys (the unsplit model's, read from the same path), so every process
of a run fails the same way, before any stage reads.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_pipe.base.errors import ConfigurationError

SHOWN = 5  # the names an error or warning lists before "and N more"
STRICT_FIX = (
    "to start from it anyway, with the missing tensors initialised as the model builds them and the other keys "
    "ignored, set `strict_loading = False` on the LightningModule (Lightning's flag); to read them, give the "
    "checkpoint the model's keys (load it with torch.load, rename the keys under 'state_dict', save it again)"
)
WEIGHTS_FIX = (
    "to start from them anyway, with the missing tensors initialised by their modules under the run's seed and "
    "the other keys ignored, set `strict_loading = False` on the LightningModule; to read them, save the weights "
    "under the pipelined module's own keys (its state_dict's), or pass PipeStrategy(module=...) the module they "
    "belong to"
)


class KeyMismatchError(ConfigurationError):
    """A checkpoint's or weights' keys do not match the model's and ``strict_loading`` is True."""


@dataclass
class KeyReport:
    """The model's keys the checkpoint lacks (``missing``) and the checkpoint's keys the model lacks
    (``unexpected``), each in the order they were listed."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return not self.missing and not self.unexpected

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{_count(self.missing, 'tensor')} of the model missing ({name_list(self.missing)})")
        if self.unexpected:
            parts.append(f"{_count(self.unexpected, 'key')} the model does not have ({name_list(self.unexpected)})")
        return "; ".join(parts)

    def check(self, strict: bool, where: str, fix: str = STRICT_FIX) -> None:
        """Raise `KeyMismatchError` (``strict``) naming the keys, where they were read, and the fix."""
        if strict and not self.matches:
            raise KeyMismatchError(f"{where} does not match the model: {self.describe()}. Nothing was read; {fix}")

    def lenient(self, where: str) -> str | None:
        """What a run with ``strict_loading = False`` says once about the mismatch (None: nothing to say)."""
        if self.matches:
            return None
        said = [f"strict_loading=False: {where} does not match the model"]
        if self.missing:
            said.append(f"{_count(self.missing, 'tensor')} initialised instead of read ({name_list(self.missing)})")
        if self.unexpected:
            said.append(f"{_count(self.unexpected, 'key')} of it ignored ({name_list(self.unexpected)})")
        return "; ".join(said)


def compare_keys(
    expected: Iterable[str], stored: Collection[str], aliases: Mapping[str, Sequence[str]] | None = None
) -> KeyReport:
    """``expected`` (the model's keys) against ``stored`` (the checkpoint's); a tied tensor is found under any of
    its names (``aliases``: a key's other names), and a stored key that is another name of a model's key is
    the model's."""
    aliases = aliases or {}
    stored = stored if isinstance(stored, set | frozenset) else set(stored)
    wanted = list(dict.fromkeys(expected))
    known = set(wanted)
    for key in wanted:
        known.update(aliases.get(key, ()))
    missing = [k for k in wanted if k not in stored and not any(a in stored for a in aliases.get(k, ()))]
    return KeyReport(missing, sorted(k for k in stored if k not in known))


def name_list(keys: Sequence[str], shown: int = SHOWN) -> str:
    """``'a', 'b' and 3 more``: the first few names of ``keys``."""
    names = ", ".join(repr(k) for k in keys[:shown])
    return f"{names} and {len(keys) - shown} more" if len(keys) > shown else names


def _count(keys: Sequence[str], noun: str) -> str:
    return f"{len(keys)} {noun}{'' if len(keys) == 1 else 's'}"


def visible(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as this process sees it; raises naming the path and this host where it is not there."""
    where = Path(path)
    if not where.exists():
        raise ConfigurationError(
            f"{what} {where} does not exist on host {socket.gethostname()} (process {os.getpid()}): every process "
            "reads ckpt_path= and weights= itself, so on several nodes (and for remote rpc workers) the path must "
            "be on a filesystem they all share, under the same name"
        )
    return where
