"""`Pipeline`: a model split into stages and run by a schedule, without Lightning.

The strategy builds one of these; tests and benchmarks use it directly::

    pipe = Pipeline(nn.Sequential(...), stages=2, schedule="1f1b")
    with pipe:
        losses = pipe.train_step(x, y, F.cross_entropy, microbatches=4)  # grads land on p.grad
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_pipe.backends import BackendArg, CoordinatorOps, ExecutionTrace, resolve_backends
from lightning_pipe.comm import Communicator, LocalCommunicator
from lightning_pipe.engine import AutocastSpec, Coordinator, StageSpec, StepResult
from lightning_pipe.engine.runners import worker_of_stages
from lightning_pipe.engine.versions import Staleness
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.microbatch import split
from lightning_pipe.partition import Partitioner, ShardedTask
from lightning_pipe.runtime import BaseRuntime, runtime_registry
from lightning_pipe.schedule import resolve_schedule

CHECKPOINT_MODES = ("always", "except_last", "never")
TRANSPORTS: dict[str, Callable[..., Communicator]] = {"local": LocalCommunicator}


def register_transport(name: str, factory: Callable[..., Communicator]) -> None:
    """Make ``factory(**options)`` available as ``transport=name``."""
    TRANSPORTS[name] = factory


def checkpoint_flags(mode: str, num_stages: int) -> list[bool]:
    """Which stages recompute their forward in the backward."""
    if mode not in CHECKPOINT_MODES:
        raise ConfigurationError(f"unknown checkpoint={mode!r}; available: {', '.join(CHECKPOINT_MODES)}")
    if mode == "always":
        return [True] * num_stages
    if mode == "never":
        return [False] * num_stages
    return [True] * (num_stages - 1) + [False]


def resolve_partitioner(partition: str | Sequence[int] | Partitioner) -> Partitioner:
    return partition if isinstance(partition, Partitioner) else Partitioner(partition)


def resolve_runtime(runtime: str | BaseRuntime | None, devices: Sequence[str]) -> list[BaseRuntime]:
    """One runtime per stage: an instance is shared, a name picks the registered class."""
    if isinstance(runtime, BaseRuntime):
        return [runtime] * len(devices)
    if runtime is None:
        return [runtime_registry.create(d) for d in devices]
    cls = runtime_registry.get_runtime_class(runtime)
    return [cls(d) for d in devices]


@dataclass
class AsyncRun:
    """What `Pipeline.train_async` returns: per-batch losses and each stage's measured staleness."""

    losses: list[torch.Tensor]
    staleness: list[Staleness]
    step: StepResult

    @property
    def max_staleness(self) -> int:
        return max(s.max for s in self.staleness)


