"""`PipelineInputs`: how a call of the pipelined module becomes the first stage's input, per microbatch.

A traced module's call ``module(*args, **kwargs)`` is packed into the tensors its first stage takes (and the
last stage's output unpacked into what the module returns); an ``nn.Sequential`` takes its one input as is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_pipe.comm import Communicator
from lightning_pipe.engine import Coordinator
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.microbatch import split
from lightning_pipe.partition import Partitioner, ShardedTask
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.partition.tracer import CallArgs


class PipelineInputs:
    """Mixed into `Pipeline`: ``pack``, ``unpack`` and the split of a batch into microbatch inputs."""

    partitioner: Partitioner
    communicator: Communicator
    shards: list[ShardedTask]

    if TYPE_CHECKING:

        @property
        def traced(self) -> bool: ...

        @property
        def coordinator(self) -> Coordinator: ...

        def build(self, sample: Any = None) -> Any: ...

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        """The first stage's input for the call ``module(*args, **kwargs)``."""
        if self.traced:
            call = CallArgs(tuple(args), dict(kwargs or {}))
            self.build(call)
            partitioner: TracedPartitioner = self.partitioner  # type: ignore[assignment]
            known, state = len(partitioner.variants), self._shard_state()
            packed = partitioner.pack(call.args, call.kwargs)
            if len(partitioner.variants) > known and self.communicator.stages_own_parameters:
                self._install_variants(partitioner, known, state)
            return packed
        if kwargs:
            raise ConfigurationError(
                f"the pipelined nn.Sequential was called with keyword arguments ({', '.join(kwargs)}); "
                "an nn.Sequential takes one input (pass split_points=... to trace a module with keyword arguments)"
            )
        return args[0] if len(args) == 1 else tuple(args)

    def _shard_state(self) -> list[set[str]]:
        """Per shard, the names of its submodules, parameters and buffers."""
        if not self.communicator.stages_own_parameters:
            return []
        return [
            {n for n, _ in shard.module.named_modules(remove_duplicate=False) if n}
            | {n for n, _ in shard.module.named_parameters(remove_duplicate=False)}
            | {n for n, _ in shard.module.named_buffers(remove_duplicate=False)}
            for shard in self.shards
        ]

    def _install_variants(self, partitioner: TracedPartitioner, first: int, before: list[set[str]]) -> None:
        """Send the stages (in other processes) the code of the call variants traced since ``first``."""
        updates: list[dict[int, Any]] = [{} for _ in range(self.coordinator.num_ranks)]
        for shard, held, now in zip(self.shards, before, self._shard_state(), strict=True):
            for variant in range(first, len(partitioner.variants)):
                sources, constants = partitioner.variant_update(shard.index, variant)
                new = sorted(n for n in now - held if not any(n == c or c.startswith(n + ".") for c in constants))
                if new:
                    raise ConfigurationError(
                        f"the pipelined module was called in a new way that makes stage {shard.index} use "
                        f"{', '.join(new[:5])}, which its worker process does not hold; call it the same way every "
                        "time, or build the pipeline on a call of each way first"
                    )
                updates[self.coordinator.rank_of_stage[shard.index]].setdefault(shard.index, []).append(
                    (variant, sources, constants)
                )
        self.coordinator.call("install_variants", each=[(own,) for own in updates])

    def unpack(self, output: Any) -> Any:
        """The module's output (tensor, tuple, dict...) from the last stage's output."""
        return self.partitioner.unpack(output) if self.traced else output  # type: ignore[attr-defined]

    def _microbatches(self, inputs: Any, kwargs: dict[str, Any] | None, microbatches: int) -> list[Any]:
        """The first stage's input for each microbatch; builds the pipeline on the first one."""
        if not self.traced and not kwargs:
            xs = split(inputs, microbatches)
            self.build(xs[0])
            return xs
        call = CallArgs.of(inputs)
        pieces = split((call.args, dict(kwargs or {})), microbatches)
        return [self.pack(args, kw) for args, kw in pieces]
