"""The launched-mode contender (``lightning_pipe-p2p``): one process per stage, started as torchrun starts them.

Every process runs the same user code, ``Trainer(accelerator="cpu", devices=S,
strategy=PipeStrategy(stages=S, microbatches=M, schedule=...)).fit(...)`` with PipeStrategy's defaults
otherwise, in the environment ``torchrun --nproc-per-node S --master-addr 127.0.0.1 --master-port P``
gives it (Lightning detects `TorchElasticEnvironment`). Rank 0, the coordinator, runs Lightning's loop,
the user's step and the stage the strategy gives it, and is driven over a pipe like the local Trainer
contender (`serve_one_fit`: one fit, stages kept between rounds); the other ranks serve their stage
inside ``fit`` and return when rank 0's fit ends.
Activations and gradients go point to point over gloo (`lightning_pipe.comm.p2p`).
"""

from __future__ import annotations

import os
import traceback
import uuid
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.bench_procs import Config, Contender, free_port, spawn, spawn_silent
from benchmarks.contenders_trainer import (
    endless_loader,
    make_net,
    quiet_lightning,
    quiet_trainer,
    serve_one_fit,
    strategy_arguments,
)
from benchmarks.workloads import make_batches


def torchrun_env(rank: int, world_size: int, port: int, run_id: str, threads: int) -> dict[str, str]:
    """What ``torchrun --nproc-per-node WORLD --master-addr 127.0.0.1 --master-port PORT`` sets for ``rank``.

    torchrun sets ``OMP_NUM_THREADS=1`` for several processes per node unless it is set; here it is the
    run's threads per stage (1 on 2 cores with 2 stages, as torchrun would), so every thread of the
    process, the stage's worker thread included, uses what the other contenders' stages use.
    """
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": str(threads),
    }


def start_launched(ctx: Any, contender: Contender, cfg: Config) -> None:
    """Rank 0 as the contender's driven worker, ranks 1..S-1 as its silent processes."""
    port, run_id = free_port(), f"compare-{uuid.uuid4().hex[:8]}"
    spawn(ctx, contender, serve_coordinator, (cfg,), env=torchrun_env(0, cfg.ranks, port, run_id, cfg.threads))
    for rank in range(1, cfg.ranks):
        env = torchrun_env(rank, cfg.ranks, port, run_id, cfg.threads)
        spawn_silent(ctx, contender, serve_rank, (cfg,), env=env)


def serve_coordinator(conn: Connection, cfg: Config) -> None:
    """Global rank 0: Lightning's loop, the user's step and its stage, taking commands between steps."""
    try:
        quiet_lightning(cfg)
        batches = make_batches(cfg.workload)
        net = make_net(cfg)
        conn.send(("ready", os.getpid()))
        serve_one_fit(conn, cfg, net, strategy_arguments(cfg, "p2p"), batches, devices=cfg.ranks, wire=True)
    except Exception:
        conn.send(("error", traceback.format_exc()))


def serve_rank(cfg: Config) -> None:
    """Any other rank: the same script; its ``fit`` serves its stage until rank 0's fit ends."""
    quiet_lightning(cfg)
    trainer = quiet_trainer(strategy_arguments(cfg, "p2p"), None, devices=cfg.ranks, max_epochs=1)
    trainer.fit(make_net(cfg), endless_loader(make_batches(cfg.workload)))
