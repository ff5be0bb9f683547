"""The digits example: the same accuracy with and without PipeStrategy, and at least 95%."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (pip install lightning_pipe[examples])")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from digits import train  # noqa: E402


def test_digits_with_and_without_pipe() -> None:
    piped = train(pipe=True, stages=2, microbatches=4, schedule="1f1b")
    plain = train(pipe=False)
    print(f"digits validation accuracy: PipeStrategy {piped:.4f}, plain {plain:.4f}")
    assert piped >= 0.95
    assert abs(piped - plain) <= 0.01
