"""Helpers over nested containers of tensors (activations, gradients, batches)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

# A bare tensor (most activations and gradients) skips pytree's walk: each call below runs several times per
# pipeline action, and the walk cost more than a small stage's compute (benchmarks/overhead.py).
_LEAF = pytree.tree_flatten(0)[1]  # the spec of a tree that is a single leaf


def flatten(tree: Any) -> tuple[list[Any], Any]:
    if isinstance(tree, torch.Tensor):
        return [tree], _LEAF
    return pytree.tree_flatten(tree)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    if spec is _LEAF:
        return leaves[0]
    return pytree.tree_unflatten(leaves, spec)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``tree``; other leaves are kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


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
