"""`PipelineBuilder`: finding the pipelined module, building and placing the `Pipeline`, and what it reports.

The pipeline is built once per fit (validate, test, predict): at setup for an ``nn.Sequential`` or a
module with ``example_input_array``, else on the first call of the pipelined module, which a traced
partitioner needs. In launched mode its transport is this replica's point-to-point communicator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pipe.backends import CoordinatorOps, ExecutionTrace, resolve_backends
from lightning_pipe.backends.compiled import TorchCompiled, unwrap_compiled
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.base.microbatch import batch_size
from lightning_pipe.comm import Communicator
from lightning_pipe.engine import AutocastSpec, StageProtocol
from lightning_pipe.partition import Partitioner
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.partition.tracer import CallArgs
from lightning_pipe.pipeline.pipeline import Pipeline, resolve_partitioner
from lightning_pipe.pipeline.schedule_chooser import AUTO, first_microbatches
from lightning_pipe.rng import run_seed
from lightning_pipe.runtime import BaseRuntime, runtime_registry
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.schedule_selection import ScheduleSelection
from lightning_pipe.strategy.session import capture_call
from lightning_pipe.weights import StageInit

_RUNTIME_HOOKS = (
    "train_epoch_begin",
    "train_pre_step",
    "train_post_step",
    "train_validation_begin",
    "eval_pre_step",
    "eval_post_step",
)


@dataclass
class Destination:
    """Where one fit's pipeline goes, as the strategy knows it at setup."""

    devices: list[str]  # one per stage
    coordinator_device: torch.device  # where the last stage's output and the loss live
    autocast: AutocastSpec | None  # the precision plugin's, applied in every stage
    transport: Callable[[], str | Communicator]  # a transport name, or launched mode's p2p communicator
    on_built: Callable[[Pipeline], None]  # the stages exist: random states and stage optimizers go in
    init: StageInit | None = None  # how the stages make their tensors (a checkpoint, the weights, the seed)


def prefix_of(lightning_module: nn.Module, pipelined: nn.Module) -> str:
    """``pipelined``'s path in the LightningModule, with a dot: its keys in a Lightning checkpoint."""
    for name, module in lightning_module.named_modules():
        if module is pipelined:
            return f"{name}." if name else ""
    raise ConfigurationError("the pipelined module is not part of the LightningModule")


def autocast_of(plugin: Precision) -> AutocastSpec | None:
    """The autocast every stage applies: the precision plugin's, for ``"16-mixed"`` and ``"bf16-mixed"``."""
    if isinstance(plugin, MixedPrecision):
        return AutocastSpec(torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16)
    return None


