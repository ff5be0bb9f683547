"""`ProcessGroups`: launched mode's process groups (a DeviceMesh ``data_parallel`` x ``pipeline``, with tensor
parallel x ``tensor_parallel``, and the coordinators').

A pipeline's P ranks carry its activations and gradients point to point (`lightning_pipe.comm.p2p`); the R
ranks of one stage average its gradients (`lightning_pipe.engine.replicas`, DDP; or shard it, FSDP); the
coordinators get a group of their own, so that Lightning's collectives never interleave with a stage's on
one group. With tensor parallel the T processes of a stage form the ``tensor_parallel`` dimension, innermost
(`lightning_pipe.strategy.tensor_parallel`); the mesh's dimensions carry Lightning's names (the replicas are
``data_parallel``), so that a LightningModule written for ``ModelParallelStrategy`` finds them.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_pipe.comm.p2p.socket_group import pipeline_socket
from lightning_pipe.comm.p2p.wire import close_open_wires
from lightning_pipe.strategy.layout import Layout
from lightning_pipe.strategy.tensor_parallel import MESH_DIMS

PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)  # Lightning's default: serving ranks wait this long between fits


def attempt_store(cluster_environment: Any, rank: int, world_size: int) -> dict[str, Any]:
    """``init_process_group``'s store for this attempt of a torchrun run (``{"store": ...}``; ``{}`` elsewhere): the
    run's store with every key under the attempt's number (``TORCHELASTIC_RESTART_COUNT``).

    Why: torchrun's static rendezvous (``--master-addr``/``--master-port``, its default without ``--rdzv-backend``)
    keeps one TCPStore in its agent for all the attempts of a run, and a worker's ``env://`` store is a client of it
    with no prefix of its own (torch's ``rendezvous._create_c10d_store`` assumes a new store per attempt). The process
    groups' keys are the same in every attempt (the default group's, and ``new_group``'s, numbered in creation order),
    so a restarted attempt's gloo rendezvous can read the addresses the failed attempt's processes left there and
    connect to ports nobody listens on any more ("connectFullMesh failed ... Connection refused"), or wait for a peer
    that is gone. Keys under the attempt's number are new in every attempt.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return {}
    os.environ["MASTER_ADDR"] = cluster_environment.main_address  # as Lightning's _init_dist_connection sets them
    os.environ["MASTER_PORT"] = str(cluster_environment.main_port)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=PROCESS_GROUP_TIMEOUT))
    return {"store": dist.PrefixStore(f"lightning_pipe/attempt-{restart}/", store)}


class ProcessGroups:
    """The groups of one layout, made once per process (every process makes them, in the same order).

    They serve every fit of the process, and Lightning's collectives between fits (a ``save_checkpoint``
    after ``fit``) run on the coordinators' group, so they live until the interpreter exits: then
    `destroy_all` (an ``atexit`` hook) closes the p2p links still open, destroys the groups and the default
    group if the strategy initialised it, as Lightning does for the NCCL group it initialises. Left to the
    interpreter's own teardown, gloo's threads and pending waits end in whatever order it finalizes.
    """

    _made: dict[tuple[int, int, int], ProcessGroups] = {}
    _default_made = False  # whether the strategy initialised the default group (then it destroys it)

    def __init__(self, layout: Layout, device_type: str) -> None:
        shape: tuple[int, ...] = (layout.replicas, layout.ranks_per_pipeline)
        if layout.tensor_parallel > 1:
            shape = (*shape, layout.tensor_parallel)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS[: len(shape)])
        self.mesh = mesh
        self.pipeline = mesh.get_group("pipeline")
        self.replicas = mesh.get_group("data_parallel")
        self.tensor = mesh.get_group("tensor_parallel") if layout.tensor_parallel > 1 else None  # a stage's T ranks
        self.coordinators = dist.new_group(layout.coordinator_ranks)
        #: gloo: the pipeline again, for the messages to lower pipeline ranks (`p2p.wire`: a link's two directions
        #: never share a gloo pair, whose lock a send waited for while the group's thread read); None under NCCL
        self.reverse = reverse_pipelines(mesh) if device_type == "cpu" else None
        #: a CPU pipeline of two processes on one machine: its link is their own TCP connection, cheaper a message than
        #: gloo's send and receive (`p2p.socket_group`, docs/overhead.md); None elsewhere, or where they cannot reach it
        self.socket = None
        if device_type == "cpu" and layout.ranks_per_pipeline == 2:
            self.socket = pipeline_socket(dist.get_process_group_ranks(self.pipeline))
        self._writes: dist.ProcessGroup | None = None

    def checkpoint_writes(self) -> dist.ProcessGroup:
        """A gloo group of every process for the collectives of checkpoints written in the background (made at the
        first ask, which every process makes at once: ``async_checkpoint``); nothing else uses it, so a write's
        collectives in its thread never interleave with a stage's on the same group."""
        if self._writes is None:
            self._writes = dist.new_group(backend="gloo")
        return self._writes

    @classmethod
    def of(cls, layout: Layout, device_type: str) -> ProcessGroups:
        key = (layout.world_size, layout.ranks_per_pipeline, layout.tensor_parallel)
        if key not in cls._made:
            if not cls._made:
                atexit.register(cls.destroy_all)
            cls._made[key] = cls(layout, device_type)
        return cls._made[key]

    @classmethod
    def made_default_group(cls) -> None:
        """Called right after the strategy initialised the default group."""
        cls._default_made = True

    def destroy(self) -> None:
        """Destroy this layout's groups (a dimension that spans the world is the default group: kept; a process
        outside the coordinators' group holds no such group)."""
        if self.socket is not None:
            self.socket.close()
        default = dist.distributed_c10d._get_default_group()
        groups = (self.pipeline, self.reverse, self.replicas, self.tensor, self.coordinators, self._writes)
        for group in {id(g): g for g in groups}.values():
            if isinstance(group, dist.ProcessGroup) and group is not default:
                dist.destroy_process_group(group)

    @classmethod
    def destroy_all(cls) -> None:
        """At exit: the p2p links closed (their threads joined), then every group made here destroyed."""
        close_open_wires()
        if not dist.is_initialized():
            return
        made, cls._made = list(cls._made.values()), {}
        for groups in made:
            groups.destroy()
        if cls._default_made:
            cls._default_made = False
            dist.destroy_process_group()


def reverse_pipelines(mesh: Any) -> Any:
    """This process's pipeline again, as a gloo group of its own (every process makes every pipeline's: ``new_group``
    is collective over the world; a process gets the group it is in)."""
    ranks = mesh.mesh  # global ranks by (data_parallel, pipeline[, tensor_parallel])
    pipelines = ranks.movedim(1, -1).reshape(-1, ranks.size(1)).tolist()
    me, mine = dist.get_rank(), None
    for pipeline in pipelines:
        group = dist.new_group(pipeline, backend="gloo")
        if me in pipeline:
            mine = group
    return mine
