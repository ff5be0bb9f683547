"""`train_batches`: a stream of whole batches through ``schedule="async"`` (`Pipeline.train_async`).

Each batch is cut into its microbatches with their weights as a training step's is (``labelled``); the stream
itself (no flush, each stage stepping its own optimizer on the weight version each microbatch's forward used) is
the engine's `lightning_pipe.engine.stream.train_stream`. What comes back is per batch: its mean loss, and each
stage's staleness.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.engine import Coordinator, StageProtocol
from lightning_pipe.engine.loss import WeightedLoss
from lightning_pipe.engine.stream import AsyncRun, train_stream

#: a batch's inputs and targets -> its microbatches' inputs and (weight, target) labels (`PipelineInputs.labelled`)
Labelled = Callable[[Any, Any], tuple[list[Any], list[Any]]]


def train_batches(
    coordinator: Callable[[], Coordinator],
    batches: Iterable[tuple[Any, Any]],
    labelled: Labelled,
    criterion: WeightedLoss,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    microbatches: int,
    num_batches: int | None,
) -> AsyncRun:
    """Train on ``batches`` (``num_batches`` of them, default ``len(batches)``) without a flush. ``coordinator`` is
    asked for after the first batch is cut: cutting it builds a pipeline that was not built yet."""
    count = num_batches if num_batches is not None else len(batches)  # type: ignore[arg-type]

    def pieces() -> Iterator[tuple[list[Any], list[Any]]]:
        for x, y in batches:
            yield labelled(x, y)

    stream = pieces()
    first = next(stream, None)  # builds the pipeline
    if first is None:
        raise ConfigurationError("train_async needs at least one batch")
    engine = coordinator()
    result = train_stream(engine, itertools.chain([first], stream), count, criterion, optimizer)
    per_batch = [sum(result.losses[b * microbatches : (b + 1) * microbatches]) for b in range(count)]
    staleness = [s for stats in engine.stages.call(StageProtocol.async_stats) for s in stats]
    return AsyncRun(losses=per_batch, staleness=sorted(staleness, key=lambda s: s.stage), step=result)
