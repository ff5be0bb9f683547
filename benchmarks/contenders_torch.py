"""The reference contender: torch.distributed.pipelining, one process per stage, gloo on 127.0.0.1."""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.bench_procs import Config
from benchmarks.contenders_local import Runner
from benchmarks.workloads import build_model, stage_module


class TorchPipeRunner(Runner):
    """One stage of torch.distributed.pipelining (this process is rank ``rank`` of a gloo world)."""

    def __init__(self, cfg: Config, rank: int) -> None:
        super().__init__(cfg)
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        torch.set_num_threads(cfg.threads)
        self.rank = rank
        self.dist = dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=rank, world_size=cfg.stages)
        self.module = stage_module(build_model(cfg.workload), cfg.balance, rank)
        stage = PipelineStage(self.module, rank, cfg.stages, torch.device("cpu"))
        schedule_cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[cfg.schedule]
        self.schedule = schedule_cls(stage, n_microbatches=cfg.microbatches, loss_fn=self.loss)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=cfg.lr)

    def step(self) -> float:
        x, y = self.batch()
        self.dist.barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        if self.rank == 0:
            self.schedule.step(x)
        elif self.rank == self.cfg.stages - 1:
            self.schedule.step(target=y, return_outputs=False)
        else:
            self.schedule.step()
        self.optimizer.step()
        return time.perf_counter() - start

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.module.state_dict())

    def stop(self) -> dict[str, Any]:
        self.dist.barrier()
        self.dist.destroy_process_group()
        return {}
