"""`PipeStrategy`: pipeline-parallel training, validation, testing and prediction in Lightning."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_pipe.backends import BackendArg, CoordinatorOps, ExecutionTrace, resolve_backends
from lightning_pipe.backends.compiled import TorchCompiled, unwrap_compiled
from lightning_pipe.engine.versions import Staleness
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.grads import GradStash
from lightning_pipe.microbatch_weights import MicrobatchWeight
from lightning_pipe.partition import Partitioner
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.pipeline import Pipeline, resolve_partitioner
from lightning_pipe.runtime import BaseRuntime, runtime_registry
from lightning_pipe.strategy.arguments import check_arguments
from lightning_pipe.strategy.asynchronous import AsyncTraining
from lightning_pipe.strategy.building import PipelineBuilding
from lightning_pipe.strategy.hooks import RuntimeHooks
from lightning_pipe.strategy.interrupts import CtrlC
from lightning_pipe.strategy.launched import LaunchedMode
from lightning_pipe.strategy.layout import LOCAL
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.patch import Patches
from lightning_pipe.strategy.random_state import StageRandomState
from lightning_pipe.strategy.remote import StageGradZeroing, StageParameters
from lightning_pipe.strategy.session import DriverThreads
from lightning_pipe.strategy.steps import PipelinedSteps
from lightning_pipe.strategy.trace import PipeTrace


class PipeStrategy(
    PipelinedSteps, StageRandomState, StageOptimization, PipelineBuilding, LaunchedMode, ParallelStrategy
):
    """Splits the LightningModule's pipelined module into stages and runs each step as a pipeline.

    Args:
        stages: number of stages; default: one per device.
        microbatches: how many pieces each batch is cut into (along dimension 0).
        schedule: ``"gpipe"`` (all forwards, then losses, then backwards), ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"zero-bubble"``, ``"async"`` (no flush between batches, each stage
            steps its own copy of the ``configure_optimizers`` optimizer with weight stashing; transport
            ``"local"``; `staleness` reports what it measured), a `Schedule` subclass or a function
            returning per-rank action lists (see docs/schedules.md).
        partition: ``"uniform"``, ``"params"``, ``"memory"``, ``"time"``, layer counts such as
            ``[3, 5]``, or a `Partitioner`.
        module: attribute path of the pipelined module in the LightningModule; default: the child
            with the most parameters.
        devices: one device per stage; default: the Trainer's devices, or ``cpu`` for every stage.
        checkpoint: activation recomputation: ``"auto"`` (only the stages whose device lacks the memory for the
            planned activation peak; never on cpu; decided before the second training step of a fit and logged),
            ``"always"``, ``"except_last"`` or ``"never"``.
        runtime: a registered device type or a `BaseRuntime` instance; default: by device type.
        timeout: seconds any wait between the coordinator and the stages may take.
        backend: how stage forwards run: ``"eager"``, ``"inductor"``, ``"tensorrt"`` or a registered
            backend; a list gives one per stage, a tuple a fallback chain, a dict one per mode
            (``{"train": "inductor", "eval": "tensorrt"}``). See `lightning_pipe.backends`.
        strict: raise instead of falling back (with a logged reason) when a requested backend
            cannot run a stage.
        split_points: names of submodules before which a new stage starts (``["blocks.2"]``). A
            pipelined module that is not an ``nn.Sequential`` is traced on its first call and cut
            there, or where ``partition`` balances it; its forward may take several positional and
            keyword arguments and return a tensor, tuple or dict. Without ``stages``, one stage more
            than split points.
        transport: ``None`` (the default): launched mode when the Trainer runs more than one process
            (``devices x num_nodes > 1`` or a launcher's ``WORLD_SIZE > 1``: R pipeline replicas of the stages,
            one process per stage and device, activations point to point over torch.distributed, gradients
            averaged over the replicas; see `lightning_pipe.strategy.layout`), else ``"local"``.
            ``"local"``: stages are threads of this process, on the Trainer's devices. ``"rpc"``: stage
            worker processes (one per stage on this machine, or ``lightning-pipe worker`` processes that join
            ``coordinator``); see `lightning_pipe.comm.rpc`. ``"p2p"``: launched mode in any case.
        coordinator: with ``transport="rpc"``, ``"HOST:PORT"`` where workers on other machines join.
        token: with ``transport="rpc"``, the secret workers must present (default ``$LIGHTNING_PIPE_TOKEN``).
        compress: with ``transport="rpc"``, how activations and gradients cross between processes:
            ``None``, ``"bf16"`` / ``"fp16"`` (lossy casts), ``"zstd"`` (lossless, extra ``compress``),
            ``"bf16+zstd"``, ``"fp16+zstd"`` or a codec object (`lightning_pipe.comm.compress.Codec`).
        virtual_stages: stages per worker (``interleaved-1f1b``): stage ``s`` runs on worker
            ``s % (stages // virtual_stages)``.
        runner: ``"parallel"`` (a thread per worker, fixed order), ``"dataflow"`` (each worker runs
            whichever action is ready) or ``"linear"`` (one thread walks one global order).
        trace: a path for the Chrome trace (pipeline timeline) of training steps 1-3, or a `PipeTrace`
            (chosen steps, a PNG Gantt chart).
        microbatch_weight: a function of a microbatch (what the step receives) returning its weight, a
            number or 0-d tensor; default: its rows. Losses, ``self.log`` values and the step's returned
            values combine with the weights normalised over the batch: return what the loss averages
            over, e.g. ``lambda b: (b["labels"][:, 1:] != -100).sum()`` for a causal LM's labelled tokens.
            A microbatch of weight 0 adds nothing, not even its loss's gradient.
    """

    strategy_name = "pipe"

    def __init__(
        self,
        stages: int | None = None,
        microbatches: int = 4,
        schedule: Any = "1f1b",
        partition: str | Sequence[int] | Partitioner = "params",
        module: str | None = None,
        devices: Sequence[str | torch.device] | None = None,
        checkpoint: str = "auto",
        runtime: str | BaseRuntime | None = None,
        timeout: float = 300.0,
        backend: BackendArg = None,
        strict: bool = False,
        transport: str | None = None,
        coordinator: str | None = None,
        token: str | None = None,
        compress: Any = None,
        split_points: Sequence[str] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        virtual_stages: int = 1,
        runner: str = "parallel",
        trace: str | os.PathLike[str] | PipeTrace | None = None,
        microbatch_weight: MicrobatchWeight | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        stages, device_names, asynchronous, options = check_arguments(
            stages, microbatches, schedule, devices, checkpoint, runtime, timeout, backend, strict, transport,
            coordinator, token, split_points, virtual_stages, runner, microbatch_weight, compress,
        )  # fmt: skip
        self.stages = stages
        self.microbatches = microbatches
        self.microbatch_weight = microbatch_weight
        self.schedule = schedule
        self.partitioner = resolve_partitioner(partition, split_points=split_points)
        self.module_name = module
        self.stage_devices: list[str] | None = device_names
        self.checkpoint = checkpoint
        self.runtime = runtime
        self.timeout = float(timeout)
        self.virtual_stages = virtual_stages
        self.runner = runner
        self.pipe_trace = trace if isinstance(trace, PipeTrace) or trace is None else PipeTrace(trace)
        self.backend = backend
        self.strict = strict
        self.transport = transport
        self._transport_options = options
        #: with stages that own their parameters (not "local"): Lightning's optimizers, stepped on the stages
        self._stage_params: StageParameters | None = None
        #: schedule="async": stage optimizers, the open stream, the measured staleness
        self._async = AsyncTraining() if asynchronous else None
        self._trace = ExecutionTrace([])  # the traces of pipelines already closed
        self._coordinator_ops: CoordinatorOps | None = None  # op substitution in the user's step code
        self.pipeline: Pipeline | None = None
        self._pipelined: nn.Module | None = None
        self._compiled: TorchCompiled | None = None  # the pipelined module is torch.compile(...) of this
        self._patches = Patches()  # attributes set on the user's objects for this fit, restored exactly
        self.driver_threads = DriverThreads()
        self._outside = GradStash()  # parameters outside the pipelined module (before/after the call)
        self._hooked: set[str] = set()
        self._seen_batch = False
        self._released = True  # launched mode: the serving ranks were told that this fit ended
        self._ctrl_c = CtrlC()  # Ctrl-C works again after a fit it stopped
        #: the last step's `StepResult` (per-rank action timings, the schedule), kept after teardown
        self.last_step: Any = None

    # devices
    def resolve_devices(self) -> list[str]:
        """One device per stage, from ``devices``, the Trainer's devices or cpu."""
        if self.stage_devices is not None:
            return self.stage_devices
        if self.layout is not None:  # launched mode: a stage per process of this replica's pipeline
            return self.launched_stage_devices(self.layout.ranks_per_pipeline * self.virtual_stages)
        trainer_devices = [str(d) for d in (self.parallel_devices or [torch.device("cpu")])]
        if all(d == "cpu" for d in trainer_devices):
            return ["cpu"] * (self.stages or len(trainer_devices))
        stages = self.stages or len(trainer_devices)
        if stages > len(trainer_devices):
            raise ConfigurationError(
                f"stages={stages} but the Trainer has {len(trainer_devices)} devices ({', '.join(trainer_devices)}); "
                "pass devices=[...] with one device per stage (stages may share a device)"
            )
        return trainer_devices[:stages]

    @property
    @override
    def root_device(self) -> torch.device:
        """The coordinator's device: where the last stage's output and the loss live (launched: this process's)."""
        if self.layout is not None:
            return self.launched_root_device
        devices = self.resolve_devices()
        if isinstance(self.runtime, BaseRuntime):
            return self.runtime.torch_device
        return runtime_registry.create(devices[-1]).torch_device

    # setup and teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._ctrl_c.remember()
        self._trainer = trainer
        self._released = False
        if self.mode != LOCAL and self._stage_params is None:
            self._stage_params = StageParameters()  # the stages own their parameters
        lightning_module = self.lightning_module
        assert lightning_module is not None
        if not lightning_module.automatic_optimization:
            raise ConfigurationError(
                "PipeStrategy runs the backward inside the pipeline and supports automatic optimization only; "
                "set self.automatic_optimization = True"
            )
        self._pipelined = self._find_pipelined(lightning_module)
        self._compiled = unwrap_compiled(self._pipelined)
        if self._compiled is not None:
            rank_zero_info(f"PipeStrategy: {self._compiled.note(self.backend)}")
        self.partitioner = resolve_partitioner(self.partitioner, self._split_module())
        devices = self.resolve_devices()
        self.partitioner.check(self._split_module(), len(devices))
        self._coordinator_ops = CoordinatorOps(resolve_backends(self.backend, len(devices)), len(devices) - 1)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self._async is not None:
                if trainer.accumulate_grad_batches != 1 or getattr(self.precision_plugin, "scaler", None):
                    raise ConfigurationError(
                        "PipeStrategy(schedule='async') steps each stage once per batch in full precision; "
                        "use accumulate_grad_batches=1 and no gradient scaler"
                    )
                self._async.attach(self.optimizers, list(self._pipelined.parameters()))
        self.setup_precision_plugin()
        stage_ids = {id(p) for p in self._pipelined.parameters()}
        self._outside = GradStash(p for p in lightning_module.parameters() if id(p) not in stage_ids)
        self._install(trainer)
        sample = getattr(lightning_module, "example_input_array", None)
        traced = isinstance(self.partitioner, TracedPartitioner)  # traced on its first call, as it is called
        if not self.partitioner.needs_sample or (sample is not None and not traced):
            self._build(sample)

    def _find_pipelined(self, lightning_module: pl.LightningModule) -> nn.Module:
        children = dict(lightning_module.named_children())
        if self.module_name is not None:
            try:
                return lightning_module.get_submodule(self.module_name)
            except AttributeError:
                known = ", ".join(children) or "none"
                raise ConfigurationError(
                    f"PipeStrategy(module={self.module_name!r}): the LightningModule has no such submodule; "
                    f"its children are: {known}"
                ) from None
        if not children:
            raise ConfigurationError(
                "the LightningModule has no submodules to pipeline; assign an nn.Sequential to an attribute "
                "(e.g. self.model = nn.Sequential(...)) and pass PipeStrategy(module='model')"
            )
        return max(children.values(), key=lambda m: sum(p.numel() for p in m.parameters()))

    def _split_module(self) -> nn.Module:
        """What the pipeline splits: the pipelined module, or the original of a ``torch.compile``d one."""
        assert self._pipelined is not None
        return self._compiled.module if self._compiled is not None else self._pipelined

    @override
    def model_to_device(self) -> None:
        """Everything but the pipelined module goes to the coordinator's device; stages place their shards."""
        assert self.model is not None and self._pipelined is not None
        device = self.root_device
        pipelined = self._pipelined
        for module in self.model.modules():
            if module is pipelined or any(module is m for m in pipelined.modules()):
                continue
            for param in module.parameters(recurse=False):
                if param.device != device:
                    param.data = param.data.to(device)
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.device != device:
                    module._buffers[name] = buf.to(device)

    def _install(self, trainer: pl.Trainer) -> None:
        assert self._pipelined is not None
        self._patches.set(self._pipelined, "forward", self._pipelined_forward)
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(cb, RuntimeHooks) and cb.strategy is self for cb in callbacks):
            callbacks.append(RuntimeHooks(self))
        if self._stage_params is not None:
            if not any(isinstance(cb, StageGradZeroing) and cb.parameters is self._stage_params for cb in callbacks):
                callbacks.append(StageGradZeroing(self._stage_params))
            StageParameters.patch_clipping(self.precision_plugin)
        if self.pipe_trace is not None and not any(cb is self.pipe_trace for cb in callbacks):
            callbacks.append(self.pipe_trace)

    @override
    def teardown(self) -> None:
        try:
            self._trace = self.execution_trace()  # kept after this fit/validate/test/predict
            self._end_stream()
            self.keep_random_state()
        finally:
            self._coordinator_ops = None
            self._shutdown()
        super().teardown()
        self._ctrl_c.restore()

    def _shutdown(self, error: BaseException | None = None) -> None:
        try:
            self._end_stream()
            if self._stage_params is not None and self._stage_params.views and self.pipeline is not None:
                self.pipeline.sync_module()  # the LightningModule and its optimizer end up trained, as usual
                self._stage_params.fold_into_templates()
        finally:  # whatever failed above: the user's objects as they were, the stages stopped
            self._patches.restore()
            self.driver_threads.close()
            try:
                if self.pipeline is not None:
                    pipeline, self.pipeline = self.pipeline, None
                    pipeline.close()
            finally:
                if self.layout is not None and self.layout.coordinates and not self._released:
                    self._released = True  # the serving ranks return from this fit (raise, after an error)
                    self.release_stages(error)
            self._seen_batch = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._stage_params is not None:
            self._stage_params.views = {}  # stages may be gone: nothing to gather
        if self._async is not None and self._async.stream is not None:
            self._async.stream.abort()  # stages may be gone: nothing to drain
            self._async.stream = None
        self._shutdown(exception)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        return super().batch_to_device(batch, device or self.root_device, dataloader_idx)

    # steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("training_step", args, kwargs, self.precision_plugin.train_step_context)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("validation_step", args, kwargs, self.precision_plugin.val_step_context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("test_step", args, kwargs, self.precision_plugin.test_step_context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("predict_step", args, kwargs, self.precision_plugin.predict_step_context)

    def staleness(self) -> list[Staleness]:
        """schedule="async": per stage, the staleness its microbatches saw over this strategy's fits."""
        if self._async is None:
            raise ConfigurationError(f"staleness is measured with schedule='async', not {self.schedule!r}")
        return self._async.staleness()

    # runtime hooks
    def runtime_hook(self, name: str, *args: Any) -> None:
        """Call ``runtime.<name>`` on every stage (skipped when no stage's runtime overrides it)."""
        if self._async is not None and self._async.stream is not None:
            return  # a stream owns the stages until it drains
        if self.pipeline is not None and name in self._hooked:
            self.pipeline.coordinator.call("runtime_hook", name, args)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Pipeline parallelism across stages (lightning_pipe)"
            )
