"""Whether a shard can draw random numbers, read from its modules (and a traced shard's graph) before it runs.

``"yes"``: it holds a dropout layer with ``p > 0`` (``nn.Dropout``, ``Dropout1d/2d/3d``,
``AlphaDropout``, ``FeatureAlphaDropout``), an ``nn.MultiheadAttention`` with dropout, an ``nn.RReLU``
or a fractional max pooling layer, or its traced code calls a random function (`catalog.draws`).
``"no"``: every module it runs is a torch.nn layer that draws nothing (or a container), and its traced
code calls no random function. ``"unknown"``: it runs a forward written elsewhere (your modules, a
library's): its first forward tells (`StageRandom` probes it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.nn.modules.dropout import _DropoutNd

from lightning_pipe.rng.catalog import draws

Verdict = Literal["yes", "no", "unknown"]
_RANDOM_LAYERS = (nn.RReLU, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)


def randomness(module: nn.Module) -> Verdict:
    """What the shard ``module``'s forward can draw, as far as its modules and traced code tell."""
    calls = getattr(module, "random_calls", ())
    if calls is None:  # a traced shard with code this process did not trace (a call variant sent by RPC)
        return "unknown"
    if calls:
        return "yes"
    called = getattr(module, "called_modules", None)
    if called is not None:  # a traced shard: its own code is known, it calls these modules
        return _worst(_modules(module.get_submodule(name)) for name in called)
    return _modules(module)


def random_calls(graphs: Iterable[fx.Graph]) -> list[str]:
    """Names of the random functions and methods a traced graph calls (with dropout ``p > 0`` or unknown)."""
    found: set[str] = set()
    for graph in graphs:
        for node in graph.nodes:
            if node.op == "call_function":
                target: Any = node.target
            elif node.op == "call_method":
                target = getattr(torch.Tensor, str(node.target), None)
            else:
                continue
            if target is not None and draws(target, tuple(node.args), dict(node.kwargs)):
                found.add(getattr(target, "__name__", str(target)))
    return sorted(found)


def _modules(module: nn.Module) -> Verdict:
    return _worst(_own(m) for m in module.modules())


def _own(module: nn.Module) -> Verdict:
    """What ``module``'s own forward draws (its children are asked separately)."""
    if isinstance(module, _DropoutNd):
        return "yes" if module.p > 0 else "no"
    if isinstance(module, nn.MultiheadAttention):
        return "yes" if module.dropout > 0 else "no"
    if isinstance(module, _RANDOM_LAYERS):
        return "yes"
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        return "yes"  # initialises its parameters (nn.init draws) on its first call
    if type(module).forward is nn.Module.forward or hasattr(module, "called_modules"):
        return "no"  # never called itself (ModuleList, ModuleDict), or a traced shard (its code is checked)
    if type(module).__module__.startswith("torch.nn."):
        return "no"  # torch.nn's layers: the ones that draw are listed above
    return "unknown"


def _worst(verdicts: Iterable[Verdict]) -> Verdict:
    found: Verdict = "no"
    for verdict in verdicts:
        if verdict == "yes":
            return "yes"
        if verdict == "unknown":
            found = "unknown"
    return found
