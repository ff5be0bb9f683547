"""Contenders that run in one process each: the unsplit model and lightning_pipe's `Pipeline` (the engine).

A `Runner` lives in a worker process (`bench_procs.serve`); ``step()`` runs one training step and returns
its seconds. Also here: what the lightning_pipe contenders read from a pipeline after a step (its
timeline, its wire statistics, its workers' memory), shared with the Trainer contenders.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from benchmarks.bench_procs import ROUND_WARMUP, Config, cpu_seconds, peak_rss_mb
from benchmarks.workloads import build_model, loss_fn, make_batches, stage_module


class Runner:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.batches = make_batches(cfg.workload)
        self.loss = loss_fn(cfg.workload)
        self.index = 0
        self.info: list[dict[str, float]] = []

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batches[self.index % len(self.batches)]
        self.index += 1
        return x, y

    def step(self) -> float:
        raise NotImplementedError

    def params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def run(self, steps: int) -> dict[str, Any]:
        if self.open_round():
            for _ in range(ROUND_WARMUP):
                self.step()
        self.info = []
        before = cpu_seconds(os.getpid())
        times = [self.step() for _ in range(steps)]
        after = cpu_seconds(os.getpid())
        self.close_round()
        return {"times": times, "info": self.info, "cpu": (after[0] - before[0], after[1] - before[1])}

    def check(self) -> dict[str, Any]:
        self.open_round()
        self.step()
        params = {k: v.detach().clone() for k, v in self.params().items()}
        self.close_round()
        return {"params": params}

    def open_round(self) -> bool:
        """Start what only lives during a round; True if something was started (it gets warm-up steps)."""
        return False

    def close_round(self) -> None:
        """Stop what `open_round` started."""

    def stop(self) -> dict[str, Any]:
        return {}


class UnsplitRunner(Runner):
    """The whole model in one process; also measures each stage's forward+backward for the bound."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        torch.set_num_threads(cfg.unsplit_threads)
        self.model = build_model(cfg.workload)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr)

    def step(self) -> float:
        x, y = self.batch()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.loss(self.model(x), y).backward()
        self.optimizer.step()
        return time.perf_counter() - start

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def profile(self, reps: int = 5) -> list[float]:
        """Median forward+backward seconds of one microbatch on each stage, with a stage's threads."""
        cfg = self.cfg
        torch.set_num_threads(cfg.threads)
        try:
            x, y = self.batches[0]
            rows = cfg.batch // cfg.microbatches
            x, y = x[:rows], y[:rows]
            stages = [stage_module(self.model, cfg.balance, s) for s in range(cfg.stages)]
            inputs = []
            with torch.no_grad():
                h = x
                for module in stages:
                    inputs.append(h)
                    h = module(h)
            seconds = []
            for s, module in enumerate(stages):
                samples = []
                for _ in range(reps + 2):
                    h = inputs[s].detach().requires_grad_(inputs[s].is_floating_point())
                    start = time.perf_counter()
                    out = module(h)
                    if s == cfg.stages - 1:
                        self.loss(out, y).backward()
                    else:
                        out.backward(torch.ones_like(out))
                    samples.append(time.perf_counter() - start)
                seconds.append(statistics.median(samples[2:]))
            self.model.zero_grad(set_to_none=True)
            return seconds
        finally:
            torch.set_num_threads(cfg.unsplit_threads)


