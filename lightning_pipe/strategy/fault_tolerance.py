"""Replica groups that survive a lost process, on torchft (``PipeStrategy(fault_tolerance=...)``).

With fault tolerance each pipeline replica is a torchft replica group: one torchrun of S processes (one per stage),
launched mode with one replica inside it. Every process holds a ``torchft.Manager`` (its group rank and world are
its rank in the torchrun); stage ``s`` of every group averages its gradients with stage ``s`` of the others over
torchft's managed process group (`lightning_pipe.engine.quorum_replicas`), in the quorum a Lighthouse keeps. A group
that loses a process drops out of the quorum and the others go on; restarted (torchrun ``--max-restarts``), it joins
at the next quorum and takes each stage's parameters, optimizer state and generators, and on its coordinator
Lightning's step count, LR schedulers and learning rates, from the same rank of a live group (the Manager's state
callbacks, here). torchft is an optional extra, imported when a run asks for it (docs/faults.md).
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.base.errors import ConfigurationError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the Lighthouse's address
GROUP_ENV = "REPLICA_GROUP_ID"  # which replica group this torchrun is (0 .. groups - 1)
GROUPS_ENV = "NUM_REPLICA_GROUPS"  # how many groups the run has at most (the data's shards)


@dataclass(frozen=True)
class FaultTolerance:
    """Where this torchrun's replica group stands in a fault-tolerant run (``PipeStrategy(fault_tolerance=...)``).

    Args:
        replica_group: this group's number, 0 .. ``replica_groups`` - 1, the same in every restart (default
            ``$REPLICA_GROUP_ID``).
        replica_groups: how many replica groups the run has when all are up (default ``$NUM_REPLICA_GROUPS``):
            the data is cut into that many shards, group ``i`` reads shard ``i``.
        lighthouse: the Lighthouse's address, ``http://host:port`` (default ``$TORCHFT_LIGHTHOUSE``).
        min_replica_groups: a step commits only with at least this many groups in its quorum.
        timeout: seconds a collective, a commit or a healing transfer may take before torchft gives up the step.
        quorum_timeout: seconds a process waits for a quorum (the first one waits for the other groups to start).
    """

    replica_group: int | None = None
    replica_groups: int | None = None
    lighthouse: str | None = None
    min_replica_groups: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 120.0

    def resolve(self) -> FaultTolerance:
        """These settings with the environment's defaults filled in, checked; a missing one raises naming it."""
        group = self.replica_group if self.replica_group is not None else _env_int(GROUP_ENV, "replica_group")
        groups = self.replica_groups if self.replica_groups is not None else _env_int(GROUPS_ENV, "replica_groups")
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if lighthouse is None:
            raise ConfigurationError(
                f"fault_tolerance needs the Lighthouse's address: FaultTolerance(lighthouse='http://host:29510') or "
                f"${LIGHTHOUSE_ENV} (start one with: torchft_lighthouse --min_replicas 1)"
            )
        if not 0 <= group < groups:
            raise ConfigurationError(f"FaultTolerance(replica_group={group}) is not in 0 .. replica_groups - 1 = "
                                     f"{groups - 1}")  # fmt: skip
        if self.min_replica_groups < 1 or self.min_replica_groups > groups:
            raise ConfigurationError(
                f"FaultTolerance(min_replica_groups={self.min_replica_groups}) must be 1 .. replica_groups ({groups})"
            )
        return FaultTolerance(group, groups, lighthouse, self.min_replica_groups, self.timeout, self.quorum_timeout)


def fault_tolerance_of(value: Any) -> FaultTolerance | None:
    """``PipeStrategy(fault_tolerance=...)`` as settings: None or False (off), True (all from the environment), a
    `FaultTolerance` or a dict of its arguments. torchft must be importable (it is imported here, once)."""
    if value is None or value is False:
        return None
    if value is True:
        value = FaultTolerance()
    elif isinstance(value, dict):
        value = FaultTolerance(**value)
    elif not isinstance(value, FaultTolerance):
        raise ConfigurationError(
            f"fault_tolerance={value!r}: pass True (settings from the environment), a lightning_pipe.FaultTolerance "
            "or a dict of its arguments"
        )
    torchft()
    return value


def torchft() -> Any:
    """The torchft module, or an error that says how to install it."""
    try:
        return importlib.import_module("torchft")
    except ImportError as error:
        raise ConfigurationError(
            f"PipeStrategy(fault_tolerance=...) runs on torchft, which is not installed here ({error}): "
            'pip install -e ".[ft]" (or pip install torchft)'
        ) from error


