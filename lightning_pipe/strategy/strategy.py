"""`PipeStrategy`: pipeline-parallel training, validation, testing and prediction in Lightning."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_pipe.backends import ExecutionTrace
from lightning_pipe.engine.stage_shards import mixed_precision_policy
from lightning_pipe.engine.versions import Staleness
from lightning_pipe.partition import Partitioner
from lightning_pipe.pipeline.pipeline import Pipeline
from lightning_pipe.pipeline.settings import keyword, signature_of
from lightning_pipe.rng import run_seed
from lightning_pipe.schedule import AutoChoice
from lightning_pipe.strategy.async_training import training_for
from lightning_pipe.strategy.building import Destination, PipelineBuilder, autocast_of
from lightning_pipe.strategy.checkpoints import Checkpoints
from lightning_pipe.strategy.data_position import training_loader
from lightning_pipe.strategy.layout import Layout
from lightning_pipe.strategy.lifecycle import Lifecycle
from lightning_pipe.strategy.model_state import ModelState
from lightning_pipe.strategy.modes.mode import Mode
from lightning_pipe.strategy.optimization import StageOptimization
from lightning_pipe.strategy.pipe_config import PipeConfig
from lightning_pipe.strategy.process_stage import ProcessStage, moving_own_to_cpu
from lightning_pipe.strategy.processes import Processes
from lightning_pipe.strategy.random_state import RandomStreams
from lightning_pipe.strategy.steps import StepDriver
from lightning_pipe.strategy.trace_callback import PipeTrace


class PipeStrategy(ParallelStrategy):
    """Splits the LightningModule's pipelined module into stages and runs each step as a pipeline.

    The arguments are `PipeConfig`'s fields, each described there (``lightning_pipe.strategy.pipe_config.PipeConfig``,
    with those it shares with `Pipeline` in ``lightning_pipe.pipeline.settings.PipelineSettings``), by keyword
    (``stages`` by position too), and Lightning's own ``accelerator``, ``checkpoint_io`` and ``precision_plugin``.

    Lightning's hooks hand the work to the parts the strategy holds: ``mode`` (what differs between local, rpc
    and launched mode: the processes, the collectives, where the stages and optimizers live, how the training
    state is written; chosen once, when Lightning sets the ranks, by ``processes``, which also answers Lightning's
    launcher and sets up each fit's environment), ``builder`` (the pipeline), ``steps`` (each
    step, microbatch by microbatch; ``steps.training``: flushed, or ``schedule="async"``'s stream),
    ``optimization`` (gradients and optimizer steps), ``random`` (generator states), ``state`` (the training state
    in Lightning's checkpoint hooks), ``stage`` (launched mode: this process's part of the model), ``lifecycle``
    (what a fit sets up around the user's objects, and what its end undoes).
    """

    strategy_name = "pipe"

    def __init__(
        self,
        stages: int | None = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **arguments: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        # every argument but Lightning's own three is a field of `PipeConfig` (the signature below is made from it)
        self.config = config = PipeConfig.of({"stages": stages, **arguments})
        self.num_nodes = 1  # set by Lightning's connector from Trainer(num_nodes=...)
        self.builder = PipelineBuilder(config, self.broadcast)
        self.optimization = StageOptimization()
        training = training_for(config.asynchronous)  # the step driver's variant: flushed, or a stream
        self.random = RandomStreams(training)
        self.steps = StepDriver(config, self.builder, self.optimization, self.random, training)
        self.stage = ProcessStage(config.data_parallel, lambda: mixed_precision_policy(self.precision_plugin.precision))
        checkpoints = Checkpoints(self.builder, self.optimization, self.random, training, config.weights_path,
                                  config.weights_only)  # fmt: skip
        self.state = ModelState(self, checkpoints, self.builder, self.optimization, self.stage)
        self.pipe_trace = PipeTrace.of(config.trace)  # the timeline callback, if a trace is asked for
        self.lifecycle = Lifecycle(self.state, self.steps, self.random, self.pipe_trace)
        self.processes = Processes(self, config, self.builder, self.stage, self.state)  # the mode, chosen later

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
        return self.builder.selection.schedule

    @property
    def schedule_choice(self) -> AutoChoice | None:
        """What ``schedule="auto"`` chose in this (or the last) fit; None before its second training step."""
        return self.builder.selection.choice(self.builder.pipeline)

    @property
    def checkpoint(self) -> str:
        return self.builder.checkpoint

    # the processes: Lightning's connector asks when the Trainer is built
    @property
    def mode(self) -> Mode:
        """The mode this run is in (`lightning_pipe.strategy.modes.mode`), chosen when Lightning sets the ranks."""
        return self.processes.mode

    @property
    def layout(self) -> Layout | None:
        """Launched mode: the processes, replicas and pipeline ranks (None in one process)."""
        return self.mode.layout

    def set_world_ranks(self) -> None:  # called by Lightning's connector (as on DDPStrategy)
        self.processes.set_ranks()

    @override
    def _configure_launcher(self) -> None:
        self._launcher = self.processes.launcher()

    @override
    def setup_environment(self) -> None:
        self.processes.start()  # the accelerator's device; launched: join, hold the serving ranks

    @property
    def device_mesh(self) -> Any:
        """Launched mode's DeviceMesh (as ``ModelParallelStrategy.device_mesh``; the LightningModule's
        ``self.device_mesh``): dims ``data_parallel`` x ``pipeline`` (x ``tensor_parallel`` with tensor parallel)."""
        return self.processes.joined_mesh()

    def resolve_devices(self) -> list[str]:
        """One device per stage: launched mode's processes (placed as the schedule says), or from ``devices``,
        the Trainer's devices or cpu."""
        return self.mode.stage_devices(self.parallel_devices, self.builder.selection.rank_placement)

    @property
    @override
    def root_device(self) -> torch.device:
        """The coordinator's device: where the last stage's output and the loss live (launched: this process's)."""
        return self.mode.root_device(lambda: self.builder.coordinator_device(self.resolve_devices()))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.mode.sampler_kwargs

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector: a distributed sampler over the replicas in launched mode."""
        return self.mode.distributed

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """What Lightning's loop sees: 1 in launched mode (`LaunchedMode.world_size` says why)."""
        return self.mode.world_size(super().world_size)

    # Lightning's collectives: among the coordinators in launched mode, nothing to agree on in one process
    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return self.mode.collectives.reduce_boolean_decision(decision, all)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self.mode.collectives.reduce(tensor, group, reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        self.mode.collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.mode.collectives.broadcast(obj, src)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return self.mode.collectives.all_gather(tensor, group, sync_grads)

    # setup and teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.lifecycle.begin(self.state.module)
        # one seed per run (seed_everything's, else torch's initial seed), the first coordinator's for every replica
        seed = self.builder.seed = self.random.seed = int(self.broadcast(run_seed()))
        autocast = autocast_of(self.precision_plugin)
        destination = Destination(self.resolve_devices(), self.root_device, autocast, self.mode.transport, self._built)
        pipelined = self.state.prepare(destination, seed)
        self.mode.continue_from(destination)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()  # the stages place the pipelined module: no wrapper (Lightning's _setup_model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            scaler, accumulate = getattr(self.precision_plugin, "scaler", None), trainer.accumulate_grad_batches
            self.steps.training.attach(self.optimizers, list(pipelined.parameters()), accumulate, scaler)
        self.setup_precision_plugin()
        self.lifecycle.start(trainer, self.mode, self.precision_plugin, self.root_device)

    def _built(self, pipeline: Pipeline) -> None:
        """The stages exist: they get the saved generator states, the optimizers their per-stage parts (the mode says
        where: in launched mode this process keeps its own stage and the tensors outside the pipeline)."""
        self.random.restore(pipeline)
        self.mode.built(pipeline, self.root_device)

    @override
    def model_to_device(self) -> None:
        """Everything but the pipelined module goes to the coordinator's device; stages place their shards."""
        assert self.model is not None
        self.builder.place_outside(self.model, self.root_device)

    @override
    def teardown(self) -> None:
        """Lightning's teardown moves the module to the CPU with ``module.cpu()``, which cannot copy the meta
        tensors of the stages this process does not hold: for that call, the module moves what it has."""
        self.lifecycle.end(self.mode)
        with moving_own_to_cpu(self.lightning_module):
            super().teardown()
        self.lifecycle.ctrl_c.restore()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.lifecycle.abort(self.mode, exception)

    # steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run("training_step", args, kwargs, self.precision_plugin.train_step_context)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run("validation_step", args, kwargs, self.precision_plugin.val_step_context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run("test_step", args, kwargs, self.precision_plugin.test_step_context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run("predict_step", args, kwargs, self.precision_plugin.predict_step_context)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Put the gradients the pipeline computed during ``training_step`` on ``p.grad``.

        Lightning zeroes gradients between ``training_step`` and ``backward``, so the pipeline keeps
        them aside until now. The precision plugin's hooks still run (``on_before_backward``,
        ``on_after_backward``); ``LightningModule.backward`` is not called: the pipeline did the backward.
        """
        lightning_module, pipeline = self.state.module, self.builder.pipeline
        assert pipeline is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lightning_module)
        scale = 1.0 / lightning_module.trainer.accumulate_grad_batches
        self.steps.training.apply_grads(pipeline, scale)  # schedule="async": none, the stages stepped
        self.optimization.apply_outside(scale)
        closure_loss = self.precision_plugin.post_backward(closure_loss, lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if not self.optimization.steps_stages(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        return self.optimization.optimizer_step(self.precision_plugin, optimizer, model, closure, **kwargs)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        return super().batch_to_device(batch, device or self.root_device, dataloader_idx)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """A training loader keeps its place in the epoch across a restart, or says once that it cannot."""
        return training_loader(self.lightning_module, dataloader)

    # where a model's tensors are made: on meta, each stage makes its own where it runs
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device: each stage makes its tensors later."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device (as FSDP's deferred initialisation does); in launched mode
        its ``fully_shard`` calls are recorded, and applied per stage (`ProcessStage.deferring`)."""
        with torch.device("meta"), self.stage.deferring(self.mode.device_mesh):
            yield

    # the training state in a checkpoint: the parts read it, the mode says where it is written from
    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self.lifecycle.resuming()  # ckpt_path= wins over weights= (docs/usage.md)
        return self.mode.load_checkpoint(checkpoint_path, weights_only, super().load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Lightning's strict loading in every mode (Lightning calls this before it restores its loops)."""
        self.state.load_model_state_dict(checkpoint, strict, super().load_model_state_dict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.mode.load_optimizer_state(checkpoint)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.mode.module_state(super().lightning_module_state_dict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.mode.optimizer_state(optimizer, super().optimizer_state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        checkpoint = self.state.checkpoints.saving(checkpoint, self.mode.random_state)  # with the generator states
        self.mode.save_checkpoint(checkpoint, Path(filepath), storage_options, super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.mode.remove_checkpoint(Path(filepath), super().remove_checkpoint)

    # what users ask of the strategy
    def staleness(self) -> list[Staleness]:
        """schedule="async": per stage, the staleness its microbatches saw over this strategy's fits."""
        return self.steps.training.staleness(self.schedule)

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
        `lightning_pipe.pipeline.memory_plan.MemoryPlan`. ``checkpoint="auto"`` is planned without recomputation: the
        plan it starts from (it recomputes where a device's free memory is short of it).
        """
        return self.builder.plan(model, sample_batch, len(self.resolve_devices()), self.microbatches, verbose)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="Pipeline parallelism across stages (lightning_pipe)"
            )


#: what `inspect.signature`, ``help`` and editors that read it show: `PipeConfig`'s fields, then Lightning's three
PipeStrategy.__init__.__signature__ = signature_of(  # type: ignore[attr-defined]
    PipeConfig,
    leading=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)],
    trailing=[keyword("accelerator"), keyword("checkpoint_io"), keyword("precision_plugin")],
)