class MicrobatchRunner(UnsplitRunner):
    """The whole model in one process on the pipeline's microbatches (gradients accumulated), with a stage's threads;
    ``backend="inductor"``: the model under a plain ``torch.compile``. Compiled against eager here is what inductor
    gains on this model at the sizes a stage runs, with no pipeline and no split backward."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        torch.set_num_threads(cfg.threads)
        self.forward = torch.compile(self.model) if cfg.backend == "inductor" else self.model

    def step(self) -> float:
        x, y = self.batch()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        for xm, ym in zip(x.chunk(self.cfg.microbatches), y.chunk(self.cfg.microbatches), strict=True):
            (self.loss(self.forward(xm), ym) / self.cfg.microbatches).backward()
        self.optimizer.step()
        return time.perf_counter() - start


class EngineRunner(Runner):
    """lightning_pipe's `Pipeline` (no Lightning): the engine alone, on ``transport``.

    The rpc transport's worker processes once busy-polled (TensorPipe's shared-memory transport, no longer
    used) even while idle, stealing cores from the other contenders' rounds; so over rpc the pipeline is
    still started for each round (after `ROUND_WARMUP` untimed steps) and closed after it; parameters are
    synced back in between.
    """

    def __init__(self, cfg: Config, transport: str) -> None:
        super().__init__(cfg)
        # every thread of the process (stages, coordinator, optimizer step) uses cfg.threads, as each
        # torch.distributed.pipelining process does: a 2-thread OpenMP pool stalls badly on a busy machine
        torch.set_num_threads(cfg.threads)
        self.transport = transport
        self.model = build_model(cfg.workload)
        self.pipe: Any = None
        self.optimizer: Any = None
        self.worker_rss: dict[int, float] = {}  # peak RSS (MB) of each stage worker process (rpc)
        if transport == "local":
            self._open()

    def _open(self) -> None:
        from lightning_pipe.pipeline.pipeline import Pipeline

        cfg = self.cfg
        options = {"compress": cfg.compress} if cfg.compress and self.transport == "rpc" else {}
        # the run's configuration (as torch's); everything else as a user gets it by default
        self.pipe = Pipeline(
            self.model,
            stages=cfg.stages,
            schedule=cfg.schedule,
            transport=self.transport,
            threads=cfg.threads,
            **options,
        ).start()
        template = torch.optim.SGD(self.model.parameters(), lr=cfg.lr)
        # with stages in other processes the parameters live there: the optimizer steps on the stages
        self.optimizer = template if self.transport == "local" else self.pipe.optimizer(template)

    def open_round(self) -> bool:
        if self.pipe is not None:
            return False
        self._open()
        return True

    def close_round(self) -> None:
        if self.transport != "local" and self.pipe is not None:
            note_worker_rss(self.worker_rss, self.pipe.communicator)
            self.pipe.sync_module()
            self.pipe.close()
            self.pipe = None

    def step(self) -> float:
        x, y = self.batch()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        result = self.pipe.train_step(x, y, self.loss, microbatches=self.cfg.microbatches)
        self.optimizer.step()
        self.pipe.coordinator.settle()  # every rank done, as torch's step is timed (see settled_step_seconds)
        seconds = time.perf_counter() - start
        self.info.append(timeline_info(result, self.index) | wire_info(self.pipe.communicator))
        return seconds

    def params(self) -> dict[str, torch.Tensor]:
        check_split(self.pipe, self.cfg)
        return self.pipe.state_dict()  # as the stages hold them (with rpc, only there)

    def stop(self) -> dict[str, Any]:
        if self.pipe is not None:
            self.pipe.close()
        return {"worker_rss_mb": [self.worker_rss[r] for r in sorted(self.worker_rss)]}


def check_split(pipeline: Any, cfg: Config) -> None:
    """The default partition must cut where torch's stages are cut (``cfg.balance``), or the contenders differ."""
    if pipeline.balance != cfg.balance:
        raise RuntimeError(
            f"lightning_pipe's default partition split the {cfg.workload} model as {pipeline.balance}, torch's stages "
            f"as {cfg.balance}: the contenders would not run the same stages; align BALANCES in workloads.py"
        )


def note_worker_rss(peaks: dict[int, float], communicator: Any) -> None:
    """Keep the largest peak RSS seen of each stage worker process (transports with ``pids``)."""
    for rank, pid in getattr(communicator, "pids", {}).items():
        for mb in peak_rss_mb(pid)[:1]:
            peaks[rank] = max(peaks.get(rank, 0.0), mb)


def wire_info(communicator: Any) -> dict[str, float]:
    """Tensor bytes of the steps since the last call as sent and as they crossed the wire (rpc: after
    ``compress``; p2p: with the frames' headers and pickled parts), summed over the coordinator and every
    stage; the counts start again."""
    stats = getattr(communicator, "stats", None)
    if stats is None:
        return {}
    sent = stats(reset=True).values()
    return {
        "tensor_kb_per_step": sum(s.total_bytes() for s in sent) / 1e3,
        "wire_kb_per_step": sum(_wire_bytes(s) for s in sent) / 1e3,
        "codec_ms_per_step": sum(getattr(s, "encode_seconds", 0.0) + getattr(s, "decode_seconds", 0.0) for s in sent)
        * 1e3,
    }


def _wire_bytes(stats: Any) -> int:
    """What one endpoint put on the wire: rpc's count, or p2p's tensors, pickled parts and headers."""
    if hasattr(stats, "total_wire_bytes"):
        return int(stats.total_wire_bytes())
    return stats.total_bytes() + sum(stats.pickled_bytes.values()) + sum(stats.header_bytes.values())


def timeline_info(result: Any, step: int) -> dict[str, float]:
    """Bubble and engine overhead of one lightning_pipe step, from its stage timeline."""
    from lightning_pipe.pipeline.timeline import StepTimeline

    timeline = StepTimeline.from_result(result, step)
    m = timeline.num_microbatches()
    return {
        "overhead_ms_per_microbatch": timeline.overhead_per_microbatch() * 1e3,
        "compute_ms_per_microbatch": timeline.compute() / m * 1e3,
        "bubble": timeline.measured_bubble(),
        "idle": timeline.idle_fraction(),
        "theoretical_bubble": timeline.theoretical_bubble() or 0.0,
    }
