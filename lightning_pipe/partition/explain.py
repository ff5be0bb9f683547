"""Errors that say where tracing stopped and what to do, warnings where a trace follows the example only,
and the check that a split model reproduces the model."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn

from lightning_pipe.base import tree
from lightning_pipe.base.errors import PartitionError


class TraceError(PartitionError):
    """The model could not be traced; the message names the line and what to do."""


RTOL, ATOL = 1e-4, 1e-5  # how close the split model's output on the example must be
_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UntraceableError(Exception):
    """Tracing stopped at ``where`` (a model line); ``inside`` names the innermost submodule being traced
    (empty: the top level). `explain` says it to the user once it is known whether ``inside`` can be kept
    whole."""

    def __init__(self, exc: Exception, where: str, inside: str) -> None:
        self.reason = f"{type(exc).__name__}: {exc}" + (f" at {where}" if where else "")
        super().__init__(self.reason)
        self.exc, self.where, self.inside = exc, where, inside

    def explain(self, module: nn.Module, split_points: Sequence[str] = ()) -> str:
        """The message for the user; ``split_points`` are those inside ``inside`` (why it cannot be a leaf)."""
        exc = self.exc
        lines = [f"could not trace {type(module).__name__} to split it into stages: {type(exc).__name__}: {exc}"]
        if self.where:
            lines.append(f"  tracing stopped at {self.where}")
        if self.inside:
            kind = type(module.get_submodule(self.inside)).__name__
            why = f"the split point {split_points[0]!r} is inside it" if split_points else "it is already kept whole"
            lines.append(f"  inside the submodule {self.inside!r} ({kind}), which cannot be kept whole: {why}")
        else:
            lines.append(f"  in the top-level forward of {type(module).__name__}")
        lines.append("what to do:")
        lines.extend(f"  - {hint}" for hint in _hints(exc))
        lines.append(
            "  - move that code into a submodule and mark it as a leaf, TracedPartitioner(leaf_modules=[name or "
            "class]): a leaf runs as one layer and is not traced into"
        )
        lines.append("  - or give split_points=[...] at the submodules around it")
        lines.append("  - or make the pipelined module an nn.Sequential of layers, which is split without tracing")
        return "\n".join(lines)


class UnsentValue(TypeError):
    """A layer is called with an object that is not a tensor, a container of tensors or a constant."""

    def __init__(self, layer: str, argument: str, value: Any) -> None:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        super().__init__(
            f"the layer {layer!r} is called with {argument} = a {kind}, which is not a tensor, a tuple, list or dict "
            "of tensors, or a constant: it cannot be a value that stages pass each other"
        )
        self.value = value


class SideChannel(RuntimeError):
    """A tensor computed from the inputs reached the graph as a fixed value, not through the traced code."""

    def __init__(self) -> None:
        super().__init__(
            "a tensor the forward computed from its inputs reached the traced code by a side channel (a forward "
            "hook, a global, or an attribute one module sets and another reads), so the split model would use the "
            "example's value on every call"
        )


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
        raise UntraceableError(exc, where, scopes[-1] if scopes else "") from exc


def check_close(name: str, expected: Any, got: Any, training: bool) -> None:
    """Raise `TraceError` unless the split model's output ``got`` matches the model's ``expected``."""
    mode = "training" if training else "eval"
    want, want_spec = tree.flatten(expected)
    have, have_spec = tree.flatten(got)
    if want_spec != have_spec:
        raise TraceError(f"the split {name} returns {have_spec} in {mode} mode but the model returns {want_spec}")
    for i, (a, b) in enumerate(zip(want, have, strict=True)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL, equal_nan=True):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape mismatch"
                raise TraceError(
                    f"the split {name} does not reproduce the model's output {i} on the example in "
                    f"{mode} mode (max difference {diff}). The forward probably keeps state between calls or changes "
                    "tensors in place in a way the trace does not record; mark the submodule doing it as a leaf "
                    "(leaf_modules=[...]) or pass check=False if the difference is expected (e.g. random ops)"
                )


def warn_about(
    name: str, kept_whole: Sequence[tuple[str, str]], unrolled: Sequence[str], data_dependent: Sequence[str]
) -> None:
    """Warn about what the trace of model ``name`` could not follow exactly."""
    for inside, reason in kept_whole:
        warnings.warn(
            f"{name}: could not trace into {inside!r} ({reason}); it runs whole inside one stage",
            stacklevel=3,
        )
    if unrolled:
        lines = "\n".join(f"  {where}" for where in unrolled[:5])
        warnings.warn(
            f"{name}: len() of a tensor, or a loop over its rows, is fixed to the example's size while tracing at:\n"
            f"{lines}\nCalls with another first dimension will fail; use x.size(0) / tensor ops, or mark the "
            "module holding that code as a leaf (leaf_modules=[...])",
            stacklevel=3,
        )
    if data_dependent:
        lines = "\n".join(f"  {where}" for where in data_dependent[:5])
        more = f"\n  (and {len(data_dependent) - 5} more)" if len(data_dependent) > 5 else ""
        warnings.warn(
            f"{name}: Python code read tensor values while tracing (an `if` on a tensor, float(), .item()); the split "
            f"model keeps what the example gave there on every call:\n{lines}{more}\nIf that can differ between "
            "batches, mark the module holding that code as a leaf (leaf_modules=[...])",
            stacklevel=3,
        )


def _hints(exc: BaseException) -> list[str]:
    """Fixes for the known causes, before the general ones."""
    if isinstance(exc, UnsentValue) and type(exc.value).__name__.endswith("Cache"):
        return ["call the HuggingFace model with use_cache=False: its key/value cache serves generation, not training"]
    if isinstance(exc, UnsentValue):
        return ["pass tensors (or tuples, lists and dicts of them) to the layers; keep other objects inside a leaf"]
    if isinstance(exc, SideChannel):
        return [
            "HuggingFace models collect output_hidden_states and output_attentions with forward hooks: call the model "
            "without them (the output keeps last_hidden_state and the logits)"
        ]
    if isinstance(exc, NameError) and "parameter is not a member" in str(exc):
        return [
            "a module with parameters is created inside forward (its weights are new on every call and never "
            "trained) or kept in a plain list or dict: create it in __init__ as an attribute (nn.ModuleList / "
            "nn.ModuleDict for several)"
        ]
    return []


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
