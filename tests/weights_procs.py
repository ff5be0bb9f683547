"""Two processes in a gloo world on 127.0.0.1 for the weights tests: an FSDP step and its sharded checkpoint.

``python weights_procs.py RANK WORLD OUTDIR`` (MASTER_ADDR/MASTER_PORT set by the test); results as files.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_pipe.checkpoint.sharded import OptimizerPart, save_sharded
from lightning_pipe.engine.stage_shards import StageShards


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(world * 8, 8), torch.randn(world * 8, 4)


def fsdp_step(rank: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Four microbatch backwards in a stage thread, one reduce, one Adam step: the FSDP stage of a pipeline."""
    x, y = data(world)
    m = model()
    shards = StageShards({0: m}, init_device_mesh("cpu", (world,)))
    mine = slice(rank * 8, (rank + 1) * 8)

    def work() -> None:
        for mx, my in zip(x[mine].chunk(4), y[mine].chunk(4), strict=True):
            (((m(mx) - my) ** 2).mean() / 4).backward()
        shards.reduce([0])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    optimizer = torch.optim.Adam(m.parameters(), lr=0.01)
    optimizer.step()
    return m, optimizer


def run(rank: int, world: int, outdir: Path) -> dict[str, Any]:
    """One FSDP step, then its sharded checkpoint: each rank's gradients and parameters (whole) and Adam's
    ``exp_avg``, written by rank 0; ``outdir/ckpt`` holds the checkpoint."""
    m, optimizer = fsdp_step(rank, world)
    names = {id(p): n for n, p in m.named_parameters()}
    order = [f"model.{names[id(p)]}" for p in optimizer.param_groups[0]["params"]]
    saved = optimizer.state_dict()
    state = {order[i]: s for i, s in saved["state"].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    part = OptimizerPart(state, groups, [order] if rank == 0 else None)
    extra = {"epoch": 3, "global_step": 7} if rank == 0 else None
    save_sharded(outdir / "ckpt", {f"model.{k}": v for k, v in m.state_dict().items()}, [part], extra)
    return {"grads": {n: p.grad.full_tensor() for n, p in m.named_parameters()},
            "params": {f"model.{n}": p.full_tensor() for n, p in m.named_parameters()},
            "exp_avg": {k: s["exp_avg"].full_tensor() for k, s in state.items()}}  # fmt: skip


def main() -> None:
    faulthandler.enable()
    rank, world, outdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run(rank, world, outdir)
        torch.save(result, outdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
