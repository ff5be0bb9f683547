"""The contenders of `overhead.py`: one small Linear per stage, timed per action.

Each runner lives in a worker process (`bench_procs.serve`) and answers ``run(steps)`` with every step's seconds,
the CPU seconds of its process (and of its children: the rpc transport's worker processes) and the seconds of each
kind of action it recorded:

- lightning_pipe (``local``, ``rpc``, ``launched``): from the step's records (each action from the moment its
  inputs were there until it ended: kinds F, B, I, W) and their parts (``send``, ``recv``: taking its input from
  the inbox; ``loss``: the last stage's criterion), as the timeline records them;
- torch.distributed.pipelining: its stage's ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I where it
  runs the input half only), ``backward_weight_one_chunk`` (W) wrapped with a timer, and its schedules' point to
  point helpers (``p2p post``: posting sends and receives; ``p2p wait``: waiting for them, which includes waiting
  for the peer's compute).

A runner with ``root`` runs another checkout's lightning_pipe (the baseline of a before/after comparison): its
process drops the lightning_pipe modules it imported and imports them from ``root``.
"""

from __future__ import annotations

import collections
import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_procs import cpu_seconds, serve
from benchmarks.contenders_torch import timed_step

WIDTH = 32  # features of each stage's Linear
ROWS = 2  # rows per microbatch: compute is tiny, what a step costs is the libraries' own work
V_SHAPED = ("zbv", "dualpipev")
TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


@dataclass
class OverheadConfig:
    schedule: str
    ranks: int
    virtual_stages: int
    microbatches: int
    port: int = 0
    root: str | None = None  # another checkout's lightning_pipe (the baseline)

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual_stages


def build_model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(stages)])


def make_batches(cfg: OverheadConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = ROWS * cfg.microbatches
    return [(torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator))] * 2


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def use_root(root: str | None) -> None:
    """Import lightning_pipe from ``root`` from now on in this process (and the processes it starts)."""
    if root is None:
        return
    for name in [n for n in sys.modules if n == "lightning_pipe" or n.startswith("lightning_pipe.")]:
        del sys.modules[name]
    sys.path.insert(0, root)
    importlib.invalidate_caches()


class Runner:
    def __init__(self, cfg: OverheadConfig) -> None:
        use_root(cfg.root)
        torch.set_num_threads(1)
        self.cfg = cfg
        self.batches = make_batches(cfg)
        self.index = 0
        self.spans: dict[str, list[float]] = collections.defaultdict(list)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.index += 1
        return self.batches[self.index % len(self.batches)]

    def step(self) -> float:
        raise NotImplementedError

    def run(self, steps: int) -> dict[str, Any]:
        self.spans = collections.defaultdict(list)
        before = cpu_seconds(os.getpid())
        times = [self.step() for _ in range(steps)]
        after = cpu_seconds(os.getpid())
        cpu = after[0] - before[0] + after[1] - before[1]
        return {"times": times, "cpu": cpu, "spans": dict(self.spans)}

    def stop(self) -> dict[str, Any]:
        return {}


