"""Proxies that record an operation in an fx graph and also carry the value it computed on the example.

`ConcreteTracer` (``tracer.py``) makes them. Python code that reads a proxy (``bool``, ``int``,
``len``, ``in``) gets the example's value, and the tracer notes where, unless the value is *static*:
made only from shapes, dtypes and devices, so that every call of the model takes the same branch.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree


class Concrete:
    """Value-based behaviour shared by `ConcreteProxy` and `ConcreteAttribute`."""

    value: Any
    tracer: Any  # the ConcreteTracer that made it
    static: bool  # derived only from shapes, dtypes and devices, not from tensor contents

    def __getattr__(self, name: str) -> ConcreteAttribute:
        if name in ("value", "tracer", "node", "root", "attr", "_node", "static") or name.startswith("__"):
            raise AttributeError(name)
        value = getattr(self.value, name)  # raises AttributeError as the real object would
        return ConcreteAttribute(self, name, value)  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return bool(self.tracer.specialise(self))

    def __len__(self) -> int:
        if isinstance(self.value, torch.Tensor):
            self.tracer.note_unrolled()
        return len(self.value)

    def __index__(self) -> int:
        return operator.index(self.tracer.specialise(self))

    def __int__(self) -> int:
        return int(self.tracer.specialise(self))

    def __float__(self) -> float:
        return float(self.tracer.specialise(self))

    def __contains__(self, item: Any) -> bool:
        return bool(concrete(item) in self.tracer.specialise(self))

    def __iter__(self) -> Iterator[Any]:
        value = self.value
        if isinstance(value, dict):
            return iter(list(value.keys()))
        if isinstance(value, torch.Tensor):
            self.tracer.note_unrolled()
        return iter([self[i] for i in range(len(value))])  # type: ignore[index]

    def __setitem__(self, key: Any, item: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, item), {})

    def keys(self) -> Any:
        return self.value.keys()


class ConcreteProxy(Concrete, fx.Proxy):
    """An fx proxy that also holds the value computed on the example call."""

    def __init__(self, node: fx.Node, tracer: Any, value: Any, static: bool = False) -> None:
        fx.Proxy.__init__(self, node, tracer)
        self.value = value
        self.static = static

    def __repr__(self) -> str:
        return f"ConcreteProxy({self.node.name})"


class ConcreteAttribute(Concrete, fx.proxy.Attribute):
    """``proxy.name``: recorded lazily (most attributes are method calls), with its value."""

    def __init__(self, root: ConcreteProxy, attr: str, value: Any) -> None:
        fx.proxy.Attribute.__init__(self, root, attr)
        self.value = value
        self.static = root.static or attr in SHAPE_ATTRIBUTES


# tensor metadata: Python code may branch on it freely, it does not depend on what the tensor holds
SHAPE_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "ndim", "layout", "size", "dim", "numel", "nelement", "stride", "element_size",
    "itemsize", "nbytes", "names", "requires_grad", "is_cuda", "is_cpu", "is_nested", "is_sparse", "is_quantized",
    "is_meta", "is_mps", "is_complex", "is_floating_point", "is_contiguous", "is_leaf", "get_device",
})  # fmt: skip


def concrete(tree: Any) -> Any:
    """``tree`` with every proxy replaced by its value."""
    return pytree.tree_map(lambda x: x.value if isinstance(x, Concrete) else x, tree)


def is_static(kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a new value depends only on shapes, dtypes and devices (not on what tensors hold)."""
    if kind in ("placeholder", "get_attr", "call_module"):
        return False
    if kind == "call_function" and target is getattr:
        return args[1] in SHAPE_ATTRIBUTES or all_static(args[0])
    if kind == "call_method" and target in SHAPE_ATTRIBUTES:
        return True
    return all_static((args, kwargs))


def all_static(tree: Any) -> bool:
    return all(x.static for x in pytree.tree_leaves(tree) if isinstance(x, Concrete))
