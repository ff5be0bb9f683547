"""`PipeConfig`: `PipeStrategy`'s arguments, validated once and frozen, handed to every part that reads them.

The strategy's parts (the pipeline builder, the step driver, the processes and the launched world) receive
this one object instead of re-listing ``timeout``, ``runner`` or ``virtual_stages`` each (torchtitan's
``JobConfig`` is the model). Adding an argument is two edits: a field here and a keyword of
`PipeStrategy.__init__`, described in `PipeConfig`'s docstring; `PipeConfig.of` checks the values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_pipe.backends import BackendArg
from lightning_pipe.base.microbatch_weights import MicrobatchWeight
from lightning_pipe.partition import Partitioner
from lightning_pipe.runtime import BaseRuntime
from lightning_pipe.strategy.arguments import check_arguments, check_memory_arguments, check_split_points
from lightning_pipe.strategy.fault_tolerance import fault_tolerance_of
from lightning_pipe.strategy.tensor_parallel import check_tensor_parallel_arguments


@dataclass(frozen=True)
class PipeConfig:
    """The user's arguments of one `PipeStrategy` (its keywords but Lightning's own), checked, plus what they imply.

    Args:
        stages: number of stages; default: one per device.
        microbatches: how many pieces each batch is cut into (along dimension 0); ``"auto"`` with
            ``schedule="auto"``: chosen with the schedule.
        schedule: ``"gpipe"`` (all forwards, then losses, then backwards), ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"zero-bubble"``, ``"looped-bfs"``, ``"interleaved-zero-bubble"``,
            ``"zbv"``, ``"dualpipev"`` (the last two with ``virtual_stages=2``), ``"async"`` (no flush between
            batches, each stage steps its own copy of the ``configure_optimizers`` optimizer with weight stashing;
            transport ``"local"``; `staleness` reports what it measured), a `Schedule` subclass or a function
            returning per-rank action lists (see docs/schedules.md). ``"auto"``: the first training step
            measures every stage, the second runs the registered schedule `simulate` predicts fastest
            (`lightning_pipe.pipeline.schedule_chooser`; the choice is logged as a table and kept in `schedule_choice`).
        partition: ``"uniform"``, ``"params"``, ``"memory"``, ``"time"``, layer counts such as
            ``[3, 5]``, or a `Partitioner`.
        module: attribute path of the pipelined module in the LightningModule; default: the child
            with the most parameters.
        devices: one device per stage; default: the Trainer's devices, or ``cpu`` for every stage.
        checkpoint: activation recomputation: ``"auto"`` (only the stages whose device lacks the memory for the
            planned activation peak; never on cpu; decided before the second training step of a fit and logged),
            ``"always"``, ``"except_last"`` or ``"never"``.
        runtime: a registered device type or a `BaseRuntime` instance; default: by device type.
        timeout: seconds any wait between the coordinator and the stages may take.
        backend: how stage forwards run: ``"eager"``, ``"inductor"``, ``"tensorrt"`` or a registered
            backend; a list gives one per stage, a tuple a fallback chain, a dict one per mode
            (``{"train": "inductor", "eval": "tensorrt"}``). See `lightning_pipe.backends`.
        strict: raise instead of falling back (with a logged reason) when a requested backend
            cannot run a stage.
        split_points: names of submodules before which a new stage starts (``["blocks.2"]``). A
            pipelined module that is not an ``nn.Sequential`` is traced on its first call and cut
            there, or where ``partition`` balances it; its forward may take several positional and
            keyword arguments and return a tensor, tuple or dict. Without ``stages``, one stage more
            than split points.
        transport: ``None`` (the default): launched mode when the Trainer runs more than one process
            (``devices x num_nodes > 1`` or a launcher's ``WORLD_SIZE > 1``: R pipeline replicas of the stages,
            one process per stage and device, activations point to point over torch.distributed, gradients
            averaged over the replicas; see `lightning_pipe.strategy.layout`), else ``"local"``.
            ``"local"``: stages are threads of this process, on the Trainer's devices. ``"rpc"``: stage
            worker processes (one per stage on this machine, or ``lightning-pipe worker`` processes that join
            ``coordinator``); see `lightning_pipe.comm.rpc`. ``"p2p"``: launched mode in any case.
        coordinator: with ``transport="rpc"``, ``"HOST:PORT"`` where workers on other machines join.
        token: with ``transport="rpc"``, the secret workers must present (default ``$LIGHTNING_PIPE_TOKEN``).
        compress: with ``transport="rpc"``, how activations and gradients cross between processes:
            ``None``, ``"bf16"`` / ``"fp16"`` (lossy casts), ``"zstd"`` (lossless, extra ``compress``),
            ``"bf16+zstd"``, ``"fp16+zstd"`` or a codec object (`lightning_pipe.comm.compress.Codec`).
        virtual_stages: stages per worker (``interleaved-1f1b`` and the other chunked schedules): stage ``s``
            runs on worker ``s % (stages // virtual_stages)``, or in a V (``zbv``, ``dualpipev``: stages ``r`` and
            ``2P - 1 - r`` on worker ``r``).
        runner: ``"parallel"`` (a thread per worker, fixed order), ``"dataflow"`` (each worker runs
            whichever action is ready) or ``"linear"`` (one thread walks one global order).
        trace: a path for the Chrome trace (pipeline timeline) of training steps 1-3, or a `PipeTrace`
            (chosen steps, a PNG Gantt chart). In launched mode with several coordinators (replicas, tensor ranks)
            each writes its pipeline's to ``<stem>-rank<global rank><suffix>``.
        microbatch_weight: a function of a microbatch (what the step receives) returning its weight, a
            number or 0-d tensor; default: its rows. Losses, ``self.log`` values and the step's returned
            values combine with the weights normalised over the batch: return what the loss averages
            over, e.g. ``lambda b: (b["labels"][:, 1:] != -100).sum()`` for a causal LM's labelled tokens.
            A microbatch of weight 0 adds nothing, not even its loss's gradient.
        data_parallel: launched mode with several replicas: ``"ddp"`` (each replica holds its whole stage, gradients
            averaged) or ``"fsdp"`` (each stage sharded over its replicas with FSDP2, gradients reduce-scattered once
            per step).
        weights: pretrained weights of the pipelined module (safetensors, a file or a sharded folder with its index;
            a ``torch.save``d state dict; a torch.distributed.checkpoint folder): each stage reads its own tensors.
            Its keys are checked as ``strict_loading`` says (docs/big-models.md, "Where your model's state lives").
        weights_only: how a ``weights`` file written by ``torch.save`` is opened: None (torch's default, True)
            refuses pickled objects other than tensors, with an error that names this argument; pass False only
            for a file you trust (its pickled code runs). ``ckpt_path=`` takes ``trainer.fit(weights_only=...)``.
        tensor_parallel: launched mode: processes per stage of a replica (T). ``devices x num_nodes`` processes run
            R replicas x ``stages`` x T; the LightningModule's ``configure_model`` parallelises its blocks over
            ``self.device_mesh["tensor_parallel"]`` as under Lightning's ``ModelParallelStrategy``
            (`lightning_pipe.strategy.tensor_parallel`; ``data_parallel="fsdp"`` shards each stage's tensor-parallel
            parts over its replicas with FSDP2). The schedules it runs (``TENSOR_PARALLEL_SCHEDULES``, each tested in a
            launch): ``"gpipe"``, ``"1f1b"``, ``"zero-bubble"``, ``"looped-bfs"`` and ``"interleaved-zero-bubble"`` with
            ``virtual_stages=1``, ``"interleaved-1f1b"`` with ``virtual_stages=2``; runner ``"parallel"``. Others are
            refused, as is ``tensor_parallel > 1`` in one process (local or rpc mode).
        memory_budget: ``schedule="auto"``: most bytes of stashed activations a rank may hold; default 90% of the
            device's free memory (no limit on cpu).
        save_distributed_checkpoint: where the stages live in other processes (launched and rpc mode), a checkpoint
            is a folder, every process (worker) writing its own stage (None, the default, or True), or one file,
            written a tensor at a time (False); see `lightning_pipe.weights`. Local mode writes one file, as
            Lightning does (the stages share the LightningModule's tensors): True there warns once.
        async_checkpoint: write checkpoints in the background during a fit (ModelCheckpoint's and
            ``trainer.save_checkpoint``'s): each process copies its part to CPU memory and training goes on while a
            thread writes it (torch.distributed.checkpoint's ``async_save`` in launched mode; local mode writes
            Lightning's file from a copy); the next save and the end of ``fit`` wait for it. Every checkpoint, in
            the background or not, is written under a temporary name and renamed to its path once complete
            (docs/launched.md, "Checkpoints"). ``transport="rpc"`` writes synchronously (it says so once).
        fault_tolerance: launched mode with replica groups that survive a lost process, on torchft (the ``ft`` extra):
            ``True`` (settings from ``$REPLICA_GROUP_ID``, ``$NUM_REPLICA_GROUPS``, ``$TORCHFT_LIGHTHOUSE``), a
            `FaultTolerance` or a dict of its arguments. Each torchrun is one replica group of ``stages`` (x
            ``tensor_parallel``) processes; its stages average their gradients with the other groups' through
            torchft's quorum, a group that lost a process drops out while the others go on, and restarted it heals
            from a live group (`lightning_pipe.strategy.fault_tolerance`, docs/faults.md).
    """

    stages: int | None = None
    microbatches: int | str = 4
    schedule: Any = "1f1b"
    partition: str | Sequence[int] | Partitioner = "params"
    module: str | None = None
    devices: Sequence[str | torch.device] | None = None
    checkpoint: str = "auto"
    runtime: str | BaseRuntime | None = None
    timeout: float = 300.0
    backend: BackendArg = None
    strict: bool = False
    transport: str | None = None
    coordinator: str | None = None
    token: str | None = None
    compress: Any = None
    split_points: Sequence[str] | None = None
    virtual_stages: int = 1
    runner: str = "parallel"
    trace: Any = None
    microbatch_weight: MicrobatchWeight | None = None
    data_parallel: str = "ddp"
    weights: str | os.PathLike[str] | None = None
    save_distributed_checkpoint: bool | None = None
    async_checkpoint: bool = False
    memory_budget: int | None = None
    weights_only: bool | None = None
    tensor_parallel: int = 1
    fault_tolerance: Any = None
    # what the arguments imply (set by `of`)
    stage_devices: list[str] | None = field(default=None, init=False)  # ``devices`` as names
    asynchronous: bool = field(default=False, init=False)  # the schedule streams batches (``"async"``)
    transport_options: Mapping[str, Any] = field(default_factory=dict, init=False)  # rpc: coordinator, token, compress

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> PipeConfig:
        """The config of ``arguments`` (any mapping holding the fields' names, e.g. ``locals()``), checked:
        a bad value raises `ConfigurationError` naming the argument and the fix."""
        config = cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.init and f.name in arguments})
        stages, devices, asynchronous, options = check_arguments(
            config.stages, config.microbatches, config.schedule, config.devices, config.checkpoint, config.runtime,
            config.timeout, config.backend, config.strict, config.transport, config.coordinator, config.token,
            config.split_points, config.virtual_stages, config.runner, config.microbatch_weight, config.compress,
        )  # fmt: skip
        check_memory_arguments(
            config.data_parallel, config.weights, config.save_distributed_checkpoint, config.schedule,
            config.weights_only,
        )  # fmt: skip
        check_split_points(config.split_points, config.partition)
        check_tensor_parallel_arguments(
            config.tensor_parallel, config.transport, config.schedule, config.virtual_stages, config.data_parallel,
            config.runner,
        )  # fmt: skip
        ft = fault_tolerance_of(config.fault_tolerance)
        config = dataclasses.replace(config, stages=stages, timeout=float(config.timeout), fault_tolerance=ft)
        for name, value in (("stage_devices", devices), ("asynchronous", asynchronous), ("transport_options", options)):
            object.__setattr__(config, name, value)  # derived once here; frozen for everyone after
        return config

    @property
    def weights_path(self) -> str | None:
        """``weights`` as a path string (None without pretrained weights)."""
        return os.fspath(self.weights) if self.weights is not None else None
