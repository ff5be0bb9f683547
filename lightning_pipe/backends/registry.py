"""The backend registry: names -> `Backend`, and the default chain every stage falls back on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from lightning_pipe.backends.base import Backend, BackendError, OpEntry
from lightning_pipe.backends.compilers import EagerCompiler, InductorCompiler
from lightning_pipe.backends.ops import OpTable, SubstitutionMode, resolve_op
from lightning_pipe.backends.tensorrt import TensorRTCompiler
from lightning_pipe.backends.trace import OpCounter
from lightning_pipe.base.errors import ConfigurationError

EAGER = "eager"
_BACKENDS: dict[str, Backend] = {}
_DEFAULTS: list[str] = []  # newest first; eager always ends the chain


def register_backend(
    name: str,
    op_map: Mapping[str, OpEntry] | None = None,
    add_to_default: bool = True,
    *,
    compiler: type | None = None,
    options: Mapping[str, Any] | None = None,
) -> Backend:
    """Register a backend under ``name``; registering a name again replaces it.

    ``op_map`` maps a PyTorch op's name to ``(implementation name, checker, implementation)``: the
    checker is called like the op, with `TensorMeta` in place of tensors, and returns whether the
    implementation can run it. With ``add_to_default`` the backend joins the default chain (ahead
    of the backends already there), so every stage uses it without naming it. ``compiler`` (a
    subclass of `EagerCompiler`) makes it a stage backend that runs whole forwards.
    """
    entries: dict[str, OpEntry] = {}
    for op, entry in (op_map or {}).items():
        if not (isinstance(entry, tuple) and len(entry) == 3 and callable(entry[1]) and callable(entry[2])):
            raise ConfigurationError(
                f"backend {name!r}: op_map[{op!r}] must be (implementation name, checker, implementation), "
                f"got {entry!r}"
            )
        try:
            resolve_op(op)
        except BackendError as exc:
            raise ConfigurationError(f"backend {name!r}: {exc}") from None
        entries[op] = (str(entry[0]), entry[1], entry[2])
    if compiler is not None and not (isinstance(compiler, type) and issubclass(compiler, EagerCompiler)):
        raise ConfigurationError(f"backend {name!r}: compiler must be a subclass of EagerCompiler, got {compiler!r}")
    if name == EAGER and compiler is not EagerCompiler:
        raise ConfigurationError("'eager' is the built-in fallback backend and cannot be replaced")
    backend = Backend(name, entries, compiler, dict(options or {}))
    _BACKENDS[name] = backend
    if name in _DEFAULTS:
        _DEFAULTS.remove(name)
    if add_to_default and name != EAGER:
        _DEFAULTS.insert(0, name)
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend (and take it out of the default chain); the built-in eager stays."""
    if name == EAGER:
        raise ConfigurationError("'eager' is the built-in fallback backend and cannot be removed")
    get_backend(name)
    del _BACKENDS[name]
    if name in _DEFAULTS:
        _DEFAULTS.remove(name)


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"unknown backend {name!r}; available: {', '.join(available_backends())} "
            "(register your own with lightning_pipe.backends.register_backend)"
        ) from None


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


@contextlib.contextmanager
def substitute(backends: Sequence[str | Backend], native: str = EAGER) -> Iterator[OpCounter]:
    """Run a block with the op maps of ``backends`` (names or objects) active; yields the op counts.

    ``with substitute(["xent"]) as counts: loss = F.cross_entropy(logits, y)``
    """
    chain = [b if isinstance(b, Backend) else get_backend(b) for b in backends]
    counter = OpCounter()
    with SubstitutionMode(OpTable(chain), counter, native):
        yield counter


def default_backends() -> list[str]:
    """The chain used after the backends a stage asks for: registered defaults, newest first, then eager."""
    return [*_DEFAULTS, EAGER]


register_backend(EAGER, None, add_to_default=False, compiler=EagerCompiler)
register_backend("inductor", None, add_to_default=False, compiler=InductorCompiler)
register_backend("tensorrt", None, add_to_default=False, compiler=TensorRTCompiler)
