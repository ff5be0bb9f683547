"""Building the pipeline of `PipeStrategy`, and its memory plan.

The pipeline is built once per fit (validate, test, predict): at setup for an ``nn.Sequential`` or a
module with ``example_input_array``, else on the first call of the pipelined module, which a traced
partitioner needs. In launched mode its transport is this replica's point-to-point communicator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_pipe.backends import BackendArg, CoordinatorOps, ExecutionTrace
from lightning_pipe.backends.compiled import TorchCompiled, unwrap_compiled
from lightning_pipe.engine import AutocastSpec
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.partition import Partitioner
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.rng import run_seed
from lightning_pipe.runtime import BaseRuntime
from lightning_pipe.strategy.remote import StageParameters

if TYPE_CHECKING:
    from lightning_pipe.strategy.launched import LaunchedMode as _Strategy
else:
    _Strategy = object

_RUNTIME_HOOKS = (
    "train_epoch_begin",
    "train_pre_step",
    "train_post_step",
    "train_validation_begin",
    "eval_pre_step",
    "eval_post_step",
)


class PipelineBuilding(_Strategy):
    """Mixed into `PipeStrategy`: makes its `Pipeline`, reports what ran where, plans memory."""

    pipeline: Pipeline | None
    partitioner: Any
    schedule: Any
    checkpoint: str
    runtime: Any
    backend: BackendArg
    strict: bool
    microbatches: int
    _pipelined: nn.Module | None
    _compiled: TorchCompiled | None
    _stage_params: StageParameters | None
    _transport_options: dict[str, Any]
    _trace: ExecutionTrace
    _coordinator_ops: CoordinatorOps | None
    _hooked: set[str]

    if TYPE_CHECKING:

        def resolve_devices(self) -> list[str]: ...
        def _split_module(self) -> nn.Module: ...
        def restore_random_state(self, pipeline: Pipeline) -> None: ...
        def _find_pipelined(self, lightning_module: pl.LightningModule) -> nn.Module: ...
        def _capture_input(self, lightning_module: pl.LightningModule, pipelined: nn.Module, batch: Any) -> Any: ...

    def _build(self, sample: Any) -> Pipeline:
        if self.pipeline is not None:
            return self.pipeline
        assert self._pipelined is not None
        devices = self.resolve_devices()
        compiled = self._compiled
        backend = compiled.plan(self.backend, len(devices), self.strict) if compiled is not None else self.backend
        self.pipeline = Pipeline(
            self._split_module(),
            stages=len(devices),
            schedule=self.schedule,
            partition=self.partitioner,
            devices=devices,
            checkpoint=self.checkpoint,
            runtime=self.runtime,
            timeout=self.timeout,
            autocast=self._autocast(),
            sample=sample,
            coordinator_device=self.root_device,
            virtual_stages=self.virtual_stages,
            runner=self.runner,
            backend=backend,
            strict=self.strict,
            transport=self.launched_communicator() if self.layout is not None else self.transport or "local",
            seed=run_seed(),  # seed_everything's seed: each stage's generators start from it and the stage index
            **self._transport_options,
        ).start()
        self.restore_random_state(self.pipeline)
        if self._stage_params is not None and self.optimizers:
            self._stage_params.attach(self.pipeline, self.optimizers, self.root_device)
        self._hooked = {
            name
            for name in _RUNTIME_HOOKS
            if any(getattr(type(rt), name) is not getattr(BaseRuntime, name) for rt in self.pipeline.runtimes)
        }
        return self.pipeline

    def _autocast(self) -> AutocastSpec | None:
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision):
            return AutocastSpec(torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16)
        return None

    def execution_trace(self) -> ExecutionTrace:
        """Per stage: which backend ran its forwards and which substituted ops ran where (``print`` it).

        Ops of the user's step code (the loss) count under the last stage, mode ``"coordinator"``.
        """
        trace = self._trace
        if self.pipeline is not None:
            trace = trace.merged(self.pipeline.execution_trace())
        if self._coordinator_ops is not None:
            trace = trace.merged(ExecutionTrace([self._coordinator_ops.trace]))
        return trace

    # the memory plan
    def plan(self, model: nn.Module, sample_batch: Any, verbose: bool = True) -> Any:
        """Predict each stage's activation memory for one training step, before training.

        ``model`` is the LightningModule (its ``training_step`` runs on ``sample_batch`` up to the
        pipelined call, to find the pipeline's input) or the pipelined module itself (then
        ``sample_batch`` is its input). Prints the per-stage table unless ``verbose=False``; returns a
        `lightning_pipe.memory.MemoryPlan`. ``checkpoint="auto"`` is planned without recomputation: the
        plan it starts from (it recomputes where a device's free memory is short of it).
        """
        from lightning_pipe.memory import plan as memory_plan

        if isinstance(model, pl.LightningModule):
            called = self._find_pipelined(model)
            sample = self._capture_input(model, called, sample_batch)
        else:
            called, sample = model, sample_batch
        compiled = unwrap_compiled(called)
        pipelined = compiled.module if compiled is not None else called
        if not isinstance(self.partitioner, Partitioner) or isinstance(self.partitioner, TracedPartitioner):
            raise ConfigurationError("plan() covers nn.Sequential pipelines; traced models are not planned yet")
        return memory_plan(
            pipelined,
            sample,
            len(self.resolve_devices()),
            self.microbatches,
            self.schedule,
            self.virtual_stages,
            self.partitioner,
            self.checkpoint,
            self.runner,
            verbose,
        )