class TorchRunner(Runner):
    """One rank of torch.distributed.pipelining over gloo, its stage calls and point to point helpers timed."""

    def __init__(self, cfg: OverheadConfig, rank: int) -> None:
        super().__init__(cfg)
        import torch.distributed as dist
        from torch.distributed import pipelining
        from torch.distributed.pipelining import schedules

        self.dist = dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=rank, world_size=cfg.ranks)
        model = build_model(cfg.stages)
        if cfg.schedule in V_SHAPED:
            self.indices = [rank, 2 * cfg.ranks - 1 - rank]
        else:
            self.indices = [rank + k * cfg.ranks for k in range(cfg.virtual_stages)]
        modules = [model[s] for s in self.indices]
        stages = [
            pipelining.PipelineStage(m, s, cfg.stages, torch.device("cpu"))
            for m, s in zip(modules, self.indices, strict=True)
        ]
        for stage in stages:
            stage.forward_one_chunk = self._timed(lambda a, k: "F", stage.forward_one_chunk)
            stage.backward_one_chunk = self._timed(
                lambda a, k: "B" if k.get("full_backward", True) else "I", stage.backward_one_chunk
            )
            stage.backward_weight_one_chunk = self._timed(lambda a, k: "W", stage.backward_weight_one_chunk)
        schedules._batch_p2p = self._timed(lambda a, k: "p2p post", schedules._batch_p2p)
        schedules._wait_batch_p2p = self._timed(lambda a, k: "p2p wait", schedules._wait_batch_p2p)
        cls = getattr(schedules, TORCH_CLASSES[cfg.schedule])
        first = stages[0] if cfg.virtual_stages == 1 else stages
        self.schedule = cls(first, n_microbatches=cfg.microbatches, loss_fn=mse)
        self.optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.01)

    def _timed(self, kind: Callable[[tuple[Any, ...], dict[str, Any]], str], fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans[kind(args, kwargs)].append(time.perf_counter() - start)

        return timed

    def step(self) -> float:
        return timed_step(self, *self.batch(), self.cfg.stages)

    def stop(self) -> dict[str, Any]:
        self.dist.barrier()  # the process leaves without tearing its world down (`serve_and_exit`)
        return {}


class PipelineRunner(Runner):
    """lightning_pipe's `Pipeline` (no Lightning) on ``transport``: ``"local"``, ``"rpc"`` or a communicator."""

    def __init__(self, cfg: OverheadConfig, transport: Any = "local") -> None:
        super().__init__(cfg)
        self._start(transport)

    def _start(self, transport: Any) -> None:
        from lightning_pipe import Pipeline

        cfg = self.cfg
        self.model = build_model(cfg.stages)
        options = {"threads": 1} if transport in ("local", "rpc") else {}
        self.pipe = Pipeline(
            self.model,
            stages=cfg.stages,
            schedule=cfg.schedule,
            transport=transport,
            virtual_stages=cfg.virtual_stages,
            partition=[1] * cfg.stages,
            checkpoint="never",
            **options,
        ).start()
        template = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.optimizer = template if transport == "local" else self.pipe.optimizer(template)

    def step(self) -> float:
        x, y = self.batch()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        result = self.pipe.train_step(x, y, mse, microbatches=self.cfg.microbatches)
        self.optimizer.step()
        self.pipe.coordinator.settle()  # every rank done with the step, as torch's step is timed
        seconds = time.perf_counter() - start
        self._record(result)
        return seconds

    def _record(self, result: Any) -> None:
        for actions in result.records:
            for name, start, end in actions:
                self.spans[name.rstrip("0123456789").lstrip("0123456789")].append(end - start)
        for parts in result.parts:
            for name, start, end in parts:
                part = name.rsplit(" ", 1)[-1]
                if part in ("send", "recv", "loss"):
                    self.spans[part].append(end - start)

    def stop(self) -> dict[str, Any]:
        self.pipe.close()
        return {}


def serve_and_exit(conn: Any, factory: Callable[..., Runner], args: tuple[Any, ...]) -> None:
    """`bench_procs.serve`, then leave at once: a gloo world's threads can hold a process's normal exit for long."""
    serve(conn, factory, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launched_ranks(cfg: OverheadConfig) -> tuple[list[int], int]:
    """Global ranks in pipeline order and the coordinator's pipeline rank: global rank 0 holds the last stage, as
    launched mode places it (the coordinator computes the losses there)."""
    from lightning_pipe.schedule import placement_of, resolve_schedule, stage_ranks

    rank_of_stage = stage_ranks(placement_of(resolve_schedule(cfg.schedule)), cfg.stages, cfg.ranks)
    last = rank_of_stage[-1]
    return [(k - last) % cfg.ranks for k in range(cfg.ranks)], last


def pipeline_groups(cfg: OverheadConfig, takes: Any) -> dict[str, Any]:
    """The groups of the pipeline, as launched mode makes them (`ProcessGroups`): the world, a second gloo group for
    the messages to lower pipeline ranks, and for two processes their own connection (`p2p.socket_group`), which
    replaces both; a checkout's transport that predates one of them (``takes`` has no ``reverse``, no
    ``p2p.socket_group``) gets what it takes."""
    import importlib.util
    import inspect

    import torch.distributed as dist

    groups: dict[str, Any] = {"group": dist.group.WORLD}
    if "reverse" in inspect.signature(takes).parameters:
        groups["reverse"] = dist.new_group(list(range(cfg.ranks)), backend="gloo")
    if cfg.ranks == 2 and importlib.util.find_spec("lightning_pipe.comm.p2p.socket_group") is not None:
        from lightning_pipe.comm.p2p.socket_group import pipeline_socket

        socket = pipeline_socket(list(range(cfg.ranks)))
        if socket is not None:
            groups.update(group=socket, reverse=socket)
    return groups


class LaunchedRunner(PipelineRunner):
    """Launched mode's engine: global rank 0 coordinates over `P2PCommunicator`, the others run `serve_rank`."""

    def __init__(self, cfg: OverheadConfig) -> None:
        Runner.__init__(self, cfg)
        import torch.distributed as dist

        from lightning_pipe.comm.p2p import P2PCommunicator

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=0, world_size=cfg.ranks)
        ranks, here = launched_ranks(cfg)
        groups = pipeline_groups(cfg, P2PCommunicator)
        self.communicator = P2PCommunicator(ranks=ranks, coordinator=here, timeout=120, **groups)
        self._start(self.communicator)

    def stop(self) -> dict[str, Any]:
        self.pipe.close()
        self.communicator.release()
        return {}


def serve_rank(cfg: OverheadConfig, rank: int) -> None:
    """A serving process of launched mode: its stage until the coordinator releases the pipeline."""
    use_root(cfg.root)
    torch.set_num_threads(1)
    import torch.distributed as dist

    from lightning_pipe.comm.p2p.serve import serve_stages

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=rank, world_size=cfg.ranks)
    ranks, here = launched_ranks(cfg)
    serve_stages(ranks=ranks, coordinator=here, timeout=120, **pipeline_groups(cfg, serve_stages))
    sys.stdout.flush()
    os._exit(0)
