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
``device_mesh["data_parallel"]``, the parameters DTensors over the 2-D mesh data x tensor).
"""

from __future__ import annotations

from typing import Any

from lightning_pipe.errors import ConfigurationError

#: the dimensions of launched mode's device mesh with tensor parallel, outermost first (Lightning's names)
MESH_DIMS = ("data_parallel", "pipeline", "tensor_parallel")
#: the schedules tested with tensor parallel (the others are refused until they are)
TENSOR_PARALLEL_SCHEDULES = ("gpipe", "1f1b")


def check_tensor_parallel_arguments(
    tensor_parallel: int, transport: str | None, schedule: Any, virtual_stages: int, data_parallel: str
) -> None:
    """What ``tensor_parallel`` runs with (checked when the strategy is made); raises naming the fix."""
    if not isinstance(tensor_parallel, int) or isinstance(tensor_parallel, bool) or tensor_parallel < 1:
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel!r}): pass the number of processes each stage is split "
            "over (an int >= 1; 1: no tensor parallel)"
        )
    if tensor_parallel == 1:
        return
    if transport in ("local", "rpc"):
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel}, transport={transport!r}): tensor parallel runs in "
            "launched mode, one process per stage and tensor rank; leave transport out (or pass 'p2p') and start "
            "devices x num_nodes = replicas x stages x tensor_parallel processes"
        )
    if not isinstance(schedule, str) or schedule not in TENSOR_PARALLEL_SCHEDULES:
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel}, schedule={schedule!r}): tensor parallel is tested with "
            f"the schedules {', '.join(map(repr, TENSOR_PARALLEL_SCHEDULES))} only; pass one of them"
        )
    if virtual_stages != 1:
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={tensor_parallel}, virtual_stages={virtual_stages}): tensor parallel "
            "runs one stage per process; pass virtual_stages=1"
        )


def refuse_self_sharded(pipelined: Any) -> None:
    """A pipelined module that its ``configure_model`` sharded with FSDP itself (``fully_shard`` over
    ``self.device_mesh["data_parallel"]``) is refused, naming what to do instead.

    Lightning's recipe ends with ``fully_shard`` of the whole model: a root unit over the parameters outside the
    blocks (embedding, final norm, head), which lie in different stages, gathered in a forward no stage runs. Taking
    the module's units apart to apply them per stage would mean undoing ``fully_shard`` (its parameters, hooks,
    class and registry), which torch offers no public call for; ``data_parallel="fsdp"`` applies the same units
    (each repeated block, then a root per stage) before the stage has values (docs/launched.md)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [name or "(the pipelined module)" for name, m in pipelined.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ConfigurationError(
            f"configure_model applied fully_shard to {', '.join(sharded[:3])}{' ...' if len(sharded) > 3 else ''}: "
            "PipeStrategy splits the model into stages first and spreads each stage over its replicas itself; "
            "apply fully_shard only under ModelParallelStrategy (e.g. `if \"pipeline\" not in "
            "self.device_mesh.mesh_dim_names`: the processes serving a stage run configure_model without a Trainer), "
            "and leave the data-parallel dimension to PipeStrategy: "
            "PipeStrategy(data_parallel='fsdp') shards each stage with FSDP2 over its replicas (each block a unit), "
            "data_parallel='ddp' averages each stage's gradients over its replicas"
        )
