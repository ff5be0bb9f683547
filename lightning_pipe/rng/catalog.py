"""Which torch functions draw random numbers, and how a stage's call of each is routed to its own generators.

`kind_of` sorts them: ``INJECT`` (takes a ``generator``: the stage's is passed when the caller gave none),
``COMPOSITE`` (draws inside without one: runs under the aten-level mode), ``SDPA``/``MHA`` (attention with
dropout: runs the math version) and ``PASS`` (everything else). The tables are built from this torch's aten
schemas, so ops of later torch versions are covered (docs/internals.md).
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_NOT_DRAWS = {"manual_seed", "seed", "initial_seed"}  # take a generator, draw nothing


class RandomOpKind(enum.Enum):
    PASS = 0
    INJECT = 1
    COMPOSITE = 2
    SDPA = 3
    MHA = 4


def _generator_ops() -> dict[str, int | None]:
    """Name of every aten op with a ``Generator`` argument -> its position where it is not keyword-only."""
    ops: dict[str, int | None] = {}
    for schema in torch._C._jit_get_all_schemas():
        namespace, _, name = schema.name.partition("::")
        if namespace != "aten" or name in _NOT_DRAWS:
            continue
        for position, argument in enumerate(schema.arguments):
            if "Generator" in str(argument.type):
                ops.setdefault(name, None)
                if not argument.kwarg_only:
                    ops[name] = position
    return ops


GENERATOR_OPS = _generator_ops()


def _public_functions() -> dict[Any, int | None]:
    """The Python objects of those ops (``torch.X``, ``Tensor.X``, ``torch._C._nn.X``) and ``nn.init``'s functions."""
    found: dict[Any, int | None] = {}
    for name, position in GENERATOR_OPS.items():
        for namespace in (torch, torch.Tensor, torch._C._nn):
            fn = getattr(namespace, name, None)
            if fn is not None and not inspect.ismodule(fn):
                found[fn] = position
    for name in dir(nn.init):
        fn = getattr(nn.init, name)
        if inspect.isfunction(fn) and "generator" in inspect.signature(fn).parameters:
            found[fn] = None  # keyword ``generator`` (its position varies; passed by keyword)
    return found


_COMPOSITE_NAMES = (
    # torch.nn.functional: Python functions that draw inside without a generator argument (F.rrelu_ is torch.rrelu_)
    "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout rrelu gumbel_softmax "
    "fractional_max_pool2d fractional_max_pool3d fractional_max_pool2d_with_indices fractional_max_pool3d_with_indices "
    "_fractional_max_pool2d _fractional_max_pool3d"
).split()
_COMPOSITE_TORCH = (
    "dropout dropout_ feature_dropout feature_dropout_ alpha_dropout alpha_dropout_ feature_alpha_dropout "
    "feature_alpha_dropout_ native_dropout"
).split()
#: aten ops without a generator argument that draw (under the aten-level mode they decompose into ops that take
#: one, or, native_dropout, are reimplemented)
ATEN_DRAWS = {"native_dropout", "dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"}


#: function -> the position of its generator argument where it is not keyword-only
POSITIONS: dict[Any, int | None] = _public_functions()


def _kinds() -> dict[Any, RandomOpKind]:
    kinds: dict[Any, RandomOpKind] = {fn: RandomOpKind.INJECT for fn in POSITIONS}
    kinds.update({getattr(F, n): RandomOpKind.COMPOSITE for n in _COMPOSITE_NAMES if hasattr(F, n)})
    kinds.update({getattr(torch, n): RandomOpKind.COMPOSITE for n in _COMPOSITE_TORCH if hasattr(torch, n)})
    kinds[F.scaled_dot_product_attention] = RandomOpKind.SDPA
    kinds[F.multi_head_attention_forward] = RandomOpKind.MHA
    return kinds


KINDS: dict[Any, RandomOpKind] = _kinds()


def kind_of(func: Callable[..., Any]) -> RandomOpKind:
    """How a call of ``func`` is routed; ``torch.ops`` overloads are classified by their schema (and cached)."""
    try:
        kind = KINDS.get(func)
    except TypeError:  # unhashable callable
        return RandomOpKind.PASS
    if kind is not None:
        return kind
    kind = RandomOpKind.PASS
    schema = getattr(func, "_schema", None)
    if schema is not None:  # a torch.ops overload
        name = schema.name.partition("::")[2]
        slots = [(i, a) for i, a in enumerate(schema.arguments) if "Generator" in str(a.type)]
        if slots and name in GENERATOR_OPS:
            kind = RandomOpKind.INJECT
            POSITIONS[func] = None if slots[0][1].kwarg_only else slots[0][0]
        elif name in GENERATOR_OPS or name in ATEN_DRAWS:  # no generator here (aten.rand.default): the
            kind = RandomOpKind.COMPOSITE  # aten-level mode calls the overload with one, or reimplements the op
    elif isinstance(func, torch._ops.OpOverloadPacket):
        name = func._qualified_op_name.partition("::")[2]
        if name in GENERATOR_OPS or name in ATEN_DRAWS:
            kind = RandomOpKind.COMPOSITE  # overload chosen at call time: the aten-level mode sees the chosen one
    KINDS[func] = kind
    return kind


def draws(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call draws random numbers: zero dropout, evaluation mode or given samples draw nothing.

    Arguments that are not plain values (graph nodes of a traced model) count as drawing.
    """
    kind = kind_of(func)
    if kind is RandomOpKind.PASS:
        return False
    if kind is RandomOpKind.INJECT:
        return True
    values = _bind(func, args, kwargs)
    if "_random_samples" in values:  # fractional max pooling: draws only the samples it is not given
        return values["_random_samples"] is None
    probability = values.get("dropout_p", values.get("p", 1.0))
    training = values.get("training", values.get("train", True))
    return _nonzero(probability) and (not isinstance(training, bool) or training)


@functools.cache
def _parameters(func: Callable[..., Any]) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each parameter; builtins of the dropout family are (input, p, train)."""
    if func is F.scaled_dot_product_attention:
        return _SDPA_PARAMETERS
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return (("input", None), ("p", 0.5), ("train", True))
    return tuple((p.name, p.default if p.default is not p.empty else None) for p in signature.parameters.values())


_SDPA_PARAMETERS = (
    ("query", None),
    ("key", None),
    ("value", None),
    ("attn_mask", None),
    ("dropout_p", 0.0),
    ("is_causal", False),
    ("scale", None),
    ("enable_gqa", False),
)


def _bind(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    parameters = _parameters(func)
    values = {name: default for name, default in parameters}
    values.update({name: value for (name, _), value in zip(parameters, args, strict=False)})
    values.update(kwargs)
    return values


def _nonzero(value: Any) -> bool:
    return not isinstance(value, (int, float)) or value > 0
