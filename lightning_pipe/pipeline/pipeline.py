"""`Pipeline`: a model split into stages and run by a schedule, without Lightning.

The strategy builds one of these; tests and benchmarks use it directly::

    pipe = Pipeline(nn.Sequential(...), stages=2, schedule="1f1b")
    with pipe:
        losses = pipe.train_step(x, y, F.cross_entropy, microbatches=4)  # grads land on p.grad

Any other module is traced and cut (`TracedPartitioner`), before ``split_points`` or where ``partition``
balances it; its forward may take several positional and keyword arguments (docs/internals.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_pipe.backends import CoordinatorOps, ExecutionTrace, resolve_backends
from lightning_pipe.backends.compiled import split_compiled
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.base.microbatch import batch_size, gather
from lightning_pipe.base.microbatch_weights import MicrobatchWeight, check_weight_function
from lightning_pipe.comm import Communicator
from lightning_pipe.comm.transports import register_transport as register_transport
from lightning_pipe.comm.transports import resolve_transport
from lightning_pipe.engine import AutocastSpec, Coordinator, StageProtocol, StageSpec, StepResult
from lightning_pipe.engine.loss import Criterion, Loss, WeightedLoss, as_loss
from lightning_pipe.engine.runners import worker_of_stages
from lightning_pipe.engine.stream import AsyncRun
from lightning_pipe.partition import ShardedTask
from lightning_pipe.partition.selection import resolve_partitioner as resolve_partitioner  # re-exported: strategy
from lightning_pipe.partition.tied_parameters import tied_parameters
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.pipeline.async_batches import train_batches
from lightning_pipe.pipeline.choices import PipelineChoices
from lightning_pipe.pipeline.inputs import PipelineInputs
from lightning_pipe.pipeline.optimizers import StageOptimizers
from lightning_pipe.pipeline.recompute import AutoCheckpoint, checkpoint_flags
from lightning_pipe.pipeline.schedule_chooser import AutoSchedule, ScheduleChooser, StageMoves, is_auto
from lightning_pipe.pipeline.settings import PipelineSettings, keyword, signature_of
from lightning_pipe.pipeline.stage_layout import resolve_runtime, stage_devices, worker_specs
from lightning_pipe.pipeline.stage_moves import move_stages, moves_of
from lightning_pipe.pipeline.stage_state import StageState
from lightning_pipe.rng import run_seed
from lightning_pipe.schedule import placement_of, resolve_schedule
from lightning_pipe.weights import StageInit

log = logging.getLogger("lightning_pipe")


class Pipeline:
    """Stages built from an ``nn.Sequential``, a schedule and a communicator.

    ``stages`` counts the pieces of the model; with ``virtual_stages=V`` each worker (rank) holds
    ``V`` of them, placed as the schedule says (`Schedule.placement`: stage ``s`` on rank ``s % (stages // V)``,
    or in a V for ``zbv`` and ``dualpipev``). ``runner`` picks how the workers run
    the schedule (see `lightning_pipe.engine.runners`); ``schedule`` is a registered name, a
    `Schedule` subclass or a function returning per-rank action lists. ``checkpoint``: see `recompute`.
    Each stage draws its random numbers (dropout) from generators of its own, seeded from ``seed`` and its
    index (default: ``PL_GLOBAL_SEED`` when Lightning's ``seed_everything`` ran, else ``torch.initial_seed()``).

    Made of parts: ``inputs`` (`PipelineInputs`: a call of the module as the first stage's input, per
    microbatch), ``choices`` (`PipelineChoices`: ``schedule="auto"`` and ``checkpoint="auto"``, decided around the
    training steps) and, once built, ``coordinator`` (the engine that runs the steps) and ``stage_state``
    (`StageState`: gradients, parameters, checkpoints and optimizers as the stages hold them).
    """

    def __init__(
        self,
        module: nn.Module,
        stages: int | None = None,
        *,
        settings: PipelineSettings | None = None,
        transport: str | Communicator = "local",
        autocast: AutocastSpec | None = None,
        sample: Any = None,
        coordinator_device: torch.device | None = None,
        seed: int | None = None,
        init: StageInit | None = None,
        **keywords: Any,
    ) -> None:
        # the shared arguments as keywords (`PipelineSettings`: one field each); the rest are the transport's own
        # (``threads`` for the local one), which its constructor checks
        shared = {name: keywords.pop(name) for name in PipelineSettings.names() if name in keywords}
        if settings is None:
            settings = PipelineSettings.from_keywords("Pipeline", {"stages": stages, **shared})
        elif stages is not None or shared:
            raise TypeError("Pipeline(settings=...) takes the shared arguments in settings, not as keywords too")
        if settings.stages is None:
            raise ConfigurationError("Pipeline(stages=...): pass the number of stages")
        self.settings = settings
        stages, virtual_stages, runner = settings.stages, settings.virtual_stages, settings.runner
        schedule, strict = settings.schedule, settings.strict
        options = schedule if isinstance(schedule, AutoSchedule) else AutoSchedule()
        chooser = (  # schedule="auto": measures in the first training step, chooses before the second
            ScheduleChooser(options, virtual_stages, runner, stages // virtual_stages) if is_auto(schedule) else None
        )
        self.schedule_factory = chooser or resolve_schedule(schedule)  # auto: the probe, placed
        placement = placement_of(self.schedule_factory)  # where the schedule wants each stage
        self.worker_of_stage = worker_of_stages(runner, stages, virtual_stages, placement)
        self.devices = stage_devices(settings.devices, stages, stages // virtual_stages, placement)
        self._given_devices = settings.devices
        module, backend = split_compiled(module, settings.backend, stages, strict)  # torch.compile(m): compile stages
        self.module = module
        self.virtual_stages = virtual_stages
        self.runner = runner
        self.partitioner = resolve_partitioner(settings.partition, module, settings.split_points)
        self.checkpoint = checkpoint_flags(settings.checkpoint, stages)
        self.runtimes = resolve_runtime(settings.runtime, self.devices)
        self.timeout = float(settings.timeout)
        self.autocast = autocast
        self.backend = resolve_backends(backend, stages, strict)
        self.coordinator_ops = CoordinatorOps(self.backend, stages - 1)  # op substitution in the loss
        self.communicator = resolve_transport(transport, {**settings.transport_options, **keywords})
        self.coordinator_device = coordinator_device or self.runtimes[-1].torch_device
        self.seed = run_seed(seed)
        # where the stages' tensors without values come from (built on meta), or a resumed run's values
        self.init = init if init is not None else StageInit(seed=self.seed, overwrite=False)
        self.shards: list[ShardedTask] = []
        self.inputs = PipelineInputs(self.partitioner, self._stages_built_on)
        self._coordinator: Coordinator | None = None
        self._stage_state: StageState | None = None
        self._started = False
        self._moved = ExecutionTrace([])  # the execution traces of stage workers replaced by a move
        self.choices = PipelineChoices(  # schedule="auto" and checkpoint="auto", decided around the training steps
            chooser, AutoCheckpoint(self.devices) if settings.checkpoint == "auto" else None, stages // virtual_stages,
            lambda: self._coordinator, self._moves,
        )  # fmt: skip
        if sample is not None or not self.partitioner.needs_sample:
            self.build(sample)

    @property
    def traced(self) -> bool:
        """Whether the module is split through its traced graph (inputs and outputs are packed)."""
        return isinstance(self.partitioner, TracedPartitioner)

    @property
    def built(self) -> bool:
        return self._coordinator is not None

    @property
    def coordinator(self) -> Coordinator:
        if self._coordinator is None:
            raise ConfigurationError(_NOT_BUILT)
        return self._coordinator

    @property
    def stage_state(self) -> StageState:
        if self._stage_state is None:
            raise ConfigurationError(_NOT_BUILT)
        return self._stage_state

    def build(self, sample: Any = None) -> Pipeline:
        """Partition the module (a traced module: on the example call ``sample``) and make the stages."""
        if self._coordinator is not None:
            return self
        self.shards = self.partitioner.partition(self.module, self.devices, sample)
        tied = tied_parameters([shard.module for shard in self.shards])  # before any stage makes its tensors
        self._coordinator = Coordinator(
            self.communicator,
            self._specs(self.init.for_module(self.module)),
            self.schedule_factory,
            self.timeout,
            self.coordinator_device,
            virtual_stages=self.virtual_stages,
            runner=self.runner,
            tied=tied,
        )
        if self.init.edits is not None:  # each worker's spec holds the values the checkpoint hook gave it
            self.init.edits.handed_over()
        self._stage_state = StageState(self._coordinator, self.module, self.shards, self.communicator, self.seed)
        if self._started:
            self._coordinator.start()
        return self

    def _specs(self, init: StageInit | None) -> list[StageSpec]:
        """Each worker's `StageSpec` in the current placement (``init``: how it makes its tensors; None: they have
        values)."""
        return worker_specs(
            self.shards,
            self.worker_of_stage,
            self.runtimes,
            self.checkpoint,
            self.timeout,
            self.autocast,
            self.backend,
            self.seed,
            init,
        )

    def _moves(self) -> StageMoves:
        """Where the built stages can move (``schedule="auto"``) and how: `_move_stages`."""
        return moves_of(self.communicator, self._given_devices, self.devices, self.virtual_stages, self._move_stages)

    def _move_stages(self, placement: str) -> None:
        """Start the stage workers again in ``placement``, every state kept (`lightning_pipe.pipeline.stage_moves`)."""
        self.worker_of_stage = worker_of_stages(self.runner, len(self.devices), self.virtual_stages, placement)
        moved = move_stages(self.coordinator, self.stage_state, self._specs(None), self.choices.checkpoint)
        self._moved = self._moved.merged(moved)

    def _stages_built_on(self, sample: Any) -> StageState:
        return self.build(sample).stage_state

    @property
    def balance(self) -> list[int]:
        return [len(shard.layers) for shard in self.shards]

    def start(self) -> Pipeline:
        if not self._started:
            if self._coordinator is not None:
                self._coordinator.start()
            self._started = True
        return self

    def close(self) -> None:
        """Stop the stages; what was posted to them since the last call is not waited for (`Coordinator.post`)."""
        if self._started:
            self._started = False
            if self._coordinator is not None:
                self._coordinator.close()

    def flush(self) -> None:
        """Wait until the stages ran what was posted to them (the last optimizer step) and ended their steps;
        raises the first of those that failed. Nothing to wait for before `start` or after `close`."""
        if self._started and self._coordinator is not None:
            self._coordinator.flush()

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.flush()  # a failed posted call (the last optimizer step) is raised, not lost
        finally:
            self.close()

    def parameters_of_stages(self) -> list[nn.Parameter]:
        return [p for shard in self.shards for p in shard.module.parameters()]

    def execution_trace(self, reset: bool = False) -> ExecutionTrace:
        """Per stage: which backend ran its forwards and which substituted ops ran where."""
        per_rank = self.coordinator.stages.call(StageProtocol.execution_trace, reset)
        stages = ExecutionTrace(sorted((t for traces in per_rank for t in traces), key=lambda t: t.stage))
        trace = stages.merged(ExecutionTrace([self.coordinator_ops.trace])).merged(self._moved)
        if reset:
            self.coordinator_ops.trace.reset()
            self._moved = ExecutionTrace([])
        return trace

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        criterion: Loss | Criterion,
        microbatches: int | str = 4,
        scaler: Any = None,
        kwargs: dict[str, Any] | None = None,
        microbatch_weight: MicrobatchWeight | None = None,
    ) -> StepResult:
        """One training step on a whole batch; gradients of the batch's loss land on ``p.grad``.

        ``criterion`` is a `Loss` (or a function ``(output, target) -> loss``, wrapped in one).
        Microbatch ``i``'s loss is weighted by its share of the rows before ``compute_gradient``, so
        the gradients equal those of ``criterion(model(inputs), targets)`` for a mean-reduced
        criterion. A criterion that averages over something else (tokens whose target is not -100)
        needs ``microbatch_weight(targets_i)``, the weight of microbatch ``i``: what the criterion
        averages over in its targets, e.g. ``lambda y: (y != -100).sum()``. A microbatch of weight 0
        adds nothing, not even its loss's gradient (its loss in the result is 0). A traced module is
        called as ``module(*inputs, **kwargs)`` (``inputs`` a tuple) and the criterion receives its
        output as the module returns it. ``microbatches="auto"`` with ``schedule="auto"``: see `PipelineChoices`.
        """
        argument = "Pipeline.train_step(microbatch_weight=...)"
        check_weight_function(microbatch_weight, argument)
        count = self.choices.microbatches(microbatches, batch_size(targets), log.info)
        xs, labels = self.inputs.labelled(inputs, targets, kwargs, count, microbatch_weight, argument)
        self.choices.before_step(len(xs), log.info)
        result = self.coordinator.train_step(xs, labels, self._weighted(criterion, "train"), scaler)
        self.choices.after_step(result)
        self.apply_grads(1.0)
        return result

    def train_async(
        self,
        batches: Iterable[tuple[Any, Any]],
        criterion: Loss | Criterion,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        microbatches: int = 4,
        num_batches: int | None = None,
        microbatch_weight: MicrobatchWeight | None = None,
    ) -> AsyncRun:
        """Train on a stream of ``(inputs, targets)`` batches with ``schedule="async"``: no flush.

        Each stage owns ``optimizer(stage parameters)`` and steps it after every batch's worth of
        its backwards, on gradients taken with the weight version each microbatch's forward used
        (weight stashing); the parameters of the module are updated in place. ``num_batches``
        defaults to ``len(batches)``; ``microbatch_weight`` as in `train_step`. Returns the mean loss of
        every batch and each stage's staleness.
        """
        argument = "Pipeline.train_async(microbatch_weight=...)"
        check_weight_function(microbatch_weight, argument)

        def labelled(x: Any, y: Any) -> tuple[list[Any], list[Any]]:
            return self.inputs.labelled(x, y, None, microbatches, microbatch_weight, argument)

        criterion_ = self._weighted(criterion)
        return train_batches(  # the coordinator is asked for once the first batch's cut built the pipeline
            lambda: self.coordinator, batches, labelled, criterion_, optimizer, microbatches, num_batches
        )

    def stash_peaks(self) -> list[int]:
        """Most bytes of stashed activations each worker held at once in the last training step."""
        return [int(peak) for peak in self.coordinator.stages.call(StageProtocol.stash_peak)]

    def forward(self, inputs: Any, microbatches: int = 1, kwargs: dict[str, Any] | None = None) -> Any:
        """Forward only, no autograd; outputs are concatenated in batch order."""
        xs = self.inputs.microbatches(inputs, kwargs, microbatches)
        result = self.coordinator.forward_step(xs)
        return gather([self.unpack(output) for output in result.outputs])

    # the faces of the parts: a call of the module (`PipelineInputs`), the stages' state (`StageState`)
    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        return self.inputs.pack(args, kwargs)

    def unpack(self, output: Any) -> Any:
        return self.inputs.unpack(output)

    def apply_grads(self, scale: float = 1.0) -> None:
        self.coordinator.apply_grads(scale)

    @property
    def tied(self) -> list[list[tuple[int, str]]]:
        return self.stage_state.tied

    def parameter_locations(self) -> dict[int, tuple[int, str]]:
        return self.stage_state.parameter_locations()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.stage_state.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.stage_state.load_state_dict(state)

    def random_state(self) -> dict[str, Any]:
        return self.stage_state.random_state()

    def load_random_state(self, state: dict[str, Any]) -> None:
        self.stage_state.load_random_state(state)

    def sync_module(self) -> None:
        self.stage_state.sync_module()

    def grads(self) -> dict[str, torch.Tensor | None]:
        return self.stage_state.grads()

    def optimizer(self, template: torch.optim.Optimizer, names: dict[int, str] | None = None) -> StageOptimizers:
        """``template``'s per-stage parts (``names``: its parameters' names in the module, where they are not the
        objects the stages were cut from)."""
        return self.stage_state.optimizer(template, names)

    def _weighted(self, criterion: Loss | Criterion, ops: str | None = None) -> WeightedLoss:
        """The user's loss on the module's own output, weighted (targets are ``(weight, target)``)."""
        context = functools.partial(self.coordinator_ops.context, ops) if ops else contextlib.nullcontext
        return WeightedLoss(as_loss(criterion), self.inputs.unpack, context)


_NOT_BUILT = (
    "the pipeline is built on its first step (its partitioner needs an example batch); "
    "pass sample=... to build it earlier"
)

#: what `inspect.signature` and ``help`` show: the shared arguments by name (`PipelineSettings`), stages by position too
Pipeline.__init__.__signature__ = signature_of(  # type: ignore[attr-defined]
    PipelineSettings,
    leading=[inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("self", "module")],
    trailing=[
        keyword("settings"), keyword("transport", "local"), keyword("autocast"), keyword("sample"),
        keyword("coordinator_device"), keyword("seed"), keyword("init"),
    ],
)  # fmt: skip
