"""Routing a thread's random draws to a stage's own generators, with thread-local torch modes.

`RandomRouting` (a TorchFunctionMode) passes the stage's generator to every call that takes one and runs the
functions that draw inside without one under `AtenRouting` (a TorchDispatchMode), which passes it to the aten
ops they draw with. torch's mode stacks are per thread, so a mode pushed in a stage thread sees only that
stage's calls. On CPU the routed draws are exactly torch's own from a generator in the same state
(docs/internals.md; what it costs: docs/exactness.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode

from lightning_pipe.rng.catalog import ATEN_DRAWS, GENERATOR_OPS, POSITIONS, RandomOpKind, draws, kind_of


class Generators(Protocol):
    def get(self, device: torch.device) -> torch.Generator | None:
        """The generator for draws on ``device``; None where the device has none (meta tensors)."""


_ACTIVE = threading.local()  # how many RandomRouting modes this thread has entered


def routing_active() -> bool:
    """Whether this thread's torch calls are routed to a stage's generators now (backends compile only bare code)."""
    return getattr(_ACTIVE, "depth", 0) > 0


class RandomRouting(TorchFunctionMode):
    """Pushed around a stage's forward in its thread: its random draws come from ``generators``.

    ``drew`` tells whether any call drew from them (a stage's first forward is a probe).
    """

    def __init__(self, generators: Generators) -> None:
        super().__init__()
        self.generators = generators
        self.drew = False

    def __enter__(self) -> RandomRouting:
        _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.depth -= 1
        super().__exit__(*exc)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = kind_of(func)
        if kind is RandomOpKind.PASS:
            return func(*args, **kwargs)
        if kind is RandomOpKind.INJECT:
            args, kwargs, injected = inject(self.generators, POSITIONS.get(func), args, kwargs)
            self.drew = self.drew or injected
            return func(*args, **kwargs)
        if not draws(func, args, kwargs):  # no dropout in this call: nothing to route
            return func(*args, **kwargs)
        if kind is RandomOpKind.SDPA:
            return self._aten(_attention, *args, **kwargs)
        if kind is RandomOpKind.MHA:
            return self._aten(_multi_head_attention, func, *args, **kwargs)
        return self._aten(func, *args, **kwargs)

    def _aten(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        aten = AtenRouting(self.generators)
        with _dispatching(aten):
            result = func(*args, **kwargs)
        self.drew = self.drew or aten.drew
        return result


@contextlib.contextmanager
def _dispatching(mode: TorchDispatchMode) -> Iterator[None]:
    """Push ``mode`` on this thread's dispatch mode stack.

    Not ``with mode``: TorchDispatchMode.__enter__ also sets process-wide flags (module globals of
    torch.utils._python_dispatch, saved and restored per mode) that stage threads entering and leaving
    their modes at once would leave wrong; the mode stack itself is per thread.
    """
    _push_mode(mode)
    try:
        yield
    finally:
        _pop_mode()


class AtenRouting(TorchDispatchMode):
    """Around one call that draws inside: aten ops get the stage's generator."""

    def __init__(self, generators: Generators) -> None:
        super().__init__()
        self.generators = generators
        self.drew = False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.partition("::")[2]
        if name in GENERATOR_OPS:
            overload, position = _with_generator(func)
            if overload is not None:
                func = overload
                args, kwargs, injected = inject(self.generators, position, args, kwargs)
                self.drew = self.drew or injected
        elif name in ATEN_DRAWS and func is torch.ops.aten.native_dropout.default:
            generator = self.generators.get(args[0].device)
            if generator is not None and _training(args, kwargs):
                self.drew = True
                return _native_dropout(args[0], float(args[1]), generator)
        return func(*args, **kwargs)


@functools.cache
def _with_generator(func: Any) -> tuple[Any | None, int | None]:
    """The overload of ``func`` that takes a generator (``aten.rand.default`` -> ``aten.rand.generator``) and
    the generator's position where it is not keyword-only; None when no overload takes one."""
    names = [a.name for a in func._schema.arguments]
    packet = getattr(torch.ops.aten, func._schema.name.partition("::")[2])
    for overload in [func] + [getattr(packet, o) for o in packet.overloads()]:
        arguments = overload._schema.arguments
        if [a.name for a in arguments if a.name != "generator"] == names or overload is func:
            for position, argument in enumerate(arguments):
                if "Generator" in str(argument.type):
                    return overload, None if argument.kwarg_only else position
    return None, None


def inject(
    generators: Generators, position: int | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """``args, kwargs`` with the stage's generator where the caller passed none; and whether it was passed."""
    if position is not None and len(args) > position:
        if args[position] is not None:
            return args, kwargs, False
        generator = generators.get(_device(args, kwargs))
        if generator is None:
            return args, kwargs, False
        return (*args[:position], generator, *args[position + 1 :]), kwargs, True
    if kwargs.get("generator") is not None:
        return args, kwargs, False
    generator = generators.get(_device(args, kwargs))
    if generator is None:
        return args, kwargs, False
    return args, {**kwargs, "generator": generator}, True


def _device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """Where the call draws: its ``device=``, else its first tensor's device, else the default device."""
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.get_default_device()


def _training(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    train = kwargs.get("train", args[2] if len(args) > 2 else None)
    return train is None or bool(train)


def _native_dropout(x: torch.Tensor, p: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.native_dropout`` in training with an explicit generator (CPU kernel's algorithm)."""
    if x.numel() == 0:
        return x, torch.empty_like(x)
    keep = 1.0 - p
    mask = torch.empty_like(x).bernoulli_(keep, generator=generator)
    output = x.mul(mask).mul_(0.0 if keep == 0 else 1.0 / keep)
    return output, mask.bool()  # as the native kernel returns it, for native_dropout_backward


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with dropout, by the math kernel (the fused ones use the global generator)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch's dispatcher hands it to the math kernel
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            attn_mask.logical_not(), float("-inf")
        )
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


_MHA = inspect.signature(F.multi_head_attention_forward)


def _multi_head_attention(func: Any, *args: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward`` with dropout, by its explicit path (the weights are computed and dropped).

    Without weights it calls a fused attention kernel, which draws from the process-wide generator.
    """
    bound = _MHA.bind(*args, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    if values["need_weights"]:
        return func(*args, **kwargs)
    output, _ = func(**{**values, "need_weights": True})
    return output, None