class Pipeline:
    """Stages built from an ``nn.Sequential``, a schedule and a communicator.

    ``stages`` counts the pieces of the model; with ``virtual_stages=V`` each worker (rank) holds
    ``V`` of them, stage ``s`` on rank ``s % (stages // V)``. ``runner`` picks how the workers run
    the schedule (see `lightning_pipe.engine.runners`); ``schedule`` is a registered name, a
    `Schedule` subclass or a function returning per-rank action lists.
    """

    def __init__(
        self,
        module: nn.Module,
        stages: int,
        schedule: Any = "1f1b",
        partition: str | Sequence[int] | Partitioner = "params",
        devices: Sequence[str] | None = None,
        checkpoint: str = "except_last",
        runtime: str | BaseRuntime | None = None,
        timeout: float = 300.0,
        transport: str | Communicator = "local",
        autocast: AutocastSpec | None = None,
        sample: Any = None,
        coordinator_device: torch.device | None = None,
        virtual_stages: int = 1,
        runner: str = "parallel",
        backend: BackendArg = None,
        strict: bool = False,
    ) -> None:
        self.worker_of_stage = worker_of_stages(runner, stages, virtual_stages)
        ranks = stages // virtual_stages
        self.devices = [str(d) for d in (devices or ["cpu"] * stages)]
        if len(self.devices) == ranks != stages:  # one device per rank: its stages share it
            self.devices = [self.devices[s % ranks] for s in range(stages)]
        if len(self.devices) != stages:
            raise ConfigurationError(
                f"devices has {len(self.devices)} entries but stages={stages}; give one device per stage"
                + (f" or one per rank ({ranks})" if ranks != stages else "")
            )
        self.module = module
        self.virtual_stages = virtual_stages
        self.runner = runner
        self.schedule_factory = resolve_schedule(schedule)
        self.partitioner = resolve_partitioner(partition)
        self.checkpoint = checkpoint_flags(checkpoint, stages)
        self.runtimes = resolve_runtime(runtime, self.devices)
        self.timeout = float(timeout)
        self.autocast = autocast
        self.backend = resolve_backends(backend, stages, strict)
        self.coordinator_ops = CoordinatorOps(self.backend, stages - 1)  # op substitution in the loss
        self.communicator = _communicator(transport)
        self.shards: list[ShardedTask] = self.partitioner.partition(module, self.devices, sample)
        self.coordinator_device = coordinator_device or self.runtimes[-1].torch_device
        specs = []
        for worker in range(max(self.worker_of_stage) + 1):
            held = [s for s in range(stages) if self.worker_of_stage[s] == worker]
            runtimes = {s: self.runtimes[s] for s in held}
            shared = len({id(r) for r in runtimes.values()}) == 1
            specs.append(
                StageSpec(
                    rank=worker,
                    shards=[self.shards[s] for s in held],
                    num_stages=stages,
                    rank_of_stage=list(self.worker_of_stage),
                    checkpoint=self.checkpoint,
                    timeout=self.timeout,
                    runtime=runtimes[held[0]] if shared else runtimes,
                    autocast=autocast,
                    backend=self.backend,
                )
            )
        self.coordinator = Coordinator(
            self.communicator,
            specs,
            self.schedule_factory,
            self.timeout,
            self.coordinator_device,
            virtual_stages=virtual_stages,
            runner=runner,
        )
        self._started = False

    @property
    def balance(self) -> list[int]:
        return [len(shard.layers) for shard in self.shards]

    def start(self) -> Pipeline:
        if not self._started:
            self.coordinator.start()
            self._started = True
        return self

    def close(self) -> None:
        if self._started:
            self._started = False
            self.coordinator.close()

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def parameters_of_stages(self) -> list[nn.Parameter]:
        return [p for shard in self.shards for p in shard.module.parameters()]

    def execution_trace(self, reset: bool = False) -> ExecutionTrace:
        """Per stage: which backend ran its forwards and which substituted ops ran where."""
        per_rank = self.coordinator.call("execution_trace", reset)
        stages = ExecutionTrace(sorted((t for traces in per_rank for t in traces), key=lambda t: t.stage))
        trace = stages.merged(ExecutionTrace([self.coordinator_ops.trace]))
        if reset:
            self.coordinator_ops.trace.reset()
        return trace

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        criterion: Callable[[Any, Any], torch.Tensor],
        microbatches: int = 4,
        scaler: Any = None,
    ) -> StepResult:
        """One training step on a whole batch; gradients of the mean loss land on ``p.grad``.

        Microbatch ``i``'s loss is weighted by its share of the rows, so the gradients equal those
        of ``criterion(model(inputs), targets)`` for a mean-reduced criterion.
        """
        xs, ys = split(inputs, microbatches), split(targets, microbatches)
        rows = sum(_rows(x) for x in xs)

        def weighted(output: Any, label: tuple[int, Any]) -> torch.Tensor:
            index, target = label
            with self.coordinator_ops.context("train"):
                return criterion(output, target) * (_rows(xs[index]) / rows)

        result = self.coordinator.train_step(xs, list(enumerate(ys)), weighted, scaler)
        self.coordinator.call("apply_grads", 1.0)
        return result

    def train_async(
        self,
        batches: Iterable[tuple[Any, Any]],
        criterion: Callable[[Any, Any], torch.Tensor],
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        microbatches: int = 4,
        num_batches: int | None = None,
    ) -> AsyncRun:
        """Train on a stream of ``(inputs, targets)`` batches with ``schedule="async"``: no flush.

        Each stage owns ``optimizer(stage parameters)`` and steps it after every batch's worth of
        its backwards, on gradients taken with the weight version each microbatch's forward used
        (weight stashing); the parameters of the module are updated in place. ``num_batches``
        defaults to ``len(batches)``. Returns the mean loss of every batch and each stage's staleness.
        """
        count = num_batches if num_batches is not None else len(batches)  # type: ignore[arg-type]

        def pieces() -> Iterator[tuple[list[Any], list[Any]]]:
            for x, y in batches:
                xs, ys = split(x, microbatches), split(y, microbatches)
                rows = sum(_rows(piece) for piece in xs)
                yield xs, [(_rows(piece) / rows, target) for piece, target in zip(xs, ys, strict=True)]

        def weighted(output: Any, label: tuple[float, Any]) -> torch.Tensor:
            return criterion(output, label[1]) * label[0]

        result = self.coordinator.train_stream(pieces(), count, weighted, optimizer)
        per_batch = [sum(result.losses[b * microbatches : (b + 1) * microbatches]) for b in range(count)]
        staleness = [s for stats in self.coordinator.call("async_stats") for s in stats]
        return AsyncRun(losses=per_batch, staleness=sorted(staleness, key=lambda s: s.stage), step=result)

    def stash_peaks(self) -> list[int]:
        """Most bytes of stashed activations each worker held at once in the last training step."""
        return [int(peak) for peak in self.coordinator.call("stash_peak")]

    def forward(self, inputs: Any, microbatches: int = 1) -> Any:
        """Forward only, no autograd; outputs are concatenated in batch order."""
        from lightning_pipe.microbatch import gather

        result = self.coordinator.forward_step(split(inputs, microbatches))
        return gather(result.outputs)


def _communicator(transport: str | Communicator) -> Communicator:
    if isinstance(transport, Communicator):
        return transport
    try:
        return TRANSPORTS[transport]()
    except KeyError:
        known = ", ".join(sorted(TRANSPORTS))
        raise ConfigurationError(f"unknown transport {transport!r}; available: {known}") from None


def _rows(batch: Any) -> int:
    from lightning_pipe.microbatch import batch_size

    return batch_size(batch)
