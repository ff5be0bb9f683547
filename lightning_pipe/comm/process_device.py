"""Where things of a process live: a stage built there (its own device), its point-to-point tensors, its peers' ranks.

A `StageSpec` is made in the coordinator's process, whose shards name the coordinator's idea of a
device. A worker process places them on the device it was given (an RPC slot's offer, or in
launched mode the current CUDA device of the process) before the stage worker is built.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def retarget(spec: Any, device: str) -> None:
    """Place a spec's shards (and its runtime, or the runtime of each of its stages) on ``device``."""
    for shard in spec.shards:
        shard.device = device
    runtime = spec.runtime
    if isinstance(runtime, dict):  # several stages in one worker (virtual stages), a runtime each
        spec.runtime = {index: _on(each, device) for index, each in runtime.items()}
    elif runtime is not None:
        spec.runtime = _on(runtime, device)


def _on(runtime: Any, device: str) -> Any:
    """``runtime``, or one of its class and config on ``device``."""
    return runtime if runtime.device_spec == device else type(runtime)(device, runtime.config)


def process_device(backend: str, device: str | None = None) -> torch.device:
    """Where a process's point-to-point tensors live under ``backend``: under NCCL ``device`` (default: the
    process's current CUDA device), else the CPU."""
    if "nccl" in backend.lower():
        return torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_ranks_of(group: Any, ranks: list[int]) -> list[int]:
    """The rank in ``group`` (a group of the default world; None: the default group) of each global rank."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(ranks)
    return [dist.get_group_rank(group, rank) for rank in ranks]
