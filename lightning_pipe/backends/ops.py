"""Operator substitution: the first backend whose checker accepts an op's inputs runs that op.

Two mechanisms over one `OpTable`: `SubstitutionMode` (a TorchFunctionMode, for stages that run
eagerly) intercepts the mapped functions while a forward runs; `rewrite_graph` replaces them in a
traced FX graph before a compiler (inductor) sees it. Checkers see `TensorMeta`, never data, and
their decision is cached per input signature.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_pipe.backends.base import Backend, BackendError, Checker
from lightning_pipe.backends.meta import TensorMeta, metas_of, signature
from lightning_pipe.backends.trace import OpCounter

_TENSOR_PREFIX = "torch.Tensor."


def resolve_op(name: str) -> Any:
    """The Python object an op name refers to: ``"torch.nn.functional.gelu"`` -> ``F.gelu``."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise BackendError(f"{name!r} does not name a PyTorch operation (expected e.g. 'torch.nn.functional.gelu')")


@dataclass(frozen=True)
class OpChoice:
    """The implementation chosen for one op on one input signature."""

    op: str
    backend: str
    impl_name: str
    impl: Callable[..., Any]


@dataclass(frozen=True)
class _Candidate:
    op: str
    backend: str
    impl_name: str
    checker: Checker
    impl: Callable[..., Any]


class OpTable:
    """The op maps of a chain of backends, in priority order, with cached checker decisions."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self._by_fn: dict[Any, list[_Candidate]] = {}
        self._by_method: dict[str, list[_Candidate]] = {}
        self._decisions: dict[Hashable, OpChoice | None] = {}
        for backend in backends:
            for op, (impl_name, checker, impl) in backend.op_map.items():
                candidate = _Candidate(op, backend.name, impl_name, checker, impl)
                self._by_fn.setdefault(resolve_op(op), []).append(candidate)
                if op.startswith(_TENSOR_PREFIX):  # FX keeps tensor methods as call_method nodes
                    self._by_method.setdefault(op[len(_TENSOR_PREFIX) :], []).append(candidate)

    def __bool__(self) -> bool:
        return bool(self._by_fn)

    def op_names(self) -> list[str]:
        return sorted({c.op for cs in self._by_fn.values() for c in cs})

    def candidates(self, fn: Any) -> list[_Candidate] | None:
        try:
            return self._by_fn.get(fn)
        except TypeError:  # unhashable callables are never in the table
            return None

    def method_candidates(self, name: str) -> list[_Candidate] | None:
        return self._by_method.get(name)

    def choose(self, candidates: list[_Candidate], args: Any, kwargs: Any, cache: bool = True) -> OpChoice | None:
        """The first candidate whose checker accepts these inputs; None leaves the op to the stage backend."""
        key = (candidates[0].op, signature(args), signature(kwargs)) if cache else None
        if key is not None and key in self._decisions:
            return self._decisions[key]
        meta_args, meta_kwargs = metas_of(tuple(args)), metas_of(dict(kwargs))
        choice = None
        for c in candidates:
            try:
                accepted = bool(c.checker(*meta_args, **meta_kwargs))
            except Exception as exc:
                raise BackendError(
                    f"the checker of backend {c.backend!r} for {c.op} ({c.impl_name}) raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if accepted:
                choice = OpChoice(c.op, c.backend, c.impl_name, c.impl)
                break
        if key is not None:
            self._decisions[key] = choice
        return choice


class SubstitutionMode(TorchFunctionMode):
    """While active, calls of a table's ops go to the accepted implementation and are counted.

    Ops are intercepted where the forward calls them; the implementation itself runs with the mode
    off, so an op nested inside another substituted or native op is not intercepted again.
    """

    def __init__(self, table: OpTable, counter: OpCounter, native: str) -> None:
        super().__init__()
        self.table = table
        self.counter = counter
        self.native = native  # the stage backend's name, recorded where no op backend accepted

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        candidates = self.table.candidates(func)
        if candidates is None:
            return func(*args, **kwargs)
        choice = self.table.choose(candidates, args, kwargs)
        if choice is None:
            self.counter.add(candidates[0].op, self.native, self.native)
            return func(*args, **kwargs)
        self.counter.add(choice.op, choice.impl_name, choice.backend)
        return choice.impl(*args, **kwargs)


def _example(arg: Any) -> Any:
    """An FX node's traced value as checkers see it (TensorMeta for tensors)."""
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("example_value", arg.meta.get("val"))
        return TensorMeta.of(value) if isinstance(value, torch.Tensor) else value
    return arg


def rewrite_graph(gm: torch.fx.GraphModule, table: OpTable, native: str) -> OpCounter:
    """Point every accepted op node of ``gm`` at its implementation; returns one forward's op counts.

    Checkers run here, at compile time, on the traced example values' metadata.
    """
    per_call = OpCounter()
    for node in list(gm.graph.nodes):
        if node.op == "call_function":
            candidates = table.candidates(node.target)
        elif node.op == "call_method":
            candidates = table.method_candidates(str(node.target))
        else:
            continue
        if not candidates:
            continue
        args = torch.fx.node.map_aggregate(node.args, _example)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, _example)
        choice = table.choose(candidates, args, kwargs, cache=False)
        if choice is None:
            per_call.add(candidates[0].op, native, native)
            continue
        node.op, node.target = "call_function", choice.impl
        per_call.add(choice.op, choice.impl_name, choice.backend)
    gm.recompile()
    return per_call
