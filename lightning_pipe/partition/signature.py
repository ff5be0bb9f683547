"""The call signature of a traced module: which arguments are graph inputs, and how outputs are rebuilt.

A call ``module(*args, **kwargs)`` is bound to the forward's parameters and flattened; its tensors
become the graph's inputs (in order) and everything else (``None``, ``scale=0.5``) is a constant of
the trace. The graph returns its tensors flat; `Signature.unflatten_output` rebuilds the tensor,
tuple, dict or dataclass the model returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from lightning_pipe.base.errors import PartitionError


@dataclass
class CallArgs:
    """One call of the pipelined module: positional and keyword arguments."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, sample: Any) -> CallArgs:
        """A sample batch as a call: a tuple is positional arguments, anything else one argument."""
        if isinstance(sample, CallArgs):
            return sample
        if isinstance(sample, tuple) and not hasattr(sample, "_fields"):
            return cls(tuple(sample), {})
        return cls((sample,), {})


@dataclass
class Signature:
    """How a call's arguments map to the flat graph inputs, and the graph outputs to the result."""

    parameters: inspect.Signature
    in_spec: Any
    in_leaves: list[Any]  # constants, or _TENSOR where a graph input goes
    input_names: list[str]
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)  # constants, or _TENSOR where a graph output goes

    @classmethod
    def of(cls, module: nn.Module, call: CallArgs) -> Signature:
        parameters = inspect.signature(class_forward(module))
        arguments = _bind(parameters, call, module)
        leaves, spec = pytree.tree_flatten(arguments)
        paths = [_path_name(path) for path, _ in pytree.tree_flatten_with_path(arguments)[0]]
        names: list[str] = []
        in_leaves: list[Any] = []
        for path, leaf in zip(paths, leaves, strict=True):
            if isinstance(leaf, torch.Tensor):
                names.append(_unique(path, names))
                in_leaves.append(_TENSOR)
            else:
                in_leaves.append(leaf)
        return cls(parameters, spec, in_leaves, names)

    def tensors(self, call: CallArgs) -> list[torch.Tensor]:
        """The flat graph inputs of ``call``; fails if it does not match the traced call."""
        leaves, spec = pytree.tree_flatten(_bind(self.parameters, call))
        if spec != self.in_spec:
            raise PartitionError(
                f"the pipelined module was traced for a call with arguments {self.describe(self.in_spec)} but is "
                f"now called with {self.describe(spec)}; call it the same way every time (the graph is "
                "specialised to one call signature)"
            )
        out = []
        for leaf, traced in zip(leaves, self.in_leaves, strict=True):
            if traced is _TENSOR:
                if not isinstance(leaf, torch.Tensor):
                    raise PartitionError(f"expected a tensor where the traced call had one, got {type(leaf).__name__}")
                out.append(leaf)
            elif not _same_constant(leaf, traced):
                raise PartitionError(
                    f"the pipelined module was traced with the constant argument {traced!r} but is now called with "
                    f"{leaf!r}; non-tensor arguments are fixed when the graph is traced"
                )
        return out

    def matches(self, call: CallArgs) -> bool:
        """Whether ``call`` passes tensors and constants where the traced call did."""
        try:
            self.tensors(call)
        except PartitionError:
            return False
        return True

    def rebuild(self, flat: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        it = iter(flat)
        leaves = [next(it) if leaf is _TENSOR else leaf for leaf in self.in_leaves]
        bound = inspect.BoundArguments(self.parameters, pytree.tree_unflatten(leaves, self.in_spec))
        return bound.args, bound.kwargs

    def flatten_output(self, output: Any) -> tuple[Any, ...]:
        """Record how ``output`` (traced values in containers) is built; returns its traced values, flat."""
        leaves, self.out_spec = pytree.tree_flatten(output)
        flat, self.out_leaves = [], []
        for leaf in leaves:
            if isinstance(leaf, (fx.Proxy, torch.Tensor)):
                flat.append(leaf)
                self.out_leaves.append(_TENSOR)
            else:
                self.out_leaves.append(leaf)
        return tuple(flat)

    def unflatten_output(self, flat: Sequence[Any]) -> Any:
        it = iter(flat)
        leaves = [next(it) if leaf is _TENSOR else leaf for leaf in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def describe(self, spec: Any) -> str:
        if spec.type is dict:
            return "(" + ", ".join(str(k) for k in spec.context) + ")"
        return str(spec)


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()


def class_forward(module: nn.Module) -> Callable[..., Any]:
    """``module.forward`` as its class defines it (a wrapper set on the instance, such as PipeStrategy's
    hand-off to the pipeline, is not the model's code)."""
    return type(module).forward.__get__(module, type(module))  # type: ignore[no-any-return]


def _bind(parameters: inspect.Signature, call: CallArgs, module: nn.Module | None = None) -> dict[str, Any]:
    try:
        bound = parameters.bind(*call.args, **call.kwargs)
    except TypeError as exc:
        name = type(module).__name__ if module is not None else "the pipelined module"
        raise PartitionError(f"the example call does not match {name}.forward{parameters}: {exc}") from None
    return dict(bound.arguments)


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return a is b


def _path_name(path: Sequence[Any]) -> str:
    atoms = []
    for key in path:
        atom = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
        atoms.append(str(atom))
    name = "_".join(atoms)
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "input"


def _unique(name: str, taken: list[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    return candidate
