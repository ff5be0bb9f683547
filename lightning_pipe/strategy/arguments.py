"""Checking `PipeStrategy`'s arguments when it is constructed: bad configuration fails before any work."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_pipe.backends import BackendArg, resolve_backends
from lightning_pipe.checkpointing import checkpoint_flags
from lightning_pipe.comm.compress import resolve_codec
from lightning_pipe.engine.runners import check_runner
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.microbatch_weights import check_weight_function
from lightning_pipe.pipeline import TRANSPORTS
from lightning_pipe.runtime import BaseRuntime, runtime_registry
from lightning_pipe.schedule import resolve_schedule
from lightning_pipe.weights.keys import visible


def check_arguments(
    stages: int | None,
    microbatches: int,
    schedule: Any,
    devices: Sequence[str | torch.device] | None,
    checkpoint: str,
    runtime: str | BaseRuntime | None,
    timeout: float,
    backend: BackendArg,
    strict: bool,
    transport: str | None,
    coordinator: str | None,
    token: str | None,
    split_points: Sequence[str] | None,
    virtual_stages: int,
    runner: str,
    microbatch_weight: Any = None,
    compress: Any = None,
) -> tuple[int | None, list[str] | None, bool, dict[str, Any]]:
    """Raise `ConfigurationError` naming the argument and the fix; returns ``(stages, devices, asynchronous,
    transport options)`` with ``stages`` taken from ``split_points`` where not given."""
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise ConfigurationError(f"stages={stages!r}: pass a positive number of stages")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigurationError(f"microbatches={microbatches!r}: pass a positive number of microbatches")
    check_weight_function(microbatch_weight, "PipeStrategy(microbatch_weight=...)")
    device_names = [str(d) for d in devices] if devices is not None else None
    if device_names is not None:
        if stages is not None and len(device_names) != stages:
            raise ConfigurationError(
                f"devices has {len(device_names)} entries but stages={stages}; give one device per stage"
            )
    if not timeout or timeout <= 0:
        raise ConfigurationError(f"timeout={timeout!r}: pass a positive number of seconds")
    asynchronous = bool(getattr(resolve_schedule(schedule), "asynchronous", False))  # unknown names fail here
    if asynchronous and transport not in (None, "local"):
        raise ConfigurationError(
            f"PipeStrategy(schedule='async') runs with transport='local'; with transport={transport!r} train "
            "with lightning_pipe.Pipeline(...).train_async(...) or pick schedule='1f1b'"
        )
    check_runner(runner)
    if stages is not None and stages % virtual_stages:
        raise ConfigurationError(
            f"stages={stages} is not a multiple of virtual_stages={virtual_stages}; "
            "each worker holds virtual_stages stages, so pass stages = workers * virtual_stages"
        )
    checkpoint_flags(checkpoint, 1)
    if isinstance(runtime, str):
        runtime_registry.get_runtime_class(runtime)
    if stages is None and split_points:
        stages = len(split_points) + 1
    resolve_backends(backend, stages or (len(device_names) if device_names else None), strict)
    if transport is not None and transport not in TRANSPORTS and transport != "p2p":
        known = ", ".join(sorted({*TRANSPORTS, "p2p"}))
        raise ConfigurationError(f"unknown transport {transport!r}; available: {known} (or None: by the process count)")
    resolve_codec(compress)  # an unknown codec, or zstd without its package, fails here
    given = (("coordinator", coordinator), ("token", token), ("compress", compress))
    options: dict[str, Any] = {k: v for k, v in given if v is not None}
    if options and transport != "rpc":
        verb = "needs" if len(options) == 1 else "need"
        raise ConfigurationError(f"{' and '.join(options)} {verb} transport='rpc' (stages in worker processes)")
    return stages, device_names, asynchronous, options


def check_launched(processes: int, devices: Sequence[str] | None, runner: str, asynchronous: bool) -> None:
    """What launched mode cannot do fails when the Trainer is built, before any process starts."""
    if devices is not None:
        raise ConfigurationError(
            "PipeStrategy(devices=[...]) places the stages of one process; in launched mode "
            f"({processes} processes) each process holds its stage on its own device: leave devices out, "
            "or pass transport='local' to run every stage in this process"
        )
    if runner == "linear":
        raise ConfigurationError(
            "runner='linear' walks every stage from one thread; in launched mode each process runs its own "
            "stage: use runner='parallel' or 'dataflow', or transport='local'"
        )
    if asynchronous:
        raise ConfigurationError(
            "PipeStrategy(schedule='async') runs with transport='local' in one process; in launched mode "
            "pick a synchronous schedule such as '1f1b'"
        )


def check_memory_arguments(data_parallel: str, weights: Any, save_distributed_checkpoint: bool, schedule: Any) -> None:
    """``data_parallel``, ``weights`` and ``save_distributed_checkpoint``: known values, weights that exist."""
    if data_parallel not in ("ddp", "fsdp"):
        raise ConfigurationError(
            f"PipeStrategy(data_parallel={data_parallel!r}): pass 'ddp' (each replica holds its whole stage) or "
            "'fsdp' (each stage sharded over its replicas)"
        )
    if data_parallel == "fsdp" and not save_distributed_checkpoint:
        raise ConfigurationError(
            "PipeStrategy(data_parallel='fsdp', save_distributed_checkpoint=False): an FSDP stage is sharded over "
            "its replicas, and one file would gather it; keep the sharded checkpoints (save_distributed_checkpoint="
            "True) and make one file of a folder with `python -m lightning_pipe consolidate FOLDER OUT.ckpt`"
        )
    if data_parallel == "fsdp" and schedule == "zero-bubble":
        raise ConfigurationError(
            "PipeStrategy(data_parallel='fsdp', schedule='zero-bubble'): zero-bubble splits each backward into an "
            "input and a weight half, and FSDP frees a block's gathered parameters after its backward; use "
            "schedule='1f1b', 'gpipe' or 'interleaved-1f1b' with FSDP, or data_parallel='ddp' with zero-bubble"
        )
    if weights is not None:
        visible(weights, "PipeStrategy(weights=...):")
