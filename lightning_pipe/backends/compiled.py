"""Modules the user wrapped in ``torch.compile``: the original module to split, and how to compile its stages.

``self.model = torch.compile(self.model)`` hands the pipeline a ``torch._dynamo.eval_frame.OptimizedModule``:
one compiled graph for the whole module, which can be neither traced nor cut into stages. The pipeline splits
the original module (``_orig_mod``, whose parameters are the wrapper's) and compiles each stage with the
``inductor`` backend instead, with the options the user gave ``torch.compile`` (``mode`` as the inductor
settings it stands for, ``options``, ``dynamic``, ``fullgraph``). Other Dynamo backends (``"eager"``,
``"aot_eager"``, a callable) have no stage backend here and are refused with the alternative.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_pipe.backends.config import BackendArg, BackendPlan, resolve_backends, with_options
from lightning_pipe.base.errors import ConfigurationError

INDUCTOR = "inductor"
log = logging.getLogger("lightning_pipe")


@dataclass(frozen=True)
class TorchCompiled:
    """A ``torch.compile``d module taken apart: the original module and the options for its stages."""

    module: nn.Module  # the original module: what the pipeline splits
    options: dict[str, Any] | None  # torch.compile options for the inductor stage backend; None: Dynamo disabled

    def plan(self, backend: BackendArg | BackendPlan, num_stages: int, strict: bool = False) -> BackendPlan:
        """The stages' backends: inductor with the user's options, or the ``backend=`` given explicitly."""
        if self.options is None:  # torch._dynamo.disable(module): nothing to compile
            return resolve_backends(backend, num_stages, strict)
        plan = resolve_backends(INDUCTOR if backend is None else backend, num_stages, strict)
        return with_options(plan, INDUCTOR, self.options)

    def note(self, backend: BackendArg | BackendPlan) -> str:
        """What happens to the compiled module, for the log."""
        kind = type(self.module).__name__
        if self.options is None:
            return f"the pipelined module is torch._dynamo.disable({kind}): its stages run uncompiled"
        name = f"torch.compile({kind})"
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        if backend is not None and not isinstance(backend, BackendPlan):
            return (
                f"the pipelined module is {name}: the pipeline splits the original module and runs its stages on "
                f"backend={backend!r} as given (inductor stages with the torch.compile options {options})"
            )
        return (
            f"the pipelined module is {name}: the pipeline splits the original module and compiles each stage "
            f"with inductor instead (torch.compile options {options})"
        )


def unwrap_compiled(module: nn.Module) -> TorchCompiled | None:
    """``module`` taken apart if ``torch.compile`` made it, else None; other Dynamo backends raise."""
    try:
        from torch._dynamo.eval_frame import DisableContext, OptimizedModule
    except ImportError:  # a torch without Dynamo has no compiled modules either
        return None
    if not isinstance(module, OptimizedModule):
        return None
    original: nn.Module = module._orig_mod
    context = module.dynamo_ctx
    if isinstance(context, DisableContext):
        return TorchCompiled(original, None)
    compiler = _innermost_backend(context.callback)
    config = getattr(compiler, "config", None)
    if getattr(compiler, "compiler_name", None) != INDUCTOR or not isinstance(config, dict):
        used = getattr(compiler, "compiler_name", None) or getattr(compiler, "__name__", type(compiler).__name__)
        raise ConfigurationError(
            f"the pipelined module is torch.compile({type(original).__name__}, backend={used!r}); a pipeline "
            "compiles each stage itself and has no stage backend for that Dynamo backend: drop torch.compile and "
            "pass PipeStrategy(backend='inductor') (or Pipeline(..., backend='inductor')) to compile the stages, "
            "or backend='eager' to run them uncompiled"
        )
    # torch.compile folded `mode` into the inductor settings it stands for: pass those on as `options`
    options: dict[str, Any] = {"fullgraph": bool(context.fullgraph), "dynamic": getattr(compiler, "dynamic", None)}
    if config:
        options["options"] = dict(config)
    return TorchCompiled(original, options)


def split_compiled(
    module: nn.Module, backend: BackendArg | BackendPlan, num_stages: int, strict: bool = False
) -> tuple[nn.Module, BackendArg | BackendPlan]:
    """The module to split and the stages' backends: for ``torch.compile(m)``, ``m`` and inductor (logged)."""
    compiled = unwrap_compiled(module)
    if compiled is None:
        return module, backend
    log.info("lightning_pipe: %s", compiled.note(backend))
    return compiled.module, compiled.plan(backend, num_stages, strict)


def _innermost_backend(callback: Any) -> Any:
    """The backend torch.compile was given, under Dynamo's wrappers (torch's own helper where it has one)."""
    try:
        from torch._dynamo.eval_frame import innermost_backend

        unwrap: Callable[[Any], Any] = innermost_backend
    except ImportError:  # older torch: the same walk along `_torchdynamo_orig_backend`

        def unwrap(fn: Any) -> Any:
            while hasattr(fn, "_torchdynamo_orig_backend"):
                fn = fn._torchdynamo_orig_backend
            return fn

    return unwrap(callback)