class PipelineBuilder:
    """Makes the `Pipeline` of a fit from the LightningModule's pipelined module, and closes it.

    Owns the partitioner, the pipelined module found in the LightningModule, the backends' op substitution
    in the user's step code, the pipeline while it lives and the execution traces of pipelines closed.
    `PipeStrategy` calls `setup`, `build_early` and `close`; the step driver calls `build` with a step's
    first input and `pipeline_input` for each call of the pipelined module.
    """

    def __init__(self, config: PipeConfig, agree: Callable[[Any], Any] | None = None) -> None:
        self.config = config  # the strategy's arguments: what the pipeline is built with
        self.partitioner = resolve_partitioner(config.partition, split_points=config.split_points)
        self.selection = ScheduleSelection(config, agree)  # the schedule the fits run, and auto's choice
        self.seed: int | None = None  # the run's seed, decided once per fit by the strategy (None: `run_seed`)
        self.checkpoint = config.checkpoint
        self.pipeline: Pipeline | None = None
        self.pipelined: nn.Module | None = None  # the LightningModule's submodule that is pipelined
        self.compiled: TorchCompiled | None = None  # the pipelined module is torch.compile(...) of this
        self.coordinator_ops: CoordinatorOps | None = None  # op substitution in the user's step code
        self.runtime_hooks: set[str] = set()  # the runtime callbacks some stage's runtime overrides
        self._destination: Destination | None = None
        self._closed = ExecutionTrace([])  # the traces of pipelines already closed

    def chosen(self) -> dict[str, Any] | None:
        """``schedule="auto"``'s choice as a checkpoint keeps it (`ScheduleSelection.chosen`, of this pipeline)."""
        return self.selection.chosen(self.pipeline)

    def find(self, lightning_module: pl.LightningModule) -> nn.Module:
        """The pipelined module: ``module=``, or the child with the most parameters."""
        children = dict(lightning_module.named_children())
        if self.config.module is not None:
            try:
                return lightning_module.get_submodule(self.config.module)
            except AttributeError:
                known = ", ".join(children) or "none"
                raise ConfigurationError(
                    f"PipeStrategy(module={self.config.module!r}): the LightningModule has no such submodule; "
                    f"its children are: {known}"
                ) from None
        if not children:
            raise ConfigurationError(
                "the LightningModule has no submodules to pipeline; assign an nn.Sequential to an attribute "
                "(e.g. self.model = nn.Sequential(...)) and pass PipeStrategy(module='model')"
            )
        return max(children.values(), key=lambda m: sum(p.numel() for p in m.parameters()))

    def setup(self, lightning_module: pl.LightningModule, destination: Destination) -> nn.Module:
        """At the strategy's setup: find the pipelined module, check the partition against the devices."""
        self.pipelined = self.find(lightning_module)
        self.compiled = unwrap_compiled(self.pipelined)
        if self.compiled is not None:
            rank_zero_info(f"PipeStrategy: {self.compiled.note(self.config.backend)}")
        self.partitioner = resolve_partitioner(self.partitioner, self.split_module)
        self.partitioner.check(self.split_module, len(destination.devices))
        stages = len(destination.devices)
        self.coordinator_ops = CoordinatorOps(resolve_backends(self.config.backend, stages), stages - 1)
        self._destination = destination
        return self.pipelined

    def prefix(self, lightning_module: nn.Module) -> str:
        """The pipelined module's path in the LightningModule, with a dot: its keys in a Lightning checkpoint."""
        assert self.pipelined is not None
        return prefix_of(lightning_module, self.pipelined)

    @property
    def split_module(self) -> nn.Module:
        """What the pipeline splits: the pipelined module, or the original of a ``torch.compile``d one."""
        assert self.pipelined is not None, "PipelineBuilder.setup finds the pipelined module first"
        return self.compiled.module if self.compiled is not None else self.pipelined

    @property
    def ranks(self) -> int:
        """The schedule's ranks: the stages over the stages each rank holds."""
        assert self._destination is not None, "PipelineBuilder.setup places the pipeline first"
        return len(self._destination.devices) // self.config.virtual_stages

    def coordinator_device(self, devices: Sequence[str]) -> torch.device:
        """Where the last stage's output and the loss live, with the stages on ``devices`` in this process."""
        if isinstance(self.config.runtime, BaseRuntime):
            return self.config.runtime.torch_device
        return runtime_registry.create(devices[-1]).torch_device

    @staticmethod
    def accelerator_device(
        root: torch.device, trainer_devices: Sequence[torch.device] | None, stage_devices: Sequence[str]
    ) -> torch.device:
        """The device the Trainer's accelerator sets up: the coordinator's, or, where ``devices=`` places stages on
        another kind of device than the accelerator's (``accelerator="cpu"`` with a stage on ``cuda:0``), the first
        stage device of the accelerator's kind (none: the kind itself); the stages set up their own devices."""
        kind = trainer_devices[0].type if trainer_devices else root.type
        if root.type == kind:
            return root
        return next((torch.device(d) for d in stage_devices if torch.device(d).type == kind), torch.device(kind))

    def outside(self, lightning_module: pl.LightningModule) -> list[nn.Parameter]:
        """The LightningModule's parameters outside the pipelined module (used before or after its call)."""
        assert self.pipelined is not None
        stage_ids = {id(p) for p in self.pipelined.parameters()}
        return [p for p in lightning_module.parameters() if id(p) not in stage_ids]

    def outside_tensors(self, lightning_module: pl.LightningModule) -> list[torch.Tensor]:
        """The LightningModule's parameters and buffers outside the pipelined module (the coordinator's own)."""
        assert self.pipelined is not None
        inside = {id(t) for t in [*self.pipelined.parameters(), *self.pipelined.buffers()]}
        return [t for t in [*lightning_module.parameters(), *lightning_module.buffers()] if id(t) not in inside]

    def place_outside(self, model: nn.Module, device: torch.device) -> None:
        """Everything but the pipelined module goes to ``device``; the stages place their shards."""
        pipelined = self.pipelined
        assert pipelined is not None
        for module in model.modules():
            if module is pipelined or any(module is m for m in pipelined.modules()):
                continue
            for param in module.parameters(recurse=False):
                if param.device != device:
                    param.data = param.data.to(device)
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.device != device:
                    module._buffers[name] = buf.to(device)

    def build_early(self, example: Any) -> None:
        """At setup: build now where the partitioner needs no sample, or ``example_input_array`` serves as one
        (a traced module is traced on its first real call instead)."""
        traced = isinstance(self.partitioner, TracedPartitioner)
        if not self.partitioner.needs_sample or (example is not None and not traced):
            self.build(example)

    def build(self, sample: Any) -> Pipeline:
        """The fit's pipeline, built and started on its first call (``sample``: the first stage's input)."""
        if self.pipeline is not None:
            return self.pipeline
        destination = self._destination
        assert destination is not None, "PipelineBuilder.setup places the pipeline first"
        stages = len(destination.devices)
        compiled = self.compiled
        config = self.config
        backend = compiled.plan(config.backend, stages, config.strict) if compiled is not None else config.backend
        settings = dataclasses.replace(  # the config with what this fit resolved: the stages, schedule, partitioner
            config, stages=stages, schedule=self.selection.for_pipeline(), partition=self.partitioner,
            devices=destination.devices, checkpoint=self.checkpoint, backend=backend,
        )  # fmt: skip
        self.pipeline = Pipeline(
            self.split_module,
            settings=settings,
            autocast=destination.autocast,
            sample=sample,
            coordinator_device=destination.coordinator_device,
            transport=destination.transport(),
            seed=run_seed(self.seed),  # the run's seed: each stage's generators start from it and the stage index
            init=destination.init,
        ).start()
        destination.on_built(self.pipeline)
        self.runtime_hooks = {
            name
            for name in _RUNTIME_HOOKS
            if any(getattr(type(rt), name) is not getattr(BaseRuntime, name) for rt in self.pipeline.runtimes)
        }
        return self.pipeline

    def pipeline_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The pipeline's input for one call of the pipelined module with ``args`` and ``kwargs``."""
        if isinstance(self.partitioner, TracedPartitioner):
            return CallArgs(tuple(args), dict(kwargs))  # packed into the first stage's inputs once traced
        if kwargs:
            raise ConfigurationError(
                f"the pipelined nn.Sequential was called with keyword arguments ({', '.join(kwargs)}); "
                "an nn.Sequential takes one input"
            )
        return args[0] if len(args) == 1 else tuple(args)

    def runtime_hook(self, name: str, args: tuple[Any, ...]) -> None:
        """Call ``runtime.<name>`` on every stage (skipped when no stage's runtime overrides it)."""
        if self.pipeline is not None and name in self.runtime_hooks:
            self.pipeline.coordinator.stages.call(StageProtocol.runtime_hook, name, args)

    def execution_trace(self) -> ExecutionTrace:
        """Per stage: which backend ran its forwards and which substituted ops ran where.

        Ops of the user's step code (the loss) count under the last stage, mode ``"coordinator"``.
        """
        trace = self._closed
        if self.pipeline is not None:
            trace = trace.merged(self.pipeline.execution_trace())
        if self.coordinator_ops is not None:
            trace = trace.merged(ExecutionTrace([self.coordinator_ops.trace]))
        return trace

    def keep_trace(self) -> None:
        """At teardown: keep what ran where for `execution_trace` after the fit; the step's ops end."""
        try:
            self._closed = self.execution_trace()
        finally:
            self.coordinator_ops = None

    def close(self) -> None:
        """Stop the stages of this fit's pipeline (a later fit builds a new one)."""
        if self.pipeline is not None:
            pipeline, self.pipeline = self.pipeline, None
            self.selection.closing(pipeline)
            pipeline.close()

    # the memory plan
    def plan(self, model: nn.Module, sample_batch: Any, stages: int, microbatches: int | str, verbose: bool) -> Any:
        """Predict each stage's activation memory for one training step (see `PipeStrategy.plan`); ``schedule="auto"``
        is planned as its first, measured step runs."""
        from lightning_pipe.pipeline.memory_plan import plan as memory_plan

        schedule = self.selection.for_plan()
        if microbatches == AUTO:
            microbatches = first_microbatches(batch_size(sample_batch), stages // self.config.virtual_stages)

        if isinstance(model, pl.LightningModule):
            called = self.find(model)
            sample = self.pipeline_input(*capture_call(model, called, sample_batch, self.config.timeout))
        else:
            called, sample = model, sample_batch
        compiled = unwrap_compiled(called)
        pipelined = compiled.module if compiled is not None else called
        if not isinstance(self.partitioner, Partitioner) or isinstance(self.partitioner, TracedPartitioner):
            raise ConfigurationError("plan() covers nn.Sequential pipelines; traced models are not planned yet")
        return memory_plan(
            pipelined,
            sample,
            stages,
            int(microbatches),
            schedule,
            self.config.virtual_stages,
            self.partitioner,
            self.checkpoint,
            self.config.runner,
            verbose,
        )
