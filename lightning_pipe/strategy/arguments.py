"""Checking `PipeStrategy`'s arguments when it is constructed: bad configuration fails before any work."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from lightning_pipe.backends import resolve_backends
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.base.microbatch_weights import check_weight_function
from lightning_pipe.comm.compress import resolve_codec
from lightning_pipe.engine.runners import check_runner
from lightning_pipe.partition import Partitioner, TracedPartitioner
from lightning_pipe.pipeline.recompute import checkpoint_flags
from lightning_pipe.pipeline.schedule_chooser import AUTO, AutoSchedule, is_auto, registered_schedules
from lightning_pipe.runtime import runtime_registry
from lightning_pipe.schedule import resolve_schedule
from lightning_pipe.strategy.layout import check_transport
from lightning_pipe.weights.keys import visible


def check_arguments(config: Any) -> int | None:
    """Raise `ConfigurationError` naming the argument and the fix; returns ``stages``, taken from ``split_points``
    where not given (``config``: a `PipeConfig`)."""
    stages, microbatches, schedule, devices = config.stages, config.microbatches, config.schedule, config.devices
    timeout, runner, virtual_stages, strict = config.timeout, config.runner, config.virtual_stages, config.strict
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise ConfigurationError(f"stages={stages!r}: pass a positive number of stages")
    if microbatches == AUTO and not is_auto(schedule):
        raise ConfigurationError(
            f"microbatches='auto' is chosen together with the schedule: pass schedule='auto', or a number of "
            f"microbatches with schedule={schedule!r}"
        )
    if microbatches != AUTO and (not isinstance(microbatches, int) or microbatches < 1):
        raise ConfigurationError(
            f"microbatches={microbatches!r}: pass a positive number of microbatches (or 'auto' with schedule='auto')"
        )
    check_weight_function(config.microbatch_weight, "PipeStrategy(microbatch_weight=...)")
    device_names = [str(d) for d in devices] if devices is not None else None
    if device_names is not None:
        if stages is not None and len(device_names) != stages:
            raise ConfigurationError(
                f"devices has {len(device_names)} entries but stages={stages}; give one device per stage"
            )
    if not timeout or timeout <= 0:
        raise ConfigurationError(f"timeout={timeout!r}: pass a positive number of seconds")
    # unknown names fail here
    check_runner(runner)
    if stages is not None and stages % virtual_stages:
        raise ConfigurationError(
            f"stages={stages} is not a multiple of virtual_stages={virtual_stages}; "
            "each worker holds virtual_stages stages, so pass stages = workers * virtual_stages"
        )
    checkpoint_flags(config.checkpoint, 1)
    if isinstance(config.runtime, str):
        runtime_registry.get_runtime_class(config.runtime)
    if stages is None and config.split_points:
        stages = len(config.split_points) + 1
    resolve_backends(config.backend, stages or (len(device_names) if device_names else None), strict)
    resolve_codec(config.compress)  # an unknown codec, or zstd without its package, fails here
    check_transport(config.transport, streams(schedule), config.transport_options)
    return stages


def streams(schedule: Any) -> bool:
    """Whether ``schedule`` streams batches (``"async"``: no flush between them); an unknown name raises."""
    return not is_auto(schedule) and bool(getattr(resolve_schedule(schedule), "asynchronous", False))


def check_memory_arguments(config: Any) -> None:
    """``data_parallel``, ``weights``, ``weights_only`` and ``save_distributed_checkpoint``: known values, weights
    that exist, ``weights_only`` only with the ``weights`` it opens (``config``: a `PipeConfig`)."""
    data_parallel, weights, weights_only = config.data_parallel, config.weights, config.weights_only
    if weights_only is not None and weights is None:
        raise ConfigurationError(
            f"PipeStrategy(weights_only={weights_only}) says how a weights= file written by torch.save is opened, and "
            "no weights= is given; pass weights=PATH with it, or, for a checkpoint, "
            f"trainer.fit(..., ckpt_path=PATH, weights_only={weights_only})"
        )
    if data_parallel not in ("ddp", "fsdp"):
        raise ConfigurationError(
            f"PipeStrategy(data_parallel={data_parallel!r}): pass 'ddp' (each replica holds its whole stage) or "
            "'fsdp' (each stage sharded over its replicas)"
        )
    if data_parallel == "fsdp":  # known now; a module that shards itself is known at setup (`ProcessStage.sharded`)
        check_sharded_stages(FSDP_ARGUMENT, config.save_distributed_checkpoint, config.schedule)
    if weights is not None:
        visible(weights, "PipeStrategy(weights=...):")


#: what shards the stages (`check_sharded_stages`): the argument, or the module's own ``fully_shard`` calls
FSDP_ARGUMENT, SELF_SHARDED = "data_parallel='fsdp'", "configure_model's fully_shard"
#: for each: what the user gave, around the refused argument, and what else runs that argument
SHARDED_BY = {
    FSDP_ARGUMENT: ("PipeStrategy(data_parallel='fsdp', {})", "data_parallel='ddp'"),
    SELF_SHARDED: (
        "configure_model's fully_shard calls (each stage sharded over its replicas) with PipeStrategy({})",
        'configure_model without its fully_shard calls under PipeStrategy (e.g. `if "pipeline" not in '
        "self.device_mesh.mesh_dim_names`: each replica holds its stage whole, its gradients averaged)",
    ),
}


def check_sharded_stages(cause: str, save_distributed_checkpoint: bool | None, schedule: Any) -> None:
    """What stages sharded with FSDP over their replicas cannot do, refused naming the fix: be written as one file
    (``save_distributed_checkpoint=False``), and run a schedule that splits its backwards. ``cause``: what shards
    them, `FSDP_ARGUMENT` (checked when the strategy is made) or `SELF_SHARDED` (a ``configure_model`` that calls
    ``fully_shard`` itself, with a second replica: checked at setup, once it ran, before any step)."""
    given, other = SHARDED_BY[cause]
    if save_distributed_checkpoint is False:
        raise ConfigurationError(
            f"{given.format('save_distributed_checkpoint=False')}: an FSDP stage is sharded over its replicas, and "
            "one file would gather it; keep the sharded checkpoints (save_distributed_checkpoint=True) and make one "
            "file of a folder with `python -m lightning_pipe consolidate FOLDER OUT.ckpt`"
        )
    if not is_auto(schedule) and getattr(resolve_schedule(schedule), "splits_backward", False):
        raise ConfigurationError(
            f"{given.format(f'schedule={schedule!r}')}: this schedule splits backwards into an input and a weight "
            "half, and FSDP frees a block's gathered parameters after its backward; use schedule='1f1b', 'gpipe', "
            f"'interleaved-1f1b' or 'looped-bfs' with FSDP, or {other} with {schedule!r}"
        )


def check_split_points(split_points: Sequence[str] | None, partition: Any) -> None:
    """``split_points`` say where each stage starts, so a ``partition`` that says it too would go unread: refused (the
    default ``"params"`` and a `TracedPartitioner`, which takes the split points, pass)."""
    if not split_points:
        return
    if isinstance(partition, TracedPartitioner):
        return
    custom = isinstance(partition, Partitioner) and type(partition) is not Partitioner
    method = partition.method if isinstance(partition, Partitioner) else partition
    if custom or method != "params":
        shown = type(partition).__name__ + "(...)" if isinstance(partition, Partitioner) else repr(partition)
        raise ConfigurationError(
            f"PipeStrategy(split_points={list(split_points)}, partition={shown}): the split points decide where each "
            "stage starts, so the partition would not be read; pass one of them (a TracedPartitioner(split_points="
            "...) for a partitioner of your own)"
        )


def leaves_out_split_backward(config: Any) -> bool:
    """Whether ``config``'s ``schedule="auto"`` leaves out the schedules that split the backward because of
    ``data_parallel="fsdp"`` (`auto_schedule_of`; not where the user's `AutoSchedule` leaves them out itself)."""
    schedule = config.schedule
    asked = schedule.split_backward if isinstance(schedule, AutoSchedule) else True
    return is_auto(schedule) and asked and config.data_parallel == "fsdp"


def split_backward_left_out(cause: str) -> str:
    """What ``schedule="auto"`` says once where stages sharded with FSDP (``cause``) leave out the schedules that split
    the backward."""
    names = sorted(n for n in registered_schedules() if getattr(resolve_schedule(n), "splits_backward", False))
    return (
        f"PipeStrategy(schedule='auto') with {cause}: the schedules that split the backward into an input and a "
        f"weight half ({', '.join(names)}) are left out of the choice, because FSDP frees a block's gathered "
        "parameters after its backward and the weight half would need them again; "
        f"{SHARDED_BY[cause][1]} lets schedule='auto' consider them"
    )


def fsdp_without_replicas(data_parallel: str, where: str, replicas: int) -> str | None:
    """The warning for ``data_parallel="fsdp"`` where a stage has no second replica to be sharded over (None: it has).

    Not an error: the run is right, it only shards nothing (each stage whole, as with ``"ddp"``); a script
    written for R x S processes also runs on one machine's R = 1 without an edit.
    """
    if data_parallel != "fsdp" or replicas > 1:
        return None
    return (
        f"PipeStrategy(data_parallel='fsdp') in {where}: no stage has a second replica to be sharded over, so "
        "nothing is sharded: each stage is built and held whole by its process or device, as with "
        "data_parallel='ddp'. To shard each stage R ways, run R x stages processes with R >= 2 (launched mode: "
        "devices x num_nodes a multiple of stages)"
    )


def auto_schedule_of(
    schedule: Any,
    microbatches: int | str,
    memory_budget: int | None,
    data_parallel: str,
    agree: Callable[[Any], Any] | None = None,
) -> Any:
    """``schedule="auto"`` as an `AutoSchedule` with the strategy's options (FSDP: no split backward; ``agree``: the
    replicas take one choice); any other schedule as given."""
    if memory_budget is not None and (not isinstance(memory_budget, int) or memory_budget < 1):
        raise ConfigurationError(f"memory_budget={memory_budget!r}: pass a positive number of bytes, or None")
    if not is_auto(schedule):
        if memory_budget is not None:
            raise ConfigurationError("memory_budget is schedule='auto''s limit: pass schedule='auto' with it")
        return schedule
    given = schedule if isinstance(schedule, AutoSchedule) else AutoSchedule()
    return dataclasses.replace(
        given,
        microbatches=given.microbatches or microbatches == AUTO,
        budget=memory_budget if memory_budget is not None else given.budget,
        split_backward=given.split_backward and data_parallel != "fsdp",
        agree=given.agree or agree,
    )
