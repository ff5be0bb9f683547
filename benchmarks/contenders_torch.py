"""The reference contender: torch.distributed.pipelining, one process per rank, gloo on 127.0.0.1."""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.bench_procs import Config
from benchmarks.contenders_local import Runner
from benchmarks.workloads import build_model, stage_module

#: lightning_pipe's schedule name -> torch.distributed.pipelining's class of the same schedule
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2R-1-r; the others r, r+R, r+2R, ...


def stages_of_rank(schedule: str, rank: int, ranks: int, virtual_stages: int) -> list[int]:
    """The stages torch's ``schedule`` places on ``rank`` (as lightning_pipe places them)."""
    if schedule in V_SHAPED:
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(virtual_stages)]


class TorchPipeRunner(Runner):
    """One process of torch.distributed.pipelining (rank ``rank`` of a gloo world): one stage, or several for
    the multi-stage schedules (``cfg.virtual_stages``)."""

    def __init__(self, cfg: Config, rank: int) -> None:
        super().__init__(cfg)
        import torch.distributed as dist
        from torch.distributed import pipelining

        torch.set_num_threads(cfg.threads)
        self.rank = rank
        self.dist = dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=rank, world_size=cfg.ranks)
        model = build_model(cfg.workload)
        self.indices = stages_of_rank(cfg.schedule, rank, cfg.ranks, cfg.virtual_stages)
        self.modules = [stage_module(model, cfg.balance, s) for s in self.indices]
        pairs = zip(self.modules, self.indices, strict=True)
        stages = [pipelining.PipelineStage(m, s, cfg.stages, torch.device("cpu")) for m, s in pairs]
        schedule_cls = getattr(pipelining.schedules, TORCH_SCHEDULES[cfg.schedule])
        single = cfg.schedule in ("gpipe", "1f1b")
        first = stages[0] if single else stages
        self.schedule = schedule_cls(first, n_microbatches=cfg.microbatches, loss_fn=self.loss)
        self.optimizer = torch.optim.SGD([p for m in self.modules for p in m.parameters()], lr=cfg.lr)

    def step(self) -> float:
        return timed_step(self, *self.batch(), self.cfg.stages)

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v for m in self.modules for k, v in m.state_dict().items()}

    def stop(self) -> dict[str, Any]:
        self.dist.barrier()
        self.dist.destroy_process_group()
        return {}


def timed_step(runner: Any, x: torch.Tensor, y: torch.Tensor, stages: int) -> float:
    """One step of a torch rank (``runner``: its ``dist``, ``schedule``, ``optimizer``, stage ``indices``), timed
    from a barrier: the first stage feeds the inputs, the last the targets."""
    runner.dist.barrier()
    start = time.perf_counter()
    runner.optimizer.zero_grad()
    inputs = (x,) if 0 in runner.indices else ()
    if stages - 1 in runner.indices:
        runner.schedule.step(*inputs, target=y, return_outputs=False)
    else:
        runner.schedule.step(*inputs)
    runner.optimizer.step()
    return time.perf_counter() - start