class ReplicaGroup:
    """This process's place in the fault-tolerant run: its torchft Manager, and the state a healing process takes.

    Made by `TorchftGroups.connect` (launched mode's `connect`) in every process (after the torchrun's default group
    exists). The engine sees it as the manager of `QuorumReplicas` (``start_quorum``, ``allreduce``,
    ``should_commit``); every step's quorum that holds fewer groups than the run has is said on the coordinator (the
    global batch shrank).
    """

    def __init__(self, settings: FaultTolerance, rank: int, world: int, device: torch.device, coordinates: bool):
        ft = torchft()
        self.settings = settings
        self.worker: Any = None  # this process's stage worker (`attach`)
        self.trainer: Any = None  # the coordinator's Trainer (`follow`)
        self._said: int | None = None  # the group count last said
        timeout = timedelta(seconds=settings.timeout)
        group = ft.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ft.ProcessGroupGloo(timeout=timeout)
        host, port = _manager_store(rank)
        self.manager = ft.Manager(
            pg=group, load_state_dict=None, state_dict=None, min_replica_size=settings.min_replica_groups,
            use_async_quorum=False,  # `QuorumReplicas.begin`: a joining group heals before its step's forwards
            timeout=timeout, quorum_timeout=timedelta(seconds=settings.quorum_timeout), connect_timeout=timeout,
            rank=rank, world_size=world, store_addr=host, store_port=port, lighthouse_addr=settings.lighthouse,
            replica_id=f"lightning_pipe_{settings.replica_group}",
        )  # fmt: skip
        self.manager.register_state_dict_fn("stage", self._load_stage, self._stage_state)
        if coordinates:
            self.manager.register_state_dict_fn("lightning", self._load_lightning, self._lightning_state)
        self.coordinates = coordinates
        atexit.register(self.manager.shutdown, wait=False)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._torn_down)  # Lightning's own SIGTERM handler calls this one too

    def _torn_down(self, signum: int, frame: Any) -> None:
        """SIGTERM: torchrun ends this group because one of its processes died. Stop heartbeating at once, so the
        Lighthouse drops this group and the others go on, and end: Lightning's handler alone only notes the signal,
        and a process waiting for its lost peer would keep the group in the quorum until torchrun's SIGKILL (30 s
        later; measured: the survivors' next step 31 s after the kill, against 1 s)."""
        self.manager.shutdown(wait=False)
        os._exit(128 + signum)

    # what `QuorumReplicas` calls, every stage process, every training step
    def start_quorum(self) -> None:
        self.manager.start_quorum()

    def allreduce(self, tensor: torch.Tensor) -> Any:
        return self.manager.allreduce(tensor)

    def should_commit(self) -> bool:
        committed = bool(self.manager.should_commit())
        groups = self.manager.num_participants()
        if self.coordinates and groups != self._said:
            total = self.settings.replica_groups
            change = "is" if self._said is None else "shrank to" if groups < self._said else "grew to"
            rank_zero_info(
                f"PipeStrategy fault tolerance: {groups} of {total} replica groups in the quorum at torchft step "
                f"{self.manager.current_step()}: the global batch {change} {groups} group(s)' batches"
            )
            self._said = groups
        return committed

    # the state a healing process takes from a live one (the same group rank of another group)
    def attach(self, worker: Any) -> None:
        """This process's stage worker: it averages over the quorum, and its state heals a peer's."""
        self.worker = worker
        worker.join_quorum(self)

    def follow(self, trainer: Any) -> None:
        """The coordinator's Trainer: its step count and LR schedulers heal a peer's."""
        self.trainer = trainer

    def _stage_state(self) -> dict[str, Any]:
        state = self.worker.state
        return {
            "model": state.call_state_dict(),
            "optimizer": state.call_optimizer_state() if state.has_optimizer() else None,
            "random": state.call_random_state(),
        }

    def _load_stage(self, stage: dict[str, Any]) -> None:
        state = self.worker.state
        state.call_load_state_dict(stage["model"])
        if stage["optimizer"] is not None:
            state.call_load_optimizer_state(stage["optimizer"]["state"], stage["optimizer"]["param_groups"])
        state.call_load_random_state(stage["random"])

    def _lightning_state(self) -> dict[str, Any]:
        return lightning_progress(self.trainer)

    def _load_lightning(self, state: dict[str, Any]) -> None:
        before = self.trainer.global_step
        load_lightning_progress(self.trainer, state)
        rank_zero_info(
            f"PipeStrategy fault tolerance: replica group {self.settings.replica_group} healed from a live group: "
            f"its stages' parameters, optimizer state and generators, step {before} -> {self.trainer.global_step}"
        )


def lightning_progress(trainer: Any) -> dict[str, Any]:
    """What a coordinator's Trainer gives a healing group: the optimizer step counts (Lightning's global step), the LR
    schedulers' states and the optimizers' hyperparameters (the learning rates they set)."""
    loop = trainer.fit_loop.epoch_loop
    return {
        "automatic": loop.automatic_optimization.optim_progress.state_dict(),
        "manual": loop.manual_optimization.optim_step_progress.state_dict(),
        "batches_that_stepped": loop._batches_that_stepped,
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "hparams": [
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in trainer.optimizers
        ],  # fmt: skip
    }


def load_lightning_progress(trainer: Any, state: dict[str, Any]) -> None:
    """`lightning_progress` of a live group's coordinator, taken into this one's Trainer (during a training step: it
    then counts this step from the live group's count)."""
    loop = trainer.fit_loop.epoch_loop
    loop.automatic_optimization.optim_progress.load_state_dict(state["automatic"])
    loop.manual_optimization.optim_step_progress.load_state_dict(state["manual"])
    loop._batches_that_stepped = state["batches_that_stepped"]
    for config, scheduler in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
        config.scheduler.load_state_dict(scheduler)
    for optimizer, groups in zip(trainer.optimizers, state["hparams"], strict=True):
        for group, values in zip(optimizer.param_groups, groups, strict=True):
            group.update(values)


def _manager_store(rank: int) -> tuple[str, int]:
    """A TCPStore of this attempt for the Manager (rank 0 serves it): torchrun's store keeps the failed attempt's
    manager address under torchft's fixed key, which a restarted rank could read before rank 0 wrote the new one."""
    box: list[Any] = [None]
    if rank == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # torchrun's: where the group's rank 0 is reached
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _stores.append(store)
        box = [(host, store.port)]
    dist.broadcast_object_list(box, src=0)
    host, port = box[0]
    return str(host), int(port)


_stores: list[Any] = []  # the Managers' stores this process serves: alive as long as the process


def _env_int(name: str, argument: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ConfigurationError(f"fault_tolerance needs {argument}: FaultTolerance({argument}=...) or ${name}")
    return int(value)
