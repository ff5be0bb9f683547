"""`PipeStrategy`: pipeline-parallel training, validation, testing and prediction in Lightning."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_pipe.backends import BackendArg, CoordinatorOps, ExecutionTrace, resolve_backends
from lightning_pipe.backends.compiled import TorchCompiled, unwrap_compiled
from lightning_pipe.engine import AutocastSpec
from lightning_pipe.engine.versions import Staleness
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.grads import GradStash
from lightning_pipe.microbatch_weights import MicrobatchWeight
from lightning_pipe.partition import Partitioner
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.pipeline import Pipeline, resolve_partitioner
from lightning_pipe.rng import run_seed
from lightning_pipe.runtime import BaseRuntime, runtime_registry
from lightning_pipe.strategy.arguments import check_arguments
from lightning_pipe.strategy.asynchronous import AsyncTraining
from lightning_pipe.strategy.hooks import RuntimeHooks
from lightning_pipe.strategy.patch import Patches
from lightning_pipe.strategy.random_state import StageRandomState
from lightning_pipe.strategy.remote import StageGradZeroing, StageParameters
from lightning_pipe.strategy.steps import PipelinedSteps
from lightning_pipe.strategy.trace import PipeTrace

_RUNTIME_HOOKS = (
    "train_epoch_begin",
    "train_pre_step",
    "train_post_step",
    "train_validation_begin",
    "eval_pre_step",
    "eval_post_step",
)


class PipeStrategy(PipelinedSteps, StageRandomState, SingleDeviceStrategy):
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
        transport: ``"local"`` (stages are threads of this process) or ``"rpc"`` (stage worker
            processes: one per stage on this machine, or ``lightning-pipe worker`` processes that
            join ``coordinator``); see `lightning_pipe.comm.rpc`.
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
        transport: str = "local",
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
        super().__init__(
            device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
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
        self._stage_params = StageParameters() if transport != "local" else None
        #: schedule="async": stage optimizers, the open stream, the measured staleness
        self._async = AsyncTraining() if asynchronous else None
        self._trace = ExecutionTrace([])  # the traces of pipelines already closed
        self._coordinator_ops: CoordinatorOps | None = None  # op substitution in the user's step code
        #: set by Lightning's accelerator connector to the Trainer's devices
        self.parallel_devices: list[torch.device] | None = None
        self.pipeline: Pipeline | None = None
        self._pipelined: nn.Module | None = None
        self._compiled: TorchCompiled | None = None  # the pipelined module is torch.compile(...) of this
        self._patches = Patches()  # attributes set on the user's objects for this fit, restored exactly
        self._outside = GradStash()  # parameters outside the pipelined module (before/after the call)
        self._hooked: set[str] = set()
        self._seen_batch = False
        #: the last step's `StepResult` (per-rank action timings, the schedule), kept after teardown
        self.last_step: Any = None

    # devices
    def resolve_devices(self) -> list[str]:
        """One device per stage, from ``devices``, the Trainer's devices or cpu."""
        if self.stage_devices is not None:
            return self.stage_devices
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
        """The coordinator's device: where the last stage's output and the loss live."""
        devices = self.resolve_devices()
        if isinstance(self.runtime, BaseRuntime):
            return self.runtime.torch_device
        return runtime_registry.create(devices[-1]).torch_device

    # setup and teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._trainer = trainer
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
            transport=self.transport,
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

    def _shutdown(self) -> None:
        try:
            self._end_stream()
            if self._stage_params is not None and self._stage_params.views and self.pipeline is not None:
                self.pipeline.sync_module()  # the LightningModule and its optimizer end up trained, as usual
                self._stage_params.fold_into_templates()
        finally:  # whatever failed above: the user's objects as they were, the stages stopped
            self._patches.restore()
            if self.pipeline is not None:
                pipeline, self.pipeline = self.pipeline, None
                pipeline.close()
            self._seen_batch = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._stage_params is not None:
            self._stage_params.views = {}  # stages may be gone: nothing to gather
        if self._async is not None and self._async.stream is not None:
            self._async.stream.abort()  # stages may be gone: nothing to drain
            self._async.stream = None
        self._shutdown()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        return super().batch_to_device(batch, device or self.root_device, dataloader_idx)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._stage_params is not None:  # the stages' parts, now or once the stages are built
            self._stage_params.load(self.optimizers, checkpoint["optimizer_states"])
            return
        if self._async is not None and self._async.template is not None:
            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
                if optimizer is self._async.template:
                    self._async.load_state_dict(state)
                else:
                    optimizer.load_state_dict(state)
            return
        # torch moves each state to its parameter's device; Lightning's version would move it to one device
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            optimizer.load_state_dict(state)

    # stages that own their parameters (transport="rpc"): steps and checkpoints go through them
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._stage_params is None or self._stage_params.view(optimizer) is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        return self._stage_params.optimizer_step(self.precision_plugin, optimizer, model, closure, **kwargs)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._async is not None and getattr(optimizer, "_optimizer", optimizer) is self._async.template:
            return self._async.state_dict()
        state = self._stage_params.state(optimizer) if self._stage_params is not None else None
        return state if state is not None else super().optimizer_state(optimizer)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._async is not None and self._async.stream is not None and not self._async.stream.closed:
            rank_zero_warn(
                "PipeStrategy(schedule='async'): a checkpoint in the middle of a stream holds the live weights, "
                "with the updates of batches in flight missing; checkpoints at the end of an epoch or validation "
                "see every update"
            )
        if self._stage_params is not None and self.pipeline is not None:
            self.pipeline.sync_module()
        return super().lightning_module_state_dict()

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

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Put the gradients the pipeline computed during ``training_step`` on ``p.grad``.

        Lightning zeroes gradients between ``training_step`` and ``backward``, so the pipeline keeps
        them aside until now. The precision plugin's hooks still run (``on_before_backward``,
        ``on_after_backward``); ``LightningModule.backward`` is not called: the pipeline did the backward.
        """
        lightning_module = self.lightning_module
        assert lightning_module is not None and self.pipeline is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lightning_module)
        scale = 1.0 / self._trainer.accumulate_grad_batches
        if self._async is None:  # async: the stages stepped their own parameters
            self.pipeline.apply_grads(scale)
        self._outside.apply(scale)
        closure_loss = self.precision_plugin.post_backward(closure_loss, lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

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
