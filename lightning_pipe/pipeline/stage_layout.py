"""Where a pipeline's stages run: a device and a runtime per stage, and the spec each stage worker is built from.

A worker (a rank) holds one stage, or ``virtual_stages`` of them (`engine.runners.worker_of_stages` says
which); its spec (`StageSpec`) lists its shards and how to run them, and is all it needs to build itself,
in a thread of this process or in a worker process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.engine import AutocastSpec, StageSpec
from lightning_pipe.partition import ShardedTask
from lightning_pipe.runtime import BaseRuntime, runtime_registry
from lightning_pipe.schedule import LOOP, stage_ranks


def stage_devices(devices: Sequence[Any] | None, stages: int, ranks: int, placement: str = LOOP) -> list[str]:
    """One device per stage: ``devices`` per stage, or one per rank (its stages share it, placed by the schedule's
    ``placement``); all ``cpu`` if None."""
    found = [str(d) for d in (devices or ["cpu"] * stages)]
    if len(found) == ranks != stages:  # one device per rank: its stages share it
        found = [found[rank] for rank in stage_ranks(placement, stages, ranks)]
    if len(found) != stages:
        raise ConfigurationError(
            f"devices has {len(found)} entries but stages={stages}; give one device per stage"
            + (f" or one per rank ({ranks})" if ranks != stages else "")
        )
    return found


def resolve_runtime(runtime: str | BaseRuntime | None, devices: Sequence[str]) -> list[BaseRuntime]:
    """One runtime per stage: an instance is shared, a name picks the registered class."""
    if isinstance(runtime, BaseRuntime):
        return [runtime] * len(devices)
    if runtime is None:
        return [runtime_registry.create(d) for d in devices]
    cls = runtime_registry.get_runtime_class(runtime)
    return [cls(d) for d in devices]


def worker_specs(
    shards: Sequence[ShardedTask],
    worker_of_stage: Sequence[int],
    runtimes: Sequence[BaseRuntime],
    checkpoint: list[bool | None],
    timeout: float,
    autocast: AutocastSpec | None,
    backend: Any,
    seed: int,
    init: Any = None,
) -> list[StageSpec]:
    """Each worker's spec: the shards of the stages it holds, their runtimes, and how to run them."""
    stages = len(shards)
    specs = []
    for worker in range(max(worker_of_stage) + 1):
        held = [s for s in range(stages) if worker_of_stage[s] == worker]
        chosen = {s: runtimes[s] for s in held}
        shared = len({id(r) for r in chosen.values()}) == 1
        specs.append(
            StageSpec(
                rank=worker,
                shards=[shards[s] for s in held],
                num_stages=stages,
                rank_of_stage=list(worker_of_stage),
                checkpoint=checkpoint,
                timeout=timeout,
                runtime=chosen[held[0]] if shared else chosen,
                autocast=autocast,
                backend=backend,
                seed=seed,
                init=init.for_shards(shards[s].module for s in held) if init is not None else None,
            )
        )
    return specs
