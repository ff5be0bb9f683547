"""`StageExecutable`: a shard's forward in one mode, run by the first backend of its chain that accepts.

The stage worker hands it to the executor modules in place of the shard's module, so a user's
executor modules run on backends unchanged. Stage checkers run the first time an input signature
(shapes, dtypes, devices, grad mode, train flag, random draws routed) is seen; the choice is cached per signature.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lightning_pipe.backends.base import BackendError, BackendUnavailableError, StageContext
from lightning_pipe.backends.compilers import EagerCompiler
from lightning_pipe.backends.config import MODES, BackendPlan, StageChain, resolve_backends
from lightning_pipe.backends.meta import metas_of, signature
from lightning_pipe.backends.ops import OpTable, SubstitutionMode
from lightning_pipe.backends.trace import StageTrace
from lightning_pipe.rng import routing_active

log = logging.getLogger("lightning_pipe.backends")
# a new signature may compile; stage threads compile one at a time (Dynamo and 2-core machines like that better)
_COMPILE_LOCK = threading.Lock()


class StageExecutable(nn.Module):
    """Runs ``module`` through the backends of ``chain`` for one stage in one mode ("train"/"eval")."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        mode: str,
        chain: StageChain,
        trace: StageTrace,
        device: torch.device,
        strict: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.stage, self.mode, self.chain, self.trace = stage, mode, chain, trace
        self.device, self.strict = device, strict
        self.table = OpTable(chain.backends)
        self._compilers: dict[int, EagerCompiler] = {}
        self._runners: dict[int, Callable[..., Any]] = {}
        self._decisions: dict[Hashable, int] = {}
        first = next(i for i, b in enumerate(chain.backends) if b.runs_stages)
        self._static = first if getattr(chain.backends[first].compiler, "always_accepts", False) else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._static is not None:
            return self._run(self._static, args, kwargs)
        key = (
            signature(args),
            signature(kwargs),
            torch.is_grad_enabled(),
            self.module.training,
            torch.is_autocast_enabled(self.device.type),
            routing_active(),
        )
        start = 0
        position = self._decisions.get(key)
        if position is not None:
            try:
                return self._run(position, args, kwargs)
            except BackendUnavailableError as exc:  # e.g. an engine rebuilt for new weights failed to compile
                del self._decisions[key]
                self._decline(position, str(exc))
                start = position + 1
        with _COMPILE_LOCK:
            while True:
                position = self._choose(args, kwargs, start)
                try:
                    output = self._run(position, args, kwargs)
                except BackendUnavailableError as exc:
                    self._decline(position, str(exc))
                    start = position + 1
                    continue
                self._decisions[key] = position
                return output

    @property
    def backend_names(self) -> list[str]:
        return self.chain.names

    def _choose(self, args: Any, kwargs: Any, start: int) -> int:
        """Position in the chain of the first stage backend from ``start`` on whose checker accepts."""
        inputs = metas_of((args, kwargs) if kwargs else args)
        ctx = StageContext(
            self.stage,
            self.mode,
            self.device,
            torch.is_grad_enabled(),
            self.module.training,
            sum(1 for p in self.module.parameters() if p.requires_grad),
            routing_active(),
        )
        for position in range(start, len(self.chain.backends)):
            backend = self.chain.backends[position]
            if not backend.runs_stages:
                continue
            try:
                reason = self._compiler(position).check(inputs, ctx)
            except Exception as exc:
                raise BackendError(
                    f"the checker of backend {backend.name!r} raised for stage {self.stage} ({self.mode}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if reason is None:
                return position
            self._decline(position, reason)
        raise BackendError(  # eager ends every chain built by resolve_backends; a hand-made chain may lack it
            f"no backend of {self.chain.names} can run stage {self.stage} ({self.mode}); add 'eager' to the chain"
        )

    def _decline(self, position: int, reason: str) -> None:
        name = self.chain.backends[position].name
        if self.strict and name in self.chain.requested:
            raise BackendError(
                f"backend {name!r} cannot run stage {self.stage} ({self.mode}): {reason}; "
                "pass strict=False to fall back to the next backend instead"
            )
        if (self.mode, name) not in self.trace.declined:
            later = [b.name for b in self.chain.backends[position + 1 :] if b.runs_stages]
            log.warning(
                "stage %d (%s): backend %r declined: %s; trying %s",
                self.stage,
                self.mode,
                name,
                reason,
                later[0] if later else "nothing else",
            )
        self.trace.declined[(self.mode, name)] = reason

    def _compiler(self, position: int) -> EagerCompiler:
        compiler = self._compilers.get(position)
        if compiler is None:
            backend = self.chain.backends[position]
            assert backend.compiler is not None
            counter = self.trace.op_counter(self.mode)
            label = f"stage{self.stage}_{self.mode}"
            compiler = self._compilers[position] = backend.compiler(
                self.module, self.table, counter, backend.name, label, backend.options
            )
            compiler.attach(self.trace, self.mode)
        return compiler

    def _run(self, position: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runner = self._runners.get(position)
        if runner is None:
            runner = self._runners[position] = self._compiler(position).build()
        output = runner(*args, **kwargs)
        self.trace.count_run(self.mode, self.chain.backends[position].name)
        return output


def build_executables(
    shards: Iterable[Any], plan: BackendPlan | None, devices: Mapping[int, torch.device]
) -> tuple[dict[tuple[int, str], StageExecutable], dict[int, StageTrace]]:
    """For each shard (``.index``, ``.module``) and mode its `StageExecutable`, and each stage's trace."""
    shards = list(shards)
    if plan is None:
        plan = resolve_backends(None, max(s.index for s in shards) + 1)
    traces = {shard.index: StageTrace(shard.index) for shard in shards}
    for shard in shards:
        _note_compiled_submodules(shard.module, traces[shard.index])
    executables = {
        (shard.index, mode): StageExecutable(
            shard.module,
            shard.index,
            mode,
            plan.chain(shard.index, mode),
            traces[shard.index],
            devices[shard.index],
            plan.strict,
        )
        for shard in shards
        for mode in MODES
    }
    return executables, traces


def _note_compiled_submodules(module: nn.Module, trace: StageTrace) -> None:
    """Say once, at build time, that a stage holding ``torch.compile``d submodules cannot split its backward."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return
    names = [name for name, m in module.named_modules() if isinstance(m, OptimizedModule)]
    if not names:
        return
    trace.unsplit["train"] = (
        f"it holds torch.compile'd submodules ({', '.join(names)}) whose compiled backward is one graph; "
        "pass backend='inductor' (and drop torch.compile on them) to compile the stage with a split backward"
    )
    log.warning(
        "stage %d: its backward is not split into input and weight gradients: %s; in schedules that split "
        "backwards its I action runs the whole backward and its W nothing",
        trace.stage,
        trace.unsplit["train"],
    )


COORDINATOR = "coordinator"  # the trace's mode for ops the coordinator ran (the loss, the user's step code)


class CoordinatorOps:
    """Op substitution for the code the coordinator runs around the pipeline: the loss and the user's step.

    It uses the last stage's op maps (the loss belongs to the last stage) and counts into a trace of
    that stage under the mode ``"coordinator"``. TorchFunctionModes are per thread: enter `context`
    in the thread that runs the code.
    """

    def __init__(self, plan: BackendPlan, last_stage: int) -> None:
        self.trace = StageTrace(last_stage)
        self._tables = {mode: OpTable(plan.chain(last_stage, mode).backends) for mode in MODES}

    def context(self, mode: str) -> AbstractContextManager[object]:
        table = self._tables[mode]
        if not table:
            return contextlib.nullcontext()
        return SubstitutionMode(table, self.trace.op_counter(COORDINATOR), "eager")
