"""`PipeConfig`: `PipeStrategy`'s arguments, validated once and frozen, handed to every part that reads them.

One definition: the arguments shared with `Pipeline` are `PipelineSettings`' fields, the strategy's own are
`PipeConfig`'s, each a field with its docstring. `PipeStrategy`'s signature is made from these fields
(`lightning_pipe.pipeline.settings.signature_of`), `check_arguments` takes the config, and the builder hands the
config to `Pipeline` as its settings: adding an argument is adding one field (and its row in docs/usage.md's table,
which `tests/test_house_config.py` holds to the fields).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lightning_pipe.base.microbatch_weights import MicrobatchWeight
from lightning_pipe.pipeline.settings import PipelineSettings
from lightning_pipe.strategy.arguments import (
    check_arguments,
    check_memory_arguments,
    check_split_points,
    streams,
)
from lightning_pipe.strategy.fault_tolerance import fault_tolerance_of
from lightning_pipe.strategy.tensor_parallel import check_tensor_parallel_arguments


@dataclass(frozen=True)
class PipeConfig(PipelineSettings):
    """The user's arguments of one `PipeStrategy` (its keywords but Lightning's own), checked: the arguments it
    shares with `Pipeline` (`PipelineSettings`, each described there) and these of the strategy's own."""

    microbatches: int | str = 4
    """How many pieces each batch is cut into (along dimension 0); ``"auto"`` with ``schedule="auto"``: chosen with the
    schedule."""
    module: str | None = None
    """Attribute path of the pipelined module in the LightningModule; default: the child with the most parameters."""
    transport: str | None = None
    """``None`` (the default): launched mode when the Trainer runs more than one process (``devices x num_nodes > 1``
    or a launcher's ``WORLD_SIZE > 1``: R pipeline replicas of the stages, one process per stage and device,
    activations point to point over torch.distributed, gradients averaged over the replicas; see
    `lightning_pipe.strategy.layout`), else ``"local"``. ``"local"``: stages are threads of this process, on the
    Trainer's devices. ``"rpc"``: stage worker processes (one per stage on this machine, or ``lightning-pipe
    worker`` processes that join ``coordinator``); see `lightning_pipe.comm.rpc`. ``"p2p"``: launched mode in any
    case."""
    trace: Any = None
    """A path for the Chrome trace (pipeline timeline) of training steps 1-3, or a `PipeTrace` (chosen steps, a PNG
    Gantt chart). In launched mode with several coordinators (replicas, tensor ranks) each writes its pipeline's to
    ``<stem>-rank<global rank><suffix>``."""
    microbatch_weight: MicrobatchWeight | None = None
    """A function of a microbatch (what the step receives) returning its weight, a number or 0-d tensor; default: its
    rows. Losses, ``self.log`` values and the step's returned values combine with the weights normalised over the
    batch: return what the loss averages over, e.g. ``lambda b: (b["labels"][:, 1:] != -100).sum()`` for a causal
    LM's labelled tokens. A microbatch of weight 0 adds nothing, not even its loss's gradient."""
    data_parallel: str = "ddp"
    """Launched mode with several replicas: ``"ddp"`` (each replica holds its whole stage, gradients averaged) or
    ``"fsdp"`` (each stage sharded over its replicas with FSDP2, gradients reduce-scattered once per step)."""
    weights: str | os.PathLike[str] | None = None
    """Pretrained weights of the pipelined module (safetensors, a file or a sharded folder with its index; a
    ``torch.save``d state dict; a torch.distributed.checkpoint folder): each stage reads its own tensors. Its keys
    are checked as ``strict_loading`` says (docs/big-models.md, "Where your model's state lives")."""
    weights_only: bool | None = None
    """How a ``weights`` file written by ``torch.save`` is opened: None (torch's default, True) refuses pickled objects
    other than tensors, with an error that names this argument; pass False only for a file you trust (its pickled
    code runs). ``ckpt_path=`` takes ``trainer.fit(weights_only=...)``."""
    save_distributed_checkpoint: bool | None = None
    """Where the stages live in other processes (launched and rpc mode), a checkpoint is a folder, every process
    (worker) writing its own stage (None, the default, or True), or one file, written a tensor at a time (False);
    see `lightning_pipe.weights`. Local mode writes one file, as Lightning does (the stages share the
    LightningModule's tensors): True there warns once."""
    async_checkpoint: bool = False
    """Write checkpoints in the background during a fit (ModelCheckpoint's and ``trainer.save_checkpoint``'s): each
    process copies its part to CPU memory and training goes on while a thread writes it
    (torch.distributed.checkpoint's ``async_save`` in launched mode; local mode writes Lightning's file from a
    copy); the next save and the end of ``fit`` wait for it. Every checkpoint, in the background or not, is written
    under a temporary name and renamed to its path once complete (docs/launched.md, "Checkpoints").
    ``transport="rpc"`` writes synchronously (it says so once)."""
    memory_budget: int | None = None
    """``schedule="auto"``: most bytes of stashed activations a rank may hold; default 90% of the device's free memory
    (no limit on cpu)."""
    tensor_parallel: int = 1
    """Launched mode: processes per stage of a replica (T). ``devices x num_nodes`` processes run R replicas x
    ``stages`` x T; the LightningModule's ``configure_model`` parallelises its blocks over
    ``self.device_mesh["tensor_parallel"]`` as under Lightning's ``ModelParallelStrategy``
    (`lightning_pipe.strategy.tensor_parallel`; ``data_parallel="fsdp"`` shards each stage's tensor-parallel parts
    over its replicas with FSDP2). The schedules it runs (``TENSOR_PARALLEL_SCHEDULES``, each tested in a launch):
    ``"gpipe"``, ``"1f1b"``, ``"zero-bubble"``, ``"looped-bfs"`` and ``"interleaved-zero-bubble"`` with
    ``virtual_stages=1``, ``"interleaved-1f1b"`` with ``virtual_stages=2``; runner ``"parallel"``. Others are
    refused, as is ``tensor_parallel > 1`` in one process (local or rpc mode)."""
    fault_tolerance: Any = None
    """Launched mode with replica groups that survive a lost process, on torchft (the ``ft`` extra): ``True``
    (settings from ``$REPLICA_GROUP_ID``, ``$NUM_REPLICA_GROUPS``, ``$TORCHFT_LIGHTHOUSE``), a `FaultTolerance` or a
    dict of its arguments. Each torchrun is one replica group of ``stages`` (x ``tensor_parallel``) processes; its
    stages average their gradients with the other groups' through torchft's quorum, a group that lost a process
    drops out while the others go on, and restarted it heals from a live group
    (`lightning_pipe.strategy.fault_tolerance`, docs/faults.md)."""

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> PipeConfig:
        """The config of ``arguments`` (the strategy's keywords), checked: a bad value raises `ConfigurationError`
        naming the argument and the fix, an unknown name ``TypeError`` naming the closest."""
        config = cls.from_keywords("PipeStrategy", arguments)
        stages = check_arguments(config)
        check_memory_arguments(config)
        check_split_points(config.split_points, config.partition)
        check_tensor_parallel_arguments(config)
        ft = fault_tolerance_of(config.fault_tolerance)
        return dataclasses.replace(config, stages=stages, timeout=float(config.timeout), fault_tolerance=ft)

    @cached_property
    def asynchronous(self) -> bool:
        """Whether the schedule streams batches (``"async"``): no flush between them."""
        return streams(self.schedule)

    @property
    def stage_devices(self) -> list[str] | None:
        """``devices`` as names."""
        return [str(d) for d in self.devices] if self.devices is not None else None

    @property
    def weights_path(self) -> str | None:
        """``weights`` as a path string (None without pretrained weights)."""
        return os.fspath(self.weights) if self.weights is not None else None
