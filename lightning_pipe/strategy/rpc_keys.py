"""Lightning's ``strict_loading`` for a checkpoint that rpc mode opens itself (its workers read their stages).

A plain Trainer loads the module's state dict with ``strict`` and so raises on a key the model has and the
checkpoint lacks, or the other way round. When the workers read their own tensors, nothing would: a missing
tensor would keep its initial value and Lightning would still restore the epoch and step. So the keys are
compared here, before any stage is built: ``strict`` raises with the names, else the run says once how many
tensors start from their initial values instead.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

SHOWN = 5  # names listed in a message; the rest are counted


def check_keys(expected: Mapping[str, Any], stored: Collection[str], strict: bool, where: str) -> None:
    """``expected`` (the LightningModule's state dict) against the keys ``stored`` in the checkpoint ``where``."""
    stored = set(stored)
    missing = [k for k in expected if k not in stored]
    unexpected = sorted(k for k in stored if k not in expected)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing key(s) in the checkpoint: {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected key(s) in the checkpoint: {_names(unexpected)}")
        raise RuntimeError(
            f"Error(s) in loading state_dict from {where}: {'; '.join(parts)}. Map the keys to the model's (a "
            "LightningModule.on_load_checkpoint that renames them), or set LightningModule.strict_loading = False "
            "to start the missing tensors from their initial values and ignore the unexpected ones"
        )
    if missing or unexpected:
        said = f"strict_loading=False: {len(missing)} tensor(s) of the model were initialised instead of read from "
        said += where + (f" ({_names(missing)})" if missing else "")
        if unexpected:
            said += f"; {len(unexpected)} key(s) of the checkpoint were ignored ({_names(unexpected)})"
        rank_zero_warn(said)


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:SHOWN])
    return shown + (f" and {len(keys) - SHOWN} more ({len(keys)} in all)" if len(keys) > SHOWN else "")
