"""`PipelineInputs`: how a call of the pipelined module becomes the first stage's input, per microbatch.

A traced module's call ``module(*args, **kwargs)`` is packed into the tensors its first stage takes (and the
last stage's output unpacked into what the module returns); an ``nn.Sequential`` takes its one input as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.base.microbatch import split
from lightning_pipe.base.microbatch_weights import MicrobatchWeight, shares
from lightning_pipe.partition import Partitioner
from lightning_pipe.partition.traced import TracedPartitioner
from lightning_pipe.partition.tracer import CallArgs
from lightning_pipe.pipeline.stage_state import StageState


class PipelineInputs:
    """``pack``, ``unpack`` and the split of a batch into microbatch inputs.

    ``build(sample)`` builds the pipeline on its first call (a traced module is partitioned on it) and
    returns the stages' state, which receives the code of each new way of calling a traced module.
    """

    def __init__(self, partitioner: Partitioner, build: Callable[[Any], StageState]) -> None:
        self.partitioner = partitioner
        self.build = build

    @property
    def traced(self) -> TracedPartitioner | None:
        """The partitioner, where the module is split through its traced graph (inputs and outputs are packed)."""
        return self.partitioner if isinstance(self.partitioner, TracedPartitioner) else None

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        """The first stage's input for the call ``module(*args, **kwargs)``."""
        partitioner = self.traced
        if partitioner is not None:
            call = CallArgs(tuple(args), dict(kwargs or {}))
            stages = self.build(call)
            known, held = len(partitioner.variants), stages.held_names()
            packed = partitioner.pack(call.args, call.kwargs)
            if len(partitioner.variants) > known:
                stages.install_variants(partitioner, known, held)
            return packed
        if kwargs:
            raise ConfigurationError(
                f"the pipelined nn.Sequential was called with keyword arguments ({', '.join(kwargs)}); "
                "an nn.Sequential takes one input (pass split_points=... to trace a module with keyword arguments)"
            )
        return args[0] if len(args) == 1 else tuple(args)

    def unpack(self, output: Any) -> Any:
        """The module's output (tensor, tuple, dict...) from the last stage's output."""
        partitioner = self.traced
        return partitioner.unpack(output) if partitioner is not None else output

    def labelled(
        self,
        inputs: Any,
        targets: Any,
        kwargs: dict[str, Any] | None,
        microbatches: int,
        weight: MicrobatchWeight | None,
        argument: str,
    ) -> tuple[list[Any], list[tuple[Any, Any]]]:
        """Each microbatch's input (`microbatches`) and its label ``(weight, target)``.

        A microbatch's weight is its share of the rows, or of ``weight(target)`` summed over the batch
        (`microbatch_weights.shares`; ``argument`` names the option in errors).
        """
        xs, ys = self.microbatches(inputs, kwargs, microbatches), split(targets, microbatches)
        weights = shares(xs if weight is None else ys, weight, argument)
        return xs, list(zip(weights, ys, strict=True))

    def microbatches(self, inputs: Any, kwargs: dict[str, Any] | None, microbatches: int) -> list[Any]:
        """The first stage's input for each microbatch; builds the pipeline on the first one."""
        if self.traced is None and not kwargs:
            xs = split(inputs, microbatches)
            self.build(xs[0])
            return xs
        call = CallArgs.of(inputs)
        pieces = split((call.args, dict(kwargs or {})), microbatches)
        return [self.pack(args, kw) for args, kw in pieces]
