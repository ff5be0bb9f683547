"""Tensor parallel inside a stage (``PipeStrategy(tensor_parallel=T)``): what it accepts, and its mesh's names.

Launched mode with ``tensor_parallel=T`` runs R replicas x P pipeline ranks x T tensor ranks (tensor innermost,
`lightning_pipe.strategy.layout`). Each tensor rank of a replica is a pipeline of its own whose coordinator runs
Lightning's loop on the replica's batch; a stage's T processes run its forwards and backwards in the same order,
its modules' DTensor collectives (the LightningModule's ``configure_model`` plan over
``self.device_mesh["tensor_parallel"]``) over the stage's tensor group. Between stages tensor rank t sends to
tensor rank t: a plain tensor as it is, a DTensor as its local part (`lightning_pipe.comm.p2p.dtensor_frames`).
The mesh's dimensions carry Lightning's ``ModelParallelStrategy`` names, with ``"pipeline"`` between them.
With R > 1 replicas a stage is averaged over them (``data_parallel="ddp"``: `lightning_pipe.engine.tensor_replicas`)
or sharded over them with FSDP2 on top of tensor parallel (``"fsdp"``: `lightning_pipe.engine.stage_shards` over
``device_mesh["data_parallel"]``; also where ``configure_model`` calls ``fully_shard`` itself, with its units).
"""

from __future__ import annotations

from typing import Any

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.strategy.layout import check_tensor_parallel_transport

#: the dimensions of launched mode's device mesh with tensor parallel, outermost first (Lightning's names)
MESH_DIMS = ("data_parallel", "pipeline", "tensor_parallel")
#: the schedules tested with tensor parallel, each with the ``virtual_stages`` (stages per process) it is tested with:
#: each process runs its actions in one thread in the schedule's order, the same on every tensor rank of a stage (so
#: their DTensor collectives pair up). The others are refused until they are: ``"auto"`` (each tensor rank's
#: coordinator would choose from its own measurements), ``"async"`` (local mode only), ``zbv`` and ``dualpipev``
#: (the V placement), and the schedules above with other ``virtual_stages``
TENSOR_PARALLEL_SCHEDULES: dict[str, int] = {
    "gpipe": 1, "1f1b": 1, "zero-bubble": 1, "looped-bfs": 1, "interleaved-zero-bubble": 1, "interleaved-1f1b": 2,
}  # fmt: skip


def check_tensor_parallel_arguments(config: Any) -> None:
    """What ``tensor_parallel`` runs with (checked when the strategy is made; ``config``: a `PipeConfig`); raises
    naming the fix."""
    tensor_parallel, transport, schedule = config.tensor_parallel, config.transport, config.schedule
    virtual_stages, runner = config.virtual_stages, config.runner
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel!r}): pass the number of processes each stage is split "
            "over (an int >= 1; 1: no tensor parallel)"
        )
    if tensor_parallel == 1:
        return
    check_tensor_parallel_transport(tensor_parallel, transport)  # the mode rule: launched mode only
    if not isinstance(schedule, str) or schedule not in TENSOR_PARALLEL_SCHEDULES:
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel}, schedule={schedule!r}): tensor parallel is tested with "
            f"the schedules {', '.join(map(repr, TENSOR_PARALLEL_SCHEDULES))} only; pass one of them"
        )
    if virtual_stages != TENSOR_PARALLEL_SCHEDULES[schedule]:
        tested = ", ".join(f"{name!r} with {v}" for name, v in TENSOR_PARALLEL_SCHEDULES.items())
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel}, schedule={schedule!r}, virtual_stages={virtual_stages}):"
            f" tensor parallel is tested with schedule={schedule!r} and virtual_stages="
            f"{TENSOR_PARALLEL_SCHEDULES[schedule]} only; pass that (the schedules and their virtual_stages: {tested})"
        )
    if runner != "parallel":
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel}, runner={runner!r}): a stage's tensor ranks must run "
            "its forwards and backwards in the same order (their DTensor collectives pair up), which only the "
            "schedule's fixed order guarantees; pass runner='parallel' (the default)"
        )


def refuse_self_sharded(pipelined: Any, why: str | None = None, ours: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """A pipelined module sharded with ``fully_shard`` before PipeStrategy cut it is refused, naming what to do.

    In launched mode a ``configure_model``'s ``fully_shard`` calls (Lightning's TP x FSDP recipe) are recorded, not
    run, and each stage applies the units it holds (`lightning_pipe.engine.fsdp_deferral`). What is left here: calls
    made elsewhere (outside ``configure_model``, or in local or rpc mode, where there is no device mesh), or a torch
    whose ``fully_shard`` cannot be deferred (``why``). The recipe's last unit, the whole model, holds parameters of
    several stages, gathered in a forward no stage runs, and torch has no public call that undoes ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [
        name or "(the pipelined module)"
        for name, m in pipelined.named_modules()
        if isinstance(m, FSDPModule) and id(m) not in ours  # ``ours``: an earlier run's stages here (ProcessStage)
    ]
    if sharded:
        where = (
            f"PipeStrategy defers the fully_shard calls of configure_model, but {why}"
            if why is not None
            else "PipeStrategy splits the model into stages first and applies a configure_model's fully_shard calls "
            "per stage in launched mode only (where self.device_mesh exists), not calls made outside configure_model"
        )
        raise ConfigurationError(
            f"the pipelined module was sharded with fully_shard ({', '.join(sharded[:3])}"
            f"{' ...' if len(sharded) > 3 else ''}) before PipeStrategy cut it: {where}. Call fully_shard inside "
            'configure_model in launched mode, or leave it out (e.g. `if "pipeline" not in '
            "self.device_mesh.mesh_dim_names`) and leave the data-parallel dimension to PipeStrategy: "
            "PipeStrategy(data_parallel='fsdp') shards each stage with FSDP2 over its replicas (each block a unit), "
            "data_parallel='ddp' averages each stage's gradients over its replicas"
        )
