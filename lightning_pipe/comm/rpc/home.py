"""The rank the coordinator's process holds itself under ``transport="rpc"``: the pipeline's last stage.

As in launched mode, the last stage's rank runs as a stage worker thread in the coordinator's process, on its
own device: its output and that output's gradient never cross processes, and it computes each microbatch's
loss itself. Its inputs and input gradients cross the world's data plane as any rank's do; the coordinator's
messages to it are handed over by reference. Where it cannot come (one rank holds every stage, its device is
not on this machine, ``colocate=False``) every rank runs in a worker process and the log says why
(docs/internals.md).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipe.base.errors import PipeError
from lightning_pipe.comm import by_value
from lightning_pipe.comm.base import COORDINATOR
from lightning_pipe.comm.rpc.endpoint import TransportStats
from lightning_pipe.comm.rpc.plane import DataPlane, is_cuda, world_rank
from lightning_pipe.comm.rpc.stages import build_stage, stage_ended, stage_stats, stop_stage


@dataclass(frozen=True)
class RankProcesses:
    """Which process serves each pipeline rank of one launch: ``home`` in the coordinator's, the others in the
    world's slots in order (slot k serves the k-th of `remote`: rank r by slot r when the home rank is the last,
    ranks 1.. by slots 0.. when it is rank 0, as a V-shaped schedule places the last stage)."""

    ranks: int
    home: int | None  # the rank the coordinator's process holds (the last stage's), None: every rank in a worker
    why_not: str = ""  # why no rank is home

    @property
    def remote(self) -> list[int]:
        """The ranks served by worker processes, in the order of the slots that serve them."""
        return [rank for rank in range(self.ranks) if rank != self.home]

    def rank_of_slot(self, slot: int | None) -> int | None:
        """The pipeline rank slot ``slot`` serves in this launch (None: it serves none)."""
        remote = self.remote
        return remote[slot] if slot is not None and 0 <= slot < len(remote) else None

    def processes(self) -> dict[int, int]:
        """The world rank of every pipeline rank of this launch, and of the coordinator (world rank 0, with the
        home rank); a slot's world rank is `rpc.plane.world_rank` of its index."""
        home = {self.home: 0} if self.home is not None else {}
        return {COORDINATOR: 0} | home | {rank: world_rank(slot) for slot, rank in enumerate(self.remote)}

    def address_book(self, names: dict[int, str], hosts: dict[int, str]) -> tuple[dict[int, str], dict[int, str]]:
        """The RPC names and places of the ranks for this launch, from the world's by slot: the home rank is the
        coordinator's process (its RPC name, and how errors name it)."""
        by_rank, where = {COORDINATOR: names[COORDINATOR]}, {COORDINATOR: hosts[COORDINATOR]}
        for slot, rank in enumerate(self.remote):
            by_rank[rank], where[rank] = names[slot], hosts[slot]
        if self.home is not None:
            by_rank[self.home], where[self.home] = names[COORDINATOR], coordinator_host()
        return by_rank, where

    def slot_values(self, values: Sequence[Any]) -> dict[int, Any]:
        """``values`` given by slot (a device, a pid), by the pipeline rank each slot serves."""
        return {rank: values[slot] for slot, rank in enumerate(self.remote) if slot < len(values)}

    def describe(self, stages_of: dict[int, list[int]], device: str) -> str:
        """Which process holds which rank, for the log."""

        def stages(rank: int) -> str:
            held = stages_of.get(rank, [])
            return ("stages " if len(held) > 1 else "stage ") + ", ".join(map(str, held))

        remote = "; ".join(f"rank {r} ({stages(r)}) in worker process {k}" for k, r in enumerate(self.remote))
        if self.home is None:
            return f"every rank in a worker process ({self.why_not}): {remote}"
        here = f"rank {self.home} ({stages(self.home)}) in the coordinator's process on {device}, with the last stage"
        return f"{here}; {remote}" if remote else here


def place(specs: Sequence[Any], colocate: bool) -> RankProcesses:
    """Whether the coordinator's process holds the rank of the last stage for ``specs``, and if not, why."""
    ranks = len(specs)
    last = specs[0].rank_of_stage[-1] if specs else 0
    if not colocate:
        return RankProcesses(ranks, None, "colocate=False")
    if ranks < 2:
        return RankProcesses(ranks, None, "one rank holds every stage: it runs apart from the coordinator")
    missing = [str(shard.device) for shard in specs[last].shards if not usable_here(str(shard.device))]
    if missing:
        return RankProcesses(ranks, None, f"this process cannot use {', '.join(missing)}")
    return RankProcesses(ranks, last)


def moved_devices(specs: Sequence[Any], served: RankProcesses, slot_devices: Sequence[str]) -> list[str]:
    """The ranks whose stage is on another CUDA device than the slot now serving it was started for (a pool's
    earlier pipeline mapped its slots to other ranks): their tensors cross devices on every send."""
    moved = []
    for rank, device in served.slot_values(slot_devices).items():
        wanted = device_of(specs[rank])
        if wanted != device and (is_cuda(wanted) or is_cuda(device)):
            moved.append(f"rank {rank} (on {wanted}) in the worker started for {device}")
    return moved


def device_of(spec: Any) -> str:
    """The device of a rank's stage (its first shard's; a rank without shards: the CPU)."""
    return str(spec.shards[0].device) if spec.shards else "cpu"


def usable_here(device: str) -> bool:
    """Whether this process can place a stage on ``device`` (a CUDA index this machine has; other types: yes)."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return True
    return torch.cuda.is_available() and int(index or 0) < torch.cuda.device_count()


def home_device(specs: Sequence[Any], served: RankProcesses) -> str | None:
    """The device of the stage the coordinator's process holds (its first shard's), None if it holds none."""
    if served.home is None or not specs[served.home].shards:
        return None
    return str(specs[served.home].shards[0].device)


def coordinator_host() -> str:
    """How errors name the coordinator's process, as `control.Slot.where` names a worker's."""
    return f"{socket.gethostname()} (the coordinator's process, pid {os.getpid()})"


class HomeStage:
    """The stage worker of the rank the coordinator's process holds: built, watched and stopped here."""

    def __init__(self, launch: str, rank: int) -> None:
        self.launch = launch
        self.rank = rank

    def build(
        self,
        spec: Any,
        worker_cls: Any,
        names: dict[int, str],
        hosts: dict[int, str],
        codec: Any,
        plane: DataPlane | None,
        processes: dict[int, int],
        threads: int | None,
    ) -> None:
        """Build the stage from a copy of ``spec`` (it owns its parameters, as a worker's would) and serve it;
        raises `StageError` naming the stage and this process if the build fails."""
        spec = by_value.copy(spec)
        if threads is not None and all(str(shard.device) == "cpu" for shard in spec.shards):
            spec.options["num_threads"] = threads  # the thread's intra-op pool, as a worker process's
        codec = by_value.copy(codec)
        built, value = build_stage(self.launch, spec, worker_cls, names, hosts, None, codec, processes, plane)
        if not built:
            raise value from None  # its message holds the traceback

    def ended(self) -> PipeError | None:
        """Why its event loop ended unasked: its crash's `StageError` (None while it runs)."""
        return stage_ended(self.launch, self.rank)

    def stats(self, reset: bool) -> TransportStats:
        return stage_stats(self.launch, self.rank, reset)

    def stop(self, timeout: float) -> bool:
        """Stop its event loop; True once its thread ended within ``timeout``."""
        return stop_stage(self.launch, self.rank, timeout)
