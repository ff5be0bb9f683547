"""A second device on a machine with only a CPU, for asserts that must tell two devices apart.

torch's PrivateUse1 key, renamed ``"second"`` (`torch.utils.backend_registration`): a tensor on ``second:0`` is
a wrapper whose values live in a CPU tensor (``.inner``); every aten op on it runs on those values and wraps
what it returns, so models train on it (autograd, optimizers) as on any device, while ``tensor.device`` says
``second:0``. A stage's tensor left on the CPU, or moved to the other stage's device, is then told apart, as on
a machine with a GPU. Tensors made on it with ``torch.tensor(scalar, device=...)`` fail (a pytorch internal
assert), so the coordinator's device (the last stage's, where Lightning makes such tensors) stays the CPU.

Registering renames PrivateUse1 for the life of the process and makes torch see an accelerator, and torch's
autograd engine takes a new device only before the process's first backward: `in_fresh_process` runs a test's
function in a new process that registers it first, so the test process and the tests after it see no change.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
from torch.utils._pytree import tree_map

NAME = "second"
DEVICE = f"{NAME}:0"  # a name torch knows once `register` ran


class OnSecond(torch.Tensor):
    """A tensor on `DEVICE` holding its values in the CPU tensor ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> OnSecond:
        wrapper = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=DEVICE, requires_grad=inner.requires_grad,
        )  # fmt: skip
        wrapper.inner = inner
        return wrapper  # type: ignore[no-any-return]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnSecond({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})


def _inner(value: Any) -> Any:
    if isinstance(value, OnSecond):
        return value.inner
    if isinstance(value, torch.device) and value.type == NAME:
        return torch.device("cpu")
    return value


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` on the CPU values; an op that writes into an argument returns that argument, any other op's
    tensors are wrapped unless the op was asked for another device (``.to("cpu")``)."""
    target = kwargs.get("device")
    here = target is None or torch.device(target).type == NAME
    out = func(*tree_map(_inner, args), **tree_map(_inner, kwargs))
    schema = func._schema
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if written and len(schema.returns) == 1 and schema.returns[0].alias_info is not None:
        index = written[0]
        return args[index] if index < len(args) else kwargs[schema.arguments[index].name]
    if not here:
        return out
    return tree_map(lambda t: OnSecond(t) if type(t) is torch.Tensor else t, out)


_registered: list[Any] = []


def register() -> None:
    """Make ``second`` a device of this process (once), with lightning_pipe's `PyTorchRuntime` for it."""
    if _registered:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from lightning_pipe import PyTorchRuntime, runtime_registry

    _setup_privateuseone_for_python_backend(rename=NAME)
    library = torch.library.Library("_", "IMPL")  # ops with no tensor on it yet: factories, .to(NAME)
    library.fallback(lambda op, *args, **kwargs: _run(op, args, kwargs), "PrivateUse1")
    runtime_registry.register(NAME, PyTorchRuntime)
    _registered.append(library)


def in_fresh_process(target: str, devices: list[str], timeout: float = 120) -> None:
    """``target`` (``"module:function"``, a module of tests/) called with ``devices`` in a new process where `register`
    ran first; its output in the AssertionError if it fails. A new process, not a fork of the test process: torch's
    autograd engine sizes its device queues at the first backward, so a process that ran one cannot take a device
    registered after it."""
    from launching import ROOT, base_env, run_all

    run = run_all([([sys.executable, str(ROOT / "tests" / "second_device.py"), target, *devices], base_env())], timeout)
    assert run.ok, f"{target}({devices}) with a second device '{NAME}' failed:\n{run.output[-4000:]}"


def main() -> None:
    """``python tests/second_device.py MODULE:FUNCTION DEVICE...``: `register`, then ``FUNCTION([DEVICE, ...])``."""
    register()
    module, _, function = sys.argv[1].partition(":")
    getattr(importlib.import_module(module), function)(sys.argv[2:])


if __name__ == "__main__":
    main()
