"""`PipeStrategy`: pipeline-parallel training, validation, testing and prediction in Lightning."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_pipe.backends import BackendArg, ExecutionTrace
from lightning_pipe.comm import Communicator
from lightning_pipe.engine.stage_shards import mixed_precision_policy
from lightning_pipe.engine.versions import Staleness
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.microbatch_weights import MicrobatchWeight
from lightning_pipe.partition import Partitioner
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.rng import run_seed
from lightning_pipe.runtime import BaseRuntime
from lightning_pipe.schedule import AutoChoice
from lightning_pipe.strategy.arguments import auto_schedule_of
from lightning_pipe.strategy.asynchronous import AsyncTraining
from lightning_pipe.strategy.building import PipelineBuilder, Placement, autocast_of
from lightning_pipe.strategy.checkpoints import Checkpoints
from lightning_pipe.strategy.config import PipeConfig
from lightning_pipe.strategy.hooks import RuntimeHooks, install
from lightning_pipe.strategy.interrupts import CtrlC
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.patch import Patches
from lightning_pipe.strategy.random_state import RandomStreams
from lightning_pipe.strategy.stage_placement import ProcessStage
from lightning_pipe.strategy.step_hooks import StepHooksStrategy
from lightning_pipe.strategy.steps import StepDriver, StepSetting
from lightning_pipe.strategy.timeline import PipeTrace
from lightning_pipe.weights import on_meta


class PipeStrategy(StepHooksStrategy):
    """Splits the LightningModule's pipelined module into stages and runs each step as a pipeline.

    Args:
        stages: number of stages; default: one per device.
        microbatches: how many pieces each batch is cut into (along dimension 0); ``"auto"`` with
            ``schedule="auto"``: chosen with the schedule.
        schedule: ``"gpipe"`` (all forwards, then losses, then backwards), ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"zero-bubble"``, ``"looped-bfs"``, ``"interleaved-zero-bubble"``,
            ``"zbv"``, ``"dualpipev"`` (the last two with ``virtual_stages=2``), ``"async"`` (no flush between
            batches, each stage steps its own copy of the ``configure_optimizers`` optimizer with weight stashing;
            transport ``"local"``; `staleness` reports what it measured), a `Schedule` subclass or a function
            returning per-rank action lists (see docs/schedules.md). ``"auto"``: the first training step
            measures every stage, the second runs the registered schedule `simulate` predicts fastest
            (`lightning_pipe.auto_schedule`; the choice is logged as a table and kept in `schedule_choice`).
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
        virtual_stages: stages per worker (``interleaved-1f1b`` and the other chunked schedules): stage ``s``
            runs on worker ``s % (stages // virtual_stages)``, or in a V (``zbv``, ``dualpipev``: stages ``r`` and
            ``2P - 1 - r`` on worker ``r``).
        runner: ``"parallel"`` (a thread per worker, fixed order), ``"dataflow"`` (each worker runs
            whichever action is ready) or ``"linear"`` (one thread walks one global order).
        trace: a path for the Chrome trace (pipeline timeline) of training steps 1-3, or a `PipeTrace`
            (chosen steps, a PNG Gantt chart).
        microbatch_weight: a function of a microbatch (what the step receives) returning its weight, a
            number or 0-d tensor; default: its rows. Losses, ``self.log`` values and the step's returned
            values combine with the weights normalised over the batch: return what the loss averages
            over, e.g. ``lambda b: (b["labels"][:, 1:] != -100).sum()`` for a causal LM's labelled tokens.
            A microbatch of weight 0 adds nothing, not even its loss's gradient.
        data_parallel: launched mode with several replicas: ``"ddp"`` (each replica holds its whole stage, gradients
            averaged) or ``"fsdp"`` (each stage sharded over its replicas with FSDP2, gradients reduce-scattered once
            per step).
        weights: pretrained weights of the pipelined module (safetensors, a file or a sharded folder with its index;
            a ``torch.save``d state dict; a torch.distributed.checkpoint folder): each stage reads its own tensors.
            Its keys are checked as ``strict_loading`` says (docs/big-models.md, "Where your model's state lives").
        weights_only: how a ``weights`` file written by ``torch.save`` is opened: None (torch's default, True)
            refuses pickled objects other than tensors, with an error that names this argument; pass False only
            for a file you trust (its pickled code runs). ``ckpt_path=`` takes ``trainer.fit(weights_only=...)``.
        memory_budget: ``schedule="auto"``: most bytes of stashed activations a rank may hold; default 90% of the
            device's free memory (no limit on cpu).
        save_distributed_checkpoint: launched mode writes a checkpoint as a folder, every process its own stage
            (True), or as one file, written a tensor at a time (False); see `lightning_pipe.weights`.
        tensor_parallel: launched mode: processes per stage of a replica (T). ``devices x num_nodes`` processes run
            R replicas x ``stages`` x T; the LightningModule's ``configure_model`` parallelises its blocks over
            ``self.device_mesh["tensor_parallel"]`` as under Lightning's ``ModelParallelStrategy``
            (`lightning_pipe.strategy.tensor_parallel`; schedules ``"gpipe"`` and ``"1f1b"``, ``data_parallel="ddp"``).

    Lightning's hooks hand the work to the parts the strategy holds: ``builder`` (the pipeline), ``steps``
    (each step, microbatch by microbatch), ``optimization`` (gradients and optimizer steps), ``random``
    (generator states), ``checkpoints`` (what a checkpoint holds), ``asynchronous`` (``schedule="async"``);
    `ProcessStrategy` answers Lightning's questions about the processes (launched mode: ``world``).
    """

    strategy_name = "pipe"

    def __init__(
        self,
        stages: int | None = None,
        microbatches: int | str = 4,
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
        data_parallel: str = "ddp",
        weights: str | os.PathLike[str] | None = None,
        save_distributed_checkpoint: bool = True,
        memory_budget: int | None = None,
        weights_only: bool | None = None,
        tensor_parallel: int = 1,
    ) -> None:
        config = PipeConfig.of(locals())  # every argument above but Lightning's own three, checked
        self.asynchronous = AsyncTraining() if config.asynchronous else None
        builder = PipelineBuilder(config)
        # launched mode's replicas run the first coordinator's choice: Lightning's broadcast among the coordinators
        builder.schedule = auto_schedule_of(
            config.schedule, config.microbatches, config.memory_budget, config.data_parallel, self.broadcast
        )
        self.optimization = StageOptimization(self.asynchronous)
        self.random = RandomStreams(self.asynchronous)
        checkpoints = Checkpoints(
            builder, self.optimization, self.random, self.asynchronous, config.weights_path, config.weights_only
        )  # fmt: skip
        stage = ProcessStage(config.data_parallel, lambda: mixed_precision_policy(self.precision_plugin.precision))
        steps = StepDriver(config, builder, self.optimization, self.random, self.asynchronous)
        super().__init__(
            config, stage,
            accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            checkpoints=checkpoints, builder=builder, steps=steps, optimization=self.optimization,
        )  # fmt: skip
        trace = config.trace
        self.pipe_trace = trace if isinstance(trace, PipeTrace) or trace is None else PipeTrace(trace)
        self._runtime_hooks = RuntimeHooks(self)  # the stages' runtime callbacks at Lightning's hooks
        self._patches = Patches()  # attributes set on the user's objects for this fit, restored exactly
        self._ctrl_c = CtrlC()  # Ctrl-C works again after a fit it stopped
        self._trainer: pl.Trainer | None = None

    # what the parts hold, under the names users read
    @property
    def pipeline(self) -> Pipeline | None:
        """This fit's `Pipeline` while it runs (None before it is built and after teardown)."""
        return self.builder.pipeline

    @property
    def last_step(self) -> Any:
        """The last step's `StepResult` (per-rank action timings, the schedule), kept after teardown."""
        return self.steps.last_step

    @property
    def partitioner(self) -> Partitioner:
        return self.builder.partitioner

    @property
    def microbatches(self) -> int | str:
        return self.steps.microbatches

    @property
    def schedule(self) -> Any:
        return self.builder.schedule

    @property
    def schedule_choice(self) -> AutoChoice | None:
        """What ``schedule="auto"`` chose in this (or the last) fit; None before its second training step."""
        pipeline = self.builder.pipeline
        if pipeline is not None and pipeline.auto_schedule is not None and pipeline.auto_schedule.choice is not None:
            return pipeline.auto_schedule.choice
        return self.builder.schedule_choice

    @property
    def checkpoint(self) -> str:
        return self.builder.checkpoint

    @property
    @override
    def root_device(self) -> torch.device:
        """The coordinator's device: where the last stage's output and the loss live (launched: this process's)."""
        return self.mode.root_device(lambda: self.builder.coordinator_device(self.resolve_devices()))

    @override
    def rank_placement(self) -> str:
        """Which rank holds each stage: the schedule's placement (``v`` for ``zbv`` and ``dualpipev``)."""
        return self.builder.rank_placement

    # setup and teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._ctrl_c.remember()
        self._trainer = trainer
        lightning_module = self.lightning_module
        assert lightning_module is not None
        if not lightning_module.automatic_optimization:
            raise ConfigurationError(
                "PipeStrategy runs the backward inside the pipeline and supports automatic optimization only; "
                "set self.automatic_optimization = True"
            )
        placement = Placement(
            self.resolve_devices(), self.root_device, autocast_of(self.precision_plugin), self._transport, self._built
        )
        pipelined = self.builder.setup(lightning_module, placement)
        # one seed per run (seed_everything's, else torch's initial seed), the first coordinator's for every replica
        seed = self.builder.seed = self.random.seed = int(self.broadcast(run_seed()))
        prefix, strict = self.builder.prefix(lightning_module), lightning_module.strict_loading
        placement.init = self.checkpoints.stage_init(prefix, seed, pipelined, strict)
        self.stage.bind(lightning_module, pipelined)
        self.checkpoints.load_outside(lightning_module, pipelined, self.root_device, seed)  # before they move
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()  # the stages place the pipelined module: no wrapper (Lightning's _setup_model)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.asynchronous is not None:
                stage_params = list(pipelined.parameters())
                self.asynchronous.attach(self.optimizers, stage_params, trainer.accumulate_grad_batches, scaler)
        self.setup_precision_plugin()
        self.optimization.setup(self.mode.stages_own_parameters, self.builder.outside(lightning_module))
        self.optimization.name_parameters(lightning_module, pipelined, self.optimizers)
        self.steps.setup(StepSetting(lightning_module, trainer, self.root_device, scaler))
        self._install(trainer)
        self.builder.build_early(getattr(lightning_module, "example_input_array", None))

    def _transport(self) -> str | Communicator:
        """The pipeline's transport: launched mode's point-to-point communicator, or ``transport``'s name."""
        return self.mode.transport(self.config.transport)

    def _built(self, pipeline: Pipeline) -> None:
        """The stages exist: they get the saved generator states, the optimizers their per-stage parts; in launched
        mode this process keeps its own stage and the tensors outside the pipeline, nothing else."""
        lightning_module = self.lightning_module
        if self.world is not None and lightning_module is not None:
            self.stage.release(keep=self.builder.outside_tensors(lightning_module))
        self.random.restore(pipeline)
        assert self.builder.pipelined is not None
        self.optimization.attach(pipeline, self.optimizers, self.root_device, self.mode.name, self.builder.pipelined)

    @override
    def model_to_device(self) -> None:
        """Everything but the pipelined module goes to the coordinator's device; stages place their shards."""
        assert self.model is not None
        self.builder.place_outside(self.model, self.root_device)

    def _install(self, trainer: pl.Trainer) -> None:
        assert self.builder.pipelined is not None
        self._patches.set(self.builder.pipelined, "forward", self.steps.forward)
        if self.world is not None:
            self._zero_grads_after_the_stage(trainer.lightning_module)
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        install(callbacks, self._runtime_hooks, *([self.pipe_trace] if self.pipe_trace is not None else []))
        self.optimization.install(callbacks, self.precision_plugin)

    def _zero_grads_after_the_stage(self, module: pl.LightningModule) -> None:
        """Launched mode: this process's stage trains the LightningModule's own tensors, in its stage thread, and
        Lightning posts it the optimizer step without waiting. Before validation Lightning frees the module's
        gradients from the loop's thread (``on_validation_model_zero_grad``): the stages first finish what
        was posted to them, or the step would lose gradients it is reading."""
        release = module.on_validation_model_zero_grad  # the user's override, or Lightning's

        def after_the_stages() -> None:
            if self.builder.pipeline is not None:
                self.builder.pipeline.flush()
            release()

        self._patches.set(module, "on_validation_model_zero_grad", after_the_stages)

    @override
    def teardown(self) -> None:
        try:
            self.builder.keep_trace()  # execution_trace() after this fit/validate/test/predict
            self.steps.end_stream()
            self.random.keep(self.builder.pipeline)
            self.keep_stages()  # rpc mode, a model built on meta: its trained stages, for a checkpoint after fit
        finally:
            self._shutdown()
        super().teardown()
        self._ctrl_c.restore()

    def _shutdown(self, error: BaseException | None = None) -> None:
        try:
            self.steps.end_stream()
            self.checkpoints.close()
            if self.mode.folds_stages_back:  # else each process's LightningModule holds its own stage already
                module = self.lightning_module
                self.optimization.fold(self.builder.pipeline, module is not None and not on_meta(module))
        finally:  # whatever failed above: the user's objects as they were, the stages stopped
            self._patches.restore()
            self.steps.close()
            try:
                self.builder.close()
            finally:
                self.mode.release(error)  # launched mode: the serving ranks return from this fit

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.optimization.forget_stages()  # stages may be gone: nothing to gather
        if self.asynchronous is not None:
            self.asynchronous.abort()  # nor to drain
        self._shutdown(exception)

    # what users ask of the strategy
    def staleness(self) -> list[Staleness]:
        """schedule="async": per stage, the staleness its microbatches saw over this strategy's fits."""
        if self.asynchronous is None:
            raise ConfigurationError(f"staleness is measured with schedule='async', not {self.schedule!r}")
        return self.asynchronous.staleness()

    def execution_trace(self) -> ExecutionTrace:
        """Per stage: which backend ran its forwards and which substituted ops ran where (``print`` it).

        Ops of the user's step code (the loss) count under the last stage, mode ``"coordinator"``.
        """
        return self.builder.execution_trace()

    def plan(self, model: torch.nn.Module, sample_batch: Any, verbose: bool = True) -> Any:
        """Predict each stage's activation memory for one training step, before training.

        ``model`` is the LightningModule (its ``training_step`` runs on ``sample_batch`` up to the
        pipelined call, to find the pipeline's input) or the pipelined module itself (then
        ``sample_batch`` is its input). Prints the per-stage table unless ``verbose=False``; returns a
        `lightning_pipe.memory.MemoryPlan`. ``checkpoint="auto"`` is planned without recomputation: the
        plan it starts from (it recomputes where a device's free memory is short of it).
        """
        return self.builder.plan(model, sample_batch, len(self.resolve_devices()), self.microbatches, verbose)

    def runtime_hook(self, name: str, *args: Any) -> None:
        """Call ``runtime.<name>`` on every stage (skipped when no stage's runtime overrides it)."""
        if self.asynchronous is not None and self.asynchronous.stream is not None:
            return  # a stream owns the stages until it drains
        self.builder.runtime_hook(name, args)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Pipeline parallelism across stages (lightning_pipe)"
            )
