"""Helpers over nested containers of tensors (activations, gradients, batches)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

# A bare tensor (most activations and gradients) skips pytree's walk: each call below runs several times per
# pipeline action, and the walk cost more than a small stage's compute (benchmarks/overhead.py).
_LEAF = pytree.tree_flatten(0)[1]  # the spec of a tree that is a single leaf


# Plain tuples and lists of tensors and scalars (an activation and its mask, a list of gradients) skip it too: their
# shape is a small hashable key, and pytree's spec for each shape is made once (`structure`).
_SCALARS = frozenset((torch.Tensor, bool, int, float, str))  # exact types: pytree leaves, never nodes
if pytree.tree_flatten(None)[0] == [None]:  # None is a leaf in this torch's pytree (in others a node)
    _SCALARS |= {type(None)}
_SPECS: dict[Any, Any] = {}  # shape key -> pytree's TreeSpec for it
_SHAPES: dict[int, Any] = {}  # id of a TreeSpec in _SPECS (kept alive there) -> its shape key
_MAX_SHAPES = 256  # beyond this many shapes, new ones take pytree's walk each time


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """``pytree.tree_flatten(tree)``: its leaves and spec (the same spec object for every tree of one shape)."""
    if isinstance(tree, torch.Tensor):
        return [tree], _LEAF
    leaves: list[Any] = []
    key = _shape(tree, leaves)
    if key is not None:
        spec = _SPECS.get(key)
        if spec is not None:
            return leaves, spec
    leaves, spec = pytree.tree_flatten(tree)
    if key is not None and len(_SPECS) < _MAX_SHAPES:
        # stage threads may flatten the same new shape at once: one spec wins and stays alive in _SPECS, so the id
        # that _SHAPES is keyed by is never reused by another object
        spec = _SPECS.setdefault(key, spec)
        _SHAPES[id(spec)] = key
    return leaves, spec


def structure(tree: Any) -> tuple[list[Any], Any] | None:
    """The leaves of a plain tree (tuples and lists of tensors and scalars) and a hashable key of its shape;
    None for any other tree (a dict, a namedtuple, a tensor subclass, None in it)."""
    leaves: list[Any] = []
    key = _shape(tree, leaves)
    return None if key is None else (leaves, key)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    if spec is _LEAF:
        return leaves[0]
    key = _SHAPES.get(id(spec))
    if key is None or len(leaves) != spec.num_leaves:  # pytree's error for a wrong count of leaves
        return pytree.tree_unflatten(leaves, spec)
    return _build(key, iter(leaves))


def _shape(node: Any, leaves: list[Any]) -> Any:
    kind = type(node)
    if kind in _SCALARS:
        leaves.append(node)
        return kind  # a scalar's type is part of the shape: pytree's spec does not hold it, the key must
    if kind is tuple or kind is list:
        children = []
        for child in node:
            key = _shape(child, leaves)
            if key is None:
                return None
            children.append(key)
        return (kind, tuple(children))
    return None


def _build(key: Any, leaves: Any) -> Any:
    if not isinstance(key, tuple):
        return next(leaves)
    kind, children = key
    return kind(_build(child, leaves) for child in children)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``tree``; other leaves are kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    leaves, spec = flatten(tree)
    return unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply ``fn`` to every leaf of ``tree``."""
    return pytree.tree_map(fn, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor on ``device`` (tensors already there are kept as they are)."""
    return map_tensors(lambda t: t.to(device) if t.device != device else t, tree)


def tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in flatten(tree)[0] if isinstance(x, torch.Tensor)]


def grad_mask(tree: Any) -> list[bool]:
    """For each leaf, whether a gradient flows back through it."""
    return [isinstance(x, torch.Tensor) and x.requires_grad for x in flatten(tree)[0]]


def detach(tree: Any) -> Any:
    return map_tensors(lambda t: t.detach(), tree)


def as_leaves(tree: Any, mask: list[bool]) -> Any:
    """Detached copy of ``tree`` whose leaves marked in ``mask`` require grad (new autograd leaves)."""
    leaves, spec = flatten(tree)
    out = []
    for leaf, wants_grad in zip(leaves, mask, strict=True):
        if isinstance(leaf, torch.Tensor):
            leaf = leaf.detach()
            if wants_grad and (leaf.is_floating_point() or leaf.is_complex()):
                leaf.requires_grad_(True)
        out.append(leaf)
    return unflatten(out, spec)


def grads_of(tree: Any) -> list[torch.Tensor | None]:
    """The ``.grad`` of every leaf (None where there is none)."""
    return [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in flatten(tree)[0]]
