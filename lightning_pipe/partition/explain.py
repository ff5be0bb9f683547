"""Errors that say where tracing stopped and what to do, and where a trace read tensor values."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn

from lightning_pipe.errors import PartitionError


class TraceError(PartitionError):
    """The model could not be traced; the message names the line and what to do."""


_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UntraceableError(Exception):
    """Tracing stopped; ``inside`` names the innermost submodule being traced (empty: the top level)."""

    def __init__(self, message: str, inside: str, reason: str) -> None:
        super().__init__(message)
        self.message, self.inside, self.reason = message, inside, reason


@contextlib.contextmanager
def explained(module: nn.Module, tracer: Any) -> Iterator[None]:
    """Turn whatever stops ``tracer`` into an `UntraceableError` naming the model line and the fix."""
    try:
        yield
    except (TraceError, UntraceableError):
        raise
    except Exception as exc:
        where = _user_frame(sys.exc_info()[2])
        scopes = [path for path, _ in tracer.module_stack.values() if path]
        inside = scopes[-1] if scopes else ""
        reason = f"{type(exc).__name__}: {exc}" + (f" at {where}" if where else "")
        raise UntraceableError(_explain(module, exc, where, inside), inside, reason) from exc


def _explain(module: nn.Module, exc: BaseException, where: str, inside: str) -> str:
    lines = [f"could not trace {type(module).__name__} to split it into stages: {type(exc).__name__}: {exc}"]
    if where:
        lines.append(f"  tracing stopped at {where}")
    if inside:
        kind = type(module.get_submodule(inside)).__name__
        lines.append(f"  inside the submodule {inside!r} ({kind}), which is already kept whole")
    else:
        lines.append(f"  in the top-level forward of {type(module).__name__}")
    lines.append("what to do:")
    lines.append(
        "  - move that code into a submodule and mark it as a leaf, TracedPartitioner(leaf_modules=[name or class]): "
        "a leaf runs as one layer and is not traced into"
    )
    lines.append("  - or give split_points=[...] at the submodules around it")
    lines.append("  - or make the pipelined module an nn.Sequential of layers, which is split without tracing")
    return "\n".join(lines)


def _skipped(filename: str) -> bool:
    return filename.startswith((_TORCH_DIR, _PACKAGE_DIR, "<")) or "/contextlib.py" in filename


def _user_frame(tb: TracebackType | None) -> str:
    """The innermost frame outside torch and lightning_pipe: the model code that stopped the tracer."""
    found = ""
    for frame, lineno in traceback.walk_tb(tb):
        if not _skipped(frame.f_code.co_filename):
            found = _describe_frame(frame.f_code.co_filename, lineno, frame.f_code.co_name)
    return found


def user_frame_of(frame: FrameType | None) -> str:
    """The innermost caller outside torch and lightning_pipe, walking out from ``frame``."""
    while frame is not None:
        if not _skipped(frame.f_code.co_filename):
            return _describe_frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return ""


def _describe_frame(filename: str, lineno: int, name: str) -> str:
    source = traceback.FrameSummary(filename, lineno, name).line or ""
    return f"{filename}:{lineno} in {name}: {source.strip()}"
