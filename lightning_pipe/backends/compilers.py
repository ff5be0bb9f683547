"""Stage compilers: how a stage backend runs a shard's forward (eager, inductor).

A compiler is built once per stage and mode. `check` sees the inputs' metadata and a
`StageContext` and returns None to accept or the reason it declines; `build` returns the callable
that runs the forward, built the first time the compiler is chosen.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_pipe.backends.base import BackendUnavailableError, StageContext
from lightning_pipe.backends.ops import OpTable, SubstitutionMode, rewrite_graph
from lightning_pipe.backends.split_compile import compile_split, compile_whole, unsplittable
from lightning_pipe.backends.trace import OpCounter, StageTrace
from lightning_pipe.base.errors import ConfigurationError

log = logging.getLogger("lightning_pipe.backends")


class EagerCompiler:
    """Runs the module as it is; ops of the chain's op maps are substituted by a TorchFunctionMode."""

    always_accepts: ClassVar[bool] = True  # decided once at build time, no per-signature check

    def __init__(
        self, module: nn.Module, table: OpTable, counter: OpCounter, name: str, label: str, options: dict[str, Any]
    ) -> None:
        self.module = module
        self.table = table
        self.counter = counter
        self.name = name  # the backend's name, recorded for ops no op backend took
        self.label = label  # "stage1_train": names compiled code
        self.options = dict(options)
        self.trace = StageTrace(-1)  # the stage's trace (`attach`): compiled graphs, a backward left unsplit
        self.mode = "train"

    def attach(self, trace: StageTrace, mode: str) -> None:
        """Record into ``trace`` under ``mode``; called by the stage's executable once it built this compiler."""
        self.trace, self.mode = trace, mode

    def check(self, inputs: Any, ctx: StageContext) -> str | None:
        """None if this backend can run the stage on inputs with this metadata, else why not."""
        return None

    def build(self) -> Callable[..., Any]:
        if not self.table:
            return self.module
        module, table, counter, name = self.module, self.table, self.counter, self.name

        def run(*args: Any, **kwargs: Any) -> Any:
            with SubstitutionMode(table, counter, name):
                return module(*args, **kwargs)

        return run


class InductorCompiler(EagerCompiler):
    """``torch.compile`` with inductor; op substitutions are rewritten into the traced graph first.

    ``options`` are ``torch.compile``'s (``mode``, ``dynamic``, ``fullgraph``, ``options``): Dynamo takes
    ``dynamic`` and ``fullgraph``; ``mode`` and ``options`` become the inductor settings this backend
    compiles each graph with (torch.compile would hand them to a custom backend as arguments it doesn't take).
    """

    always_accepts = False

    def __init__(
        self, module: nn.Module, table: OpTable, counter: OpCounter, name: str, label: str, options: dict[str, Any]
    ) -> None:
        super().__init__(module, table, counter, name, label, options)
        dynamo = dict(options)
        mode, settings = dynamo.pop("mode", None), dynamo.pop("options", None)
        if mode is not None and settings:
            raise ConfigurationError(
                f"backend {name!r}: give torch.compile either mode={mode!r} or options={settings!r}, not both"
            )
        from torch._inductor import list_mode_options

        self.dynamo_options = dynamo  # for torch.compile: dynamic, fullgraph
        # as torch.compile does: a mode stands for a set of inductor settings (list_mode_options(None) lists all)
        by_mode = list_mode_options(mode, dynamo.get("dynamic")) if mode not in (None, "default") else {}
        self.inductor_config = {**by_mode, **dict(settings or {})}

    def check(self, inputs: Any, ctx: StageContext) -> str | None:
        from torch._dynamo.eval_frame import is_dynamo_supported

        if not is_dynamo_supported():
            return "torch.compile does not support this Python version"
        if ctx.random:
            return (
                "this forward's random draws are routed to the stage's own generators (the stage draws random "
                "numbers, e.g. dropout; or it is the first forward of modules not known to draw nothing, a probe: "
                "if nothing drew, the next forwards compile): compiled code would draw from torch's process-wide "
                "generator instead, and activation recomputation could not replay them"
            )
        if ctx.device.type == "cpu":
            try:
                from torch._inductor.cpp_builder import get_cpp_compiler

                get_cpp_compiler()
            except Exception as exc:
                return f"inductor needs a C++ compiler on CPU ({type(exc).__name__}: {exc}); install g++ or set CXX"
        return None

    def build(self) -> Callable[..., Any]:
        entry = _entry(self.module, f"lightning_pipe_{self.label}")
        backend = self._compile_graph  # one object: Dynamo's cached graphs are kept per backend
        compiled = torch.compile(entry, backend=backend, **self.dynamo_options)
        # a backward splits when the stage is one graph: try that first; a graph break leaves it whole
        whole = self.dynamo_options.get("fullgraph") or self.unsplit is not None
        one_graph = (
            compiled if whole else torch.compile(entry, backend=backend, **{**self.dynamo_options, "fullgraph": True})
        )

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                if self.unsplit is None and torch.is_grad_enabled() and one_graph is not compiled:
                    try:
                        return one_graph(*args, **kwargs)
                    except torch._dynamo.exc.Unsupported as exc:
                        self._not_split(f"Dynamo breaks its graph ({str(exc).strip().splitlines()[0]})")
                return compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                raise BackendUnavailableError(f"inductor failed to compile: {exc}") from exc

        return run

    @property
    def unsplit(self) -> str | None:
        """Why this stage's compiled backward is not split into ``I`` and ``W`` (None: it is, or none compiled)."""
        return self.trace.unsplit.get(self.mode)

    def _not_split(self, reason: str) -> None:
        """Say once per stage and mode that the backward runs whole, and why."""
        if self.unsplit is None:
            self.trace.unsplit[self.mode] = reason
            log.warning(
                "stage %d (%s): its compiled backward is not split into input and weight gradients: %s; "
                "in schedules that split backwards (zero-bubble, zbv, dualpipev, interleaved-zero-bubble) "
                "its I action runs the whole backward and its W nothing",
                self.trace.stage,
                self.mode,
                reason,
            )

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The Dynamo backend: substitute ops in the graph, hand it to inductor, count ops per call."""
        per_call = rewrite_graph(gm, self.table, self.name) if self.table else OpCounter()
        graphs = self.trace.graphs.setdefault(self.mode, {})
        grads = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
        reason = unsplittable(gm) if grads else None
        if reason is not None:
            self._not_split(reason)
        if grads and self.unsplit is None:
            compiled = compile_split(gm, example_inputs, dict(self.inductor_config), graphs)
        else:
            compiled = compile_whole(gm, example_inputs, dict(self.inductor_config), graphs)
        if not per_call.counts:
            return compiled
        counter = self.counter

        def run(*args: Any) -> Any:
            counter.merge(per_call)
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run


def _entry(module: nn.Module, name: str) -> Callable[..., Any]:
    """``module(*args)`` as a function with a code object of its own.

    Dynamo keeps its compiled variants (and its recompile limit of 8) per code object; every
    stage would otherwise share ``nn.Module.__call__``'s and run out after a few stages and modes.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    code = call.__code__.replace(co_name=name)
    return types.FunctionType(code, call.__globals__, name, call.__defaults__, call.__closure__)
