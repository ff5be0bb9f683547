"""Which partitioner splits a module: the one given, or a `TracedPartitioner` where the module needs tracing."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_pipe.base.errors import PartitionError
from lightning_pipe.partition.partitioner import Partitioner
from lightning_pipe.partition.traced import TracedPartitioner


def resolve_partitioner(
    partition: str | Sequence[int] | Partitioner,
    module: nn.Module | None = None,
    split_points: Sequence[str] | None = None,
) -> Partitioner:
    """A partitioner instance; a `TracedPartitioner` for split points or a module that is not nn.Sequential."""
    partitioner = partition if isinstance(partition, Partitioner) else Partitioner(partition)
    return for_module(partitioner, module, split_points)


def for_module(
    partitioner: Partitioner, module: nn.Module | None = None, split_points: Sequence[str] | None = None
) -> Partitioner:
    """``partitioner``, or a `TracedPartitioner` with its method when the module needs tracing.

    A module that is not an ``nn.Sequential``, or any module with ``split_points``, is traced; a
    custom `Partitioner` subclass is kept as it is.
    """
    if isinstance(partitioner, TracedPartitioner):
        if split_points is not None and partitioner.split_points != list(split_points):
            if partitioner.split_points is not None:
                raise PartitionError(
                    f"split_points={list(split_points)} conflicts with the partitioner's {partitioner.split_points}"
                )
            partitioner.split_points = list(split_points)
        return partitioner
    wants_trace = split_points is not None or (module is not None and not isinstance(module, nn.Sequential))
    if not wants_trace or type(partitioner) is not Partitioner:
        return partitioner
    return TracedPartitioner(
        partitioner.method,
        split_points,
        forward_cls=partitioner.forward_cls,
        backward_cls=partitioner.backward_cls,
        forward_loss_cls=partitioner.forward_loss_cls,
    )
