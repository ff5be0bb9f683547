"""Lightning's ``strict_loading`` for a checkpoint that rpc mode opens itself (its workers read their stages).

A plain Trainer loads the module's state dict with ``strict`` and so raises on a key the model has and the
checkpoint lacks, or the other way round. When the workers read their own tensors, nothing would: a missing
tensor would keep its initial value and Lightning would still restore the epoch and step. So the keys are
compared here, before any stage is built: ``strict`` raises with the names, else the run says once how many
tensors start from their initial values instead. (The same check as the local and launched modes' key check,
written for rpc mode; the messages read alike.)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe.errors import ConfigurationError

SHOWN = 5  # names listed in a message; the rest are counted
FIX = (
    "to start from it anyway, with the missing tensors initialised as the model builds them and the other keys "
    "ignored, set `strict_loading = False` on the LightningModule (Lightning's flag); to read them, give the "
    "checkpoint the model's keys (load it with torch.load, rename the keys under 'state_dict', save it again)"
)


def check_keys(expected: Mapping[str, Any], stored: Collection[str], strict: bool, where: str) -> None:
    """``expected`` (the LightningModule's state dict) against the keys ``stored`` in the checkpoint ``where``."""
    stored = set(stored)
    missing = [k for k in expected if k not in stored]
    unexpected = sorted(k for k in stored if k not in expected)
    if not missing and not unexpected:
        return
    if strict:
        parts = [f"{_count(missing, 'tensor')} of the model missing ({_names(missing)})"] if missing else []
        if unexpected:
            parts.append(f"{_count(unexpected, 'key')} the model does not have ({_names(unexpected)})")
        raise ConfigurationError(
            f"the checkpoint {where} does not match the model: {'; '.join(parts)}. Nothing was read; {FIX}"
        )
    said = [f"strict_loading=False: the checkpoint {where} does not match the model"]
    if missing:
        said.append(f"{_count(missing, 'tensor')} initialised instead of read ({_names(missing)})")
    if unexpected:
        said.append(f"{_count(unexpected, 'key')} of it ignored ({_names(unexpected)})")
    rank_zero_warn("; ".join(said))


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def _count(keys: list[str], noun: str) -> str:
    return f"{len(keys)} {noun}{'' if len(keys) == 1 else 's'}"
