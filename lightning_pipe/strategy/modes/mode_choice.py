"""Which mode a `PipeStrategy` runs in: the rule (`lightning_pipe.strategy.layout`) applied once, as an object.

The strategy asks when Lightning sets the world's ranks; the answer is a `Mode` object, and nothing else
in the package asks which mode runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.strategy.layout import LOCAL, RPC, Layout, check_launched, choose_mode
from lightning_pipe.strategy.modes.launched_mode import LaunchedMode
from lightning_pipe.strategy.modes.local_mode import LocalMode
from lightning_pipe.strategy.modes.mode import Mode
from lightning_pipe.strategy.modes.mode_parts import ModeParts
from lightning_pipe.strategy.modes.replica_groups import check_fault_tolerant
from lightning_pipe.strategy.modes.rpc_mode import RpcMode
from lightning_pipe.strategy.pipe_config import PipeConfig

#: the modes that run Lightning's loop in one process, by name
ONE_PROCESS: dict[str, type[LocalMode] | type[RpcMode]] = {LOCAL: LocalMode, RPC: RpcMode}


def process_count(devices: Sequence[torch.device] | None, num_nodes: int, environment: Any) -> int:
    """How many processes a run has: ``devices`` x ``num_nodes``, or the ``WORLD_SIZE`` of torchrun or SLURM
    (Lightning's cluster ``environment``)."""
    count = len(devices or [None]) * num_nodes
    if environment is not None and environment.creates_processes_externally:
        count = max(count, environment.world_size())
    return count


def check_one_process(config: PipeConfig, processes: int) -> None:
    """What one Lightning process cannot run is refused when the Trainer is built (``transport="local"`` and
    ``"rpc"`` are refused with ``tensor_parallel`` when the strategy is made; here: no transport, one process)."""
    if config.tensor_parallel > 1:
        raise ConfigurationError(
            f"PipeStrategy(tensor_parallel={config.tensor_parallel}) runs in launched mode, one process per stage and "
            f"tensor rank, but this Trainer runs {processes} process (devices x num_nodes = {processes}); start "
            f"devices x num_nodes = replicas x stages x {config.tensor_parallel} processes (e.g. "
            f"Trainer(devices={2 * config.tensor_parallel}) with stages=2), or leave tensor_parallel out"
        )


def mode_of(
    config: PipeConfig,
    processes: int,
    devices: Sequence[torch.device] | None,
    global_rank: int,
    placement: str,
    parts: ModeParts,
    held: Mode | None,
) -> Mode:
    """The `Mode` of ``config.transport`` and the number of ``processes``, holding the strategy's ``parts``;
    ``held``, the mode chosen before, is kept while it is the same (launched mode's while the layout and devices
    stay: it holds the process groups and transport; rpc mode's holds what the last fit left for the checkpoints
    after it)."""
    name = choose_mode(config.transport, processes)
    check_fault_tolerant(config, name, processes)
    one_process = ONE_PROCESS.get(name)
    if one_process is not None:
        check_one_process(config, processes)
        return held if type(held) is one_process else one_process(config, parts)
    check_launched(processes, config.stage_devices, config.runner, config.asynchronous)
    assert devices is not None
    stages = config.stages or len(devices)
    layout = Layout.of(
        processes, global_rank, stages, config.virtual_stages, len(devices), placement, config.tensor_parallel
    )
    if isinstance(held, LaunchedMode) and (held.layout, held.devices) == (layout, list(devices)):
        return held
    return LaunchedMode(layout, devices, config, parts)
