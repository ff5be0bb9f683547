"""Byte counts as people read them: ``1536`` -> ``"1.5 KiB"``."""

from __future__ import annotations


def size_text(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"
