"""Balancing: split a list of per-layer costs into contiguous parts with the smallest maximum."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_pipe.base import tree
from lightning_pipe.base.errors import PartitionError
from lightning_pipe.engine.executors import call_module


def balance_by_cost(costs: Sequence[float], parts: int) -> list[int]:
    """Layer counts per part, contiguous, each >= 1, minimising the most expensive part.

    Exact dynamic programme over prefix sums; ties prefer even layer counts.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: (max cost, spread) for the first i layers in k parts
    best = [[(inf, inf)] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0.0, 0.0)
    even = n / parts
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev[0] == inf:
                    continue
                cand = (max(prev[0], prefix[i] - prefix[j]), prev[1] + abs((i - j) - even))
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def param_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Parameter count per layer (1 for a layer without parameters, so it still weighs something)."""
    return [float(sum(p.numel() for p in layer.parameters()) or 1) for layer in layers]


def _on_meta(layers: Sequence[nn.Module]) -> bool:
    return any(t.is_meta for layer in layers for t in [*layer.parameters(), *layer.buffers()])


def memory_costs(layers: Sequence[nn.Module], sample: Any) -> list[float]:
    """Bytes of parameters plus bytes of the activation each layer produces on ``sample``.

    A model built on the meta device is measured on a meta copy of ``sample``: shapes are all this needs.
    """
    costs = []
    x = tree.map_tensors(lambda t: t.to("meta"), sample) if _on_meta(layers) else sample
    with torch.no_grad():
        for layer in layers:
            x = call_module(layer, x)
            act = sum(t.numel() * t.element_size() for t in tree.tensors(x))
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            costs.append(float(params + act))
    return costs


def time_costs(layers: Sequence[nn.Module], sample: Any, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward per layer on ``sample`` (median of ``repeats``)."""
    if _on_meta(layers):
        raise PartitionError(
            "partition='time' times each layer's forward and backward, which needs its weights, but the model was "
            "built on the meta device (init_module(empty_init=True) or configure_model): use partition='params', "
            "'memory' or 'uniform', or give the layer counts"
        )
    costs = []
    x = tree.detach(sample)
    for layer in layers:
        timings = []
        for _ in range(repeats):
            inp = tree.as_leaves(x, [isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree.flatten(x)[0]])
            start = time.perf_counter()
            with torch.enable_grad():
                out = call_module(layer, inp)
                outs = [t for t in tree.tensors(out) if t.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            timings.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(timings)[len(timings) // 2])
        with torch.no_grad():
            x = call_module(layer, x)
    return costs
