"""lightning_pipe against torch.distributed.pipelining, side by side in one run.

    python benchmarks/compare.py --workload mlp --stages 2 --microbatches 8 --schedule 1f1b

Contenders, each in its own process(es), all with the same model, initialisation, data and
threads per stage:

- ``unsplit``: the whole model in one process (threads: stages x threads per stage, at most the cores);
- ``torch``: torch.distributed.pipelining, `PipelineStage` + `ScheduleGPipe`/`Schedule1F1B`, one
  process per stage, gloo on 127.0.0.1;
- ``lightning_pipe``: a Lightning ``Trainer`` with ``PipeStrategy`` (local transport: stage threads
  in one process), when the strategy is importable;
- ``engine``: lightning_pipe's `Pipeline` without Lightning (local transport), the engine alone;

lightning_pipe runs with its default arguments besides the run's stages, microbatches and schedule
(``checkpoint="auto"``, ``partition="params"``, ...); its default partition must cut where torch's stages
are cut (checked at the first step).
- ``engine-rpc`` / ``lightning_pipe-rpc``: the same over ``transport="rpc"`` when that transport exists.

After one checked step (all contenders must hold the same parameters), the contenders run in
alternating rounds so machine drift hits all alike. Reported: training samples/s (median, min,
max over the timed steps), the ratio to torch.distributed.pipelining, the efficiency against the
pipeline bound ``batch / ((M + S - 1) * t_max)`` with ``t_max`` the slowest stage's measured
forward+backward time per microbatch, peak RSS per process, and lightning_pipe's engine overhead
(time per microbatch its stage workers spend outside compute and outside waiting).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.workloads import WORKLOADS, build_model, loss_fn, make_batches, stage_module  # noqa: E402

REPLY_TIMEOUT = 900.0  # seconds any worker may take to answer one command
# untimed steps after a contender (re)starts its stages at the beginning of a round: the first step of a new
# pipeline measures its stages and checkpoint="auto" decides before the second (a few control calls)
ROUND_WARMUP = 2


@dataclass
class Config:
    workload: str
    stages: int
    microbatches: int
    schedule: str
    threads: int  # intra-op threads per stage
    unsplit_threads: int
    lr: float
    balance: list[int]
    port: int = 0
    trace_dir: str | None = None
    compress: str | None = None  # the rpc contenders' message compression (``compress=``)

    @property
    def batch(self) -> int:
        return WORKLOADS[self.workload].batch


# ---------------------------------------------------------------------------------------------
# runners: one per worker process; `step()` runs one training step and returns its seconds
# ---------------------------------------------------------------------------------------------
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


class EngineRunner(Runner):
    """lightning_pipe's `Pipeline` (no Lightning): the engine alone, on ``transport``.

    The rpc transport's worker processes busy-poll (TensorPipe) even while idle, which would steal
    cores from the other contenders' rounds, so over rpc the pipeline is started for each round
    (after `ROUND_WARMUP` untimed steps) and closed after it; parameters are synced back in between.
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
        from lightning_pipe.pipeline import Pipeline

        cfg = self.cfg
        options = {"compress": cfg.compress} if cfg.compress and self.transport == "rpc" else {}
        # the run's configuration (as torch's); everything else as a user gets it by default
        self.pipe = Pipeline(
            self.model, stages=cfg.stages, schedule=cfg.schedule, transport=self.transport, threads=cfg.threads,
            **options,        ).start()
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
    """Tensor bytes of the step just done as sent and as they crossed the wire (rpc: after ``compress``),
    summed over the coordinator and every stage; the counts start again for the next step."""
    stats = getattr(communicator, "stats", None)
    if stats is None:
        return {}
    sent = stats(reset=True).values()
    return {
        "tensor_kb_per_step": sum(s.total_bytes() for s in sent) / 1e3,
        "wire_kb_per_step": sum(s.total_wire_bytes() for s in sent) / 1e3,
        "codec_ms_per_step": sum(s.encode_seconds + s.decode_seconds for s in sent) * 1e3,
    }


def timeline_info(result: Any, step: int) -> dict[str, float]:
    """Bubble and engine overhead of one lightning_pipe step, from its stage timeline."""
    from lightning_pipe.trace import StepTimeline

    timeline = StepTimeline.from_result(result, step)
    m = timeline.num_microbatches()
    return {
        "overhead_ms_per_microbatch": timeline.overhead_per_microbatch() * 1e3,
        "compute_ms_per_microbatch": timeline.compute() / m * 1e3,
        "bubble": timeline.measured_bubble(),
        "idle": timeline.idle_fraction(),
        "theoretical_bubble": timeline.theoretical_bubble() or 0.0,
    }


# ---------------------------------------------------------------------------------------------
# the Lightning Trainer contender: Lightning drives the loop, a callback answers the commands
# ---------------------------------------------------------------------------------------------
def serve_trainer(conn: Connection, cfg: Config, transport: str) -> None:
    """A Lightning Trainer with PipeStrategy.

    Local transport: the whole benchmark is one fit (`serve_one_fit`). rpc: each command is one ``fit``
    over the steps it asks for; every fit sets the pipeline up again (outside the timed steps, which
    start after `ROUND_WARMUP` untimed ones), so the busy-polling workers only live during its rounds.
    """
    import logging
    import warnings

    import lightning as L

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # as in EngineRunner; PipeStrategy's default then gives each stage thread min(cfg.threads, cores // stages)
    torch.set_num_threads(cfg.threads)
    batches = make_batches(cfg.workload)
    loss = loss_fn(cfg.workload)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(cfg.workload)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=cfg.lr)

    class Timer(L.Callback):
        """Times the steps after ``warmup``; keeps the last step's parameters when asked to."""

        def __init__(self, warmup: int, keep_params: bool) -> None:
            self.warmup, self.keep_params = warmup, keep_params
            self.times: list[float] = []
            self.info: list[dict[str, float]] = []
            self.params: dict[str, torch.Tensor] = {}
            self.start = 0.0
            self.cpu = (0.0, 0.0)  # CPU seconds (user, system) of the timed steps
            self.cpu_start = (0.0, 0.0)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == self.warmup:
                self.cpu_start = cpu_seconds(os.getpid())
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seconds = time.perf_counter() - self.start
            pipeline = trainer.strategy.pipeline
            wire = wire_info(pipeline.communicator) if pipeline is not None else {}  # this step's bytes
            if batch_idx >= self.warmup:
                self.times.append(seconds)
                now = cpu_seconds(os.getpid())
                self.cpu = (now[0] - self.cpu_start[0], now[1] - self.cpu_start[1])
                result = _last_result(trainer)
                if result is not None:
                    self.info.append(timeline_info(result, batch_idx) | wire)
            if trainer.strategy.pipeline is not None:
                note_worker_rss(worker_rss, trainer.strategy.pipeline.communicator)
            if self.keep_params:
                check_split(trainer.strategy.pipeline, cfg)
                state = trainer.strategy.pipeline.state_dict()
                self.params = {k: v.detach().clone() for k, v in state.items()}

    # the run's configuration (as torch's); everything else PipeStrategy's defaults, as a user gets it
    strategy_kwargs: dict[str, Any] = dict(stages=cfg.stages, microbatches=cfg.microbatches, schedule=cfg.schedule)
    if transport != "local":
        strategy_kwargs["transport"] = transport
        if cfg.compress:
            strategy_kwargs["compress"] = cfg.compress
    net = Net()
    seen = 0  # batches continue across fits
    worker_rss: dict[int, float] = {}

    def fit(warmup: int, steps: int, keep_params: bool = False) -> Timer:
        nonlocal seen
        timer = Timer(warmup, keep_params)
        trainer = quiet_trainer(strategy_kwargs, timer, max_steps=warmup + steps)
        data = [batches[(seen + i) % len(batches)] for i in range(warmup + steps)]
        seen += warmup + steps
        trainer.fit(net, torch.utils.data.DataLoader(data, batch_size=None))
        return timer

    conn.send(("ready", os.getpid()))
    if transport == "local":
        serve_one_fit(conn, cfg, Net(), strategy_kwargs, batches)
        return
    while True:
        command = conn.recv()
        if command[0] == "stop":
            conn.send(("ok", {"worker_rss_mb": [worker_rss[r] for r in sorted(worker_rss)]}))
            return
        if command[0] == "check":
            conn.send(("ok", {"params": fit(0, 1, keep_params=True).params}))
        elif command[0] == "run":
            timer = fit(ROUND_WARMUP, command[1])
            conn.send(("ok", {"times": timer.times, "info": timer.info, "cpu": timer.cpu}))
        else:
            conn.send(("error", f"unexpected command {command!r}"))


def serve_one_fit(conn: Connection, cfg: Config, net: Any, strategy_kwargs: dict[str, Any], batches: list[Any]) -> None:
    """The whole benchmark as one ``fit``, as a user trains: the commands are taken between steps.

    With the local transport nothing polls while the contender waits for its turn, so, like the
    other local contenders, it keeps its stages between rounds (no restart, no per-round warm-up).
    Before a step the module takes the next command when the last one is done; after its last step
    a command is answered; ``stop`` ends the fit (``on_train_batch_start`` returns -1).
    """
    import lightning as L

    class Driven(L.Callback):
        def __init__(self) -> None:
            self.todo = 0  # steps left of the current command
            self.keep_params = False
            self.times: list[float] = []
            self.info: list[dict[str, float]] = []
            self.cpu_start = (0.0, 0.0)
            self.start = 0.0

        def next_command(self) -> bool:
            command = conn.recv()
            if command[0] == "stop":
                return False
            if command[0] == "check":
                self.todo, self.keep_params = 1, True
            elif command[0] == "run":
                self.todo, self.keep_params = command[1], False
            else:
                raise RuntimeError(f"unexpected command {command!r}")
            self.times, self.info = [], []
            self.cpu_start = cpu_seconds(os.getpid())
            return True

        def step_start(self) -> bool:
            if self.todo == 0 and not self.next_command():
                return False
            self.start = time.perf_counter()
            return True

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self.start)
            result = _last_result(trainer)
            if result is not None:
                self.info.append(timeline_info(result, batch_idx))
            self.todo -= 1
            if self.todo:
                return
            if self.keep_params:
                check_split(trainer.strategy.pipeline, cfg)
                state = trainer.strategy.pipeline.state_dict()
                conn.send(("ok", {"params": {k: v.detach().clone() for k, v in state.items()}}))
                return
            now = cpu_seconds(os.getpid())
            cpu = (now[0] - self.cpu_start[0], now[1] - self.cpu_start[1])
            conn.send(("ok", {"times": self.times, "info": self.info, "cpu": cpu}))

    driven = Driven()

    class Module(type(net)):  # type: ignore[misc]
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            return None if driven.step_start() else -1  # -1: the epoch (the fit) ends here

    net.__class__ = Module

    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            index = 0
            while True:
                yield batches[index % len(batches)]
                index += 1

    trainer = quiet_trainer(strategy_kwargs, driven, max_epochs=1)
    trainer.fit(net, torch.utils.data.DataLoader(Endless(), batch_size=None))
    conn.send(("ok", {"worker_rss_mb": []}))


def quiet_trainer(strategy_kwargs: dict[str, Any], callback: Any, **limits: Any) -> Any:
    """A CPU Trainer with PipeStrategy(**strategy_kwargs) and nothing else that costs time per step."""
    import lightning as L

    from lightning_pipe.strategy import PipeStrategy

    return L.Trainer(
        accelerator="cpu",
        strategy=PipeStrategy(**strategy_kwargs),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
        **limits,
    )


def _last_result(trainer: Any) -> Any:
    """The last `StepResult` of the strategy's pipeline (``PipeStrategy.last_step``)."""
    return getattr(trainer.strategy, "last_step", None)


# ---------------------------------------------------------------------------------------------
# worker processes and the orchestrator
# ---------------------------------------------------------------------------------------------
def serve(conn: Connection, factory: Callable[..., Runner], args: tuple[Any, ...]) -> None:
    """A worker process: build the runner, then answer commands until ``stop``."""
    try:
        runner = factory(*args)
        conn.send(("ready", os.getpid()))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                conn.send(("ok", runner.stop()))
                return
            method = getattr(runner, command[0])
            conn.send(("ok", method(*command[1:])))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def serve_trainer_entry(conn: Connection, cfg: Config, transport: str) -> None:
    try:
        serve_trainer(conn, cfg, transport)
    except Exception:
        conn.send(("error", traceback.format_exc()))


@dataclass
class Contender:
    """One library configuration: one or more worker processes."""

    name: str
    transport: str = "local"
    workers: list[tuple[Any, Connection]] = field(default_factory=list)
    rounds: list[list[float]] = field(default_factory=list)  # step seconds, one list per round
    cpu: list[tuple[float, float]] = field(default_factory=list)  # per round: (user, system) CPU seconds per step
    info: list[dict[str, float]] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)

    def ask(self, *command: Any) -> list[Any]:
        for _, conn in self.workers:
            conn.send(command)
        return [reply(conn, self.name, command[0]) for _, conn in self.workers]


def reply(conn: Connection, name: str, what: str) -> Any:
    if not conn.poll(REPLY_TIMEOUT):
        raise TimeoutError(f"{name} did not answer {what!r} within {REPLY_TIMEOUT:.0f} s")
    status, value = conn.recv()
    if status == "error":
        raise RuntimeError(f"{name} failed during {what!r}:\n{value}")
    return value


def spawn(ctx: Any, contender: Contender, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=False)
    process.start()
    contender.workers.append((process, parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss_mb(pid: int) -> list[float]:
    """Peak resident memory (VmHWM, MB) of ``pid`` and then of each of its descendants."""
    peaks = []
    pending = [pid]
    while pending:
        current = pending.pop(0)
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) / 1024)
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
    return peaks


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds used so far by ``pid`` and its descendants (all their threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    pending = [pid]
    while pending:
        current = pending.pop(0)
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            user += int(fields[11]) / tick  # utime: field 14 of stat, counted after the command name
            system += int(fields[12]) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
    return user, system


def available_transports() -> list[str]:
    import importlib.util

    from lightning_pipe.transports import TRANSPORTS

    spec = importlib.util.find_spec("lightning_pipe.comm.rpc")
    if spec is not None and spec.origin is not None and Path(spec.origin).is_relative_to(REPO):
        import lightning_pipe.comm.rpc  # noqa: F401 - registers transport="rpc" where it exists
    return sorted(TRANSPORTS)


def has_strategy() -> bool:
    """Whether this checkout has the Lightning strategy (not another copy of lightning_pipe on the path)."""
    import importlib.util

    spec = importlib.util.find_spec("lightning_pipe.strategy")
    return spec is not None and spec.origin is not None and Path(spec.origin).is_relative_to(REPO)


def start_contenders(cfg: Config, names: list[str]) -> list[Contender]:
    ctx = mp.get_context("spawn")
    contenders: list[Contender] = []
    for label in names:
        name = label.split("#")[0]  # "engine#2": a second copy of a contender, to see the noise between equals
        contender = Contender(label, transport="rpc" if name.endswith("-rpc") else "local")
        if name == "unsplit":
            spawn(ctx, contender, serve, (UnsplitRunner, (cfg,)))
        elif name == "torch":
            cfg.port = free_port()
            for rank in range(cfg.stages):
                spawn(ctx, contender, serve, (TorchPipeRunner, (cfg, rank)))
        elif name.startswith("engine"):
            spawn(ctx, contender, serve, (EngineRunner, (cfg, contender.transport)))
        elif name.startswith("lightning_pipe"):
            spawn(ctx, contender, serve_trainer_entry, (cfg, contender.transport))
        else:
            raise ValueError(f"unknown contender {name!r}")
        for _, conn in contender.workers:
            reply(conn, label, "start")
        contenders.append(contender)
    return contenders


def compare_params(
    initial: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Whether ``other`` made the same first update as ``reference``, relative to the update's size."""
    missing = sorted(set(reference) ^ set(other))
    keys = [k for k in reference if k in other and reference[k].is_floating_point()]
    update = max((reference[k] - initial[k]).abs().max().item() for k in keys)
    diff = max((reference[k] - other[k]).abs().max().item() for k in keys)
    relative = diff / update if update > 0 else float("inf")
    same = not missing and relative < 1e-3
    return {"max_abs_diff": diff, "update": update, "relative": relative, "same": same, "missing": missing}


def run(cfg: Config, names: list[str], warmup: int, rounds: int, steps: int) -> dict[str, Any]:
    contenders = start_contenders(cfg, names)
    by_name = {c.name: c for c in contenders}
    try:
        # one checked step from the same initial parameters
        for contender in contenders:
            for answer in contender.ask("check"):
                contender.params.update(answer["params"])
        initial = build_model(cfg.workload).state_dict()
        reference = by_name["torch"].params if "torch" in by_name else contenders[0].params
        checks = {c.name: compare_params(initial, reference, c.params) for c in contenders}
        for contender in contenders:
            contender.ask("run", warmup)
        stage_times: list[list[float]] = []
        for r in range(rounds):
            order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
            for contender in order:
                answers = contender.ask("run", steps)
                user = sum(a["cpu"][0] for a in answers) / steps
                contender.cpu.append((user, sum(a["cpu"][1] for a in answers) / steps))
                contender.rounds.append([max(ts) for ts in zip(*(a["times"] for a in answers), strict=True)])
                for answer in answers:
                    contender.info.extend(answer["info"])
            if "unsplit" in by_name:
                stage_times.append(by_name["unsplit"].ask("profile")[0])
            print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        for contender in contenders:
            contender.rss_mb = [mb for process, _ in contender.workers for mb in peak_rss_mb(process.pid)]
            for answer in contender.ask("stop"):
                contender.rss_mb += (answer or {}).get("worker_rss_mb", [])
    finally:
        for contender in contenders:
            for process, _ in contender.workers:
                process.join(30)
                if process.is_alive():
                    process.terminate()
                    process.join(10)
    return summarize(cfg, contenders, checks, stage_times)


def summarize(
    cfg: Config, contenders: list[Contender], checks: dict[str, Any], stage_times: list[list[float]]
) -> dict[str, Any]:
    """Throughput, ratios and efficiencies.

    The machine's speed drifts (other jobs share the cores), so besides medians over all timed steps
    this reports the *paired* ratio (each round's median step time against torch's in the same round,
    then the median over rounds) and best-case numbers (fastest step, fastest stage profile).
    """
    per_stage = [statistics.median(ts) for ts in zip(*stage_times, strict=True)] if stage_times else []
    best_stage = [min(ts) for ts in zip(*stage_times, strict=True)] if stage_times else []
    span = cfg.microbatches + cfg.stages - 1
    bound_step = span * max(per_stage) if per_stage else None
    best_bound_step = span * max(best_stage) if best_stage else None
    torch_rounds = next((c.rounds for c in contenders if c.name == "torch"), None)
    rows: dict[str, Any] = {}
    for c in contenders:
        times = [t for r in c.rounds for t in r]
        rates = [cfg.batch / t for t in times]
        row: dict[str, Any] = {
            "samples_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
            "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_best": min(times) * 1e3,
            # CPU time of all the contender's processes and threads per step: unlike wall time it hardly
            # changes when other jobs share the machine, so it shows each library's own cost
            "cpu_ms_per_step": {
                "user": statistics.median(u for u, _ in c.cpu) * 1e3,
                "system": statistics.median(s for _, s in c.cpu) * 1e3,
            },
            "steps_timed": len(times),
            "peak_rss_mb": [round(x, 1) for x in c.rss_mb],
            "params_match": checks[c.name],
        }
        if bound_step and best_bound_step:
            row["efficiency_vs_bound"] = bound_step / statistics.median(times)
            row["efficiency_vs_bound_best"] = best_bound_step / min(times)
        if torch_rounds is not None:
            paired = [
                statistics.median(theirs) / statistics.median(ours)
                for ours, theirs in zip(c.rounds, torch_rounds, strict=True)
            ]
            row["ratio_vs_torch_paired"] = statistics.median(paired)
            row["ratio_vs_torch_per_round"] = paired
        if c.info:
            row["engine"] = {k: statistics.median(i[k] for i in c.info) for k in c.info[0]}
            row["engine"]["overhead_share_of_compute"] = (
                row["engine"]["overhead_ms_per_microbatch"] / row["engine"]["compute_ms_per_microbatch"]
            )
        rows[c.name] = row
    if "torch" in rows:
        torch_row = rows["torch"]
        for row in rows.values():
            row["ratio_vs_torch"] = row["samples_per_s"]["median"] / torch_row["samples_per_s"]["median"]
            row["ratio_vs_torch_best"] = torch_row["step_ms_best"] / row["step_ms_best"]
    return {
        "config": asdict(cfg) | {"batch": cfg.batch, "torch": torch.__version__, "cpus": os.cpu_count()},
        "stage_fwd_bwd_ms": [t * 1e3 for t in per_stage],
        "stage_fwd_bwd_ms_best": [t * 1e3 for t in best_stage],
        "bound_samples_per_s": cfg.batch / bound_step if bound_step else None,
        "bound_samples_per_s_best": cfg.batch / best_bound_step if best_bound_step else None,
        "contenders": rows,
    }


def _fmt(row: dict[str, Any], key: str, digits: int = 3) -> str:
    return f"{row[key]:.{digits}f}" if key in row else "-"


def _overhead(row: dict[str, Any]) -> str:
    """lightning_pipe's engine overhead per microbatch and its share of stage compute ("" for others)."""
    if "engine" not in row:
        return ""
    e = row["engine"]
    return f"{e['overhead_ms_per_microbatch']:.2f} ms ({e['overhead_share_of_compute']:.1%})"


def format_table(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"{cfg['workload']}, {cfg['stages']} stages, {cfg['microbatches']} microbatches, {cfg['schedule']}, "
        f"batch {cfg['batch']}, {cfg['threads']} thread(s) per stage, torch {cfg['torch']}",
    ]
    if results["stage_fwd_bwd_ms"]:
        lines.append(
            "stage forward+backward per microbatch, ms (median / best): "
            + ", ".join(
                f"{m:.2f}/{b:.2f}"
                for m, b in zip(results["stage_fwd_bwd_ms"], results["stage_fwd_bwd_ms_best"], strict=True)
            )
            + f"; bound (M+S-1)*t_max: {results['bound_samples_per_s']:.1f} / {results['bound_samples_per_s_best']:.1f}"
            " samples/s"
        )
    cells = [
        ("contender", 20),
        ("samples/s median [min, max]", 28),
        ("vs torch (paired)", 17),
        ("vs torch (best)", 15),
        ("eff. vs bound (median/best)", 27),
        ("CPU ms/step user+sys", 20),
        ("peak RSS MB/process", 20),
        ("engine overhead/mb", 20),
        ("params", 8),
    ]
    lines.append("| " + " | ".join(f"{name:<{width}}" for name, width in cells) + " |")
    lines.append("|" + "|".join("-" * (width + 2) for _, width in cells) + "|")
    for name, row in results["contenders"].items():
        rate, overhead = row["samples_per_s"], _overhead(row)
        same = "same" if row["params_match"]["same"] else f"DIFF {row['params_match']['relative']:.1e}"
        values = [
            name,
            f"{rate['median']:.1f} [{rate['min']:.1f}, {rate['max']:.1f}]",
            _fmt(row, "ratio_vs_torch_paired"),
            _fmt(row, "ratio_vs_torch_best"),
            f"{_fmt(row, 'efficiency_vs_bound')} / {_fmt(row, 'efficiency_vs_bound_best')}",
            f"{row['cpu_ms_per_step']['user']:.0f} + {row['cpu_ms_per_step']['system']:.0f}",
            " + ".join(f"{x:.0f}" for x in row["peak_rss_mb"]),
            overhead,
            same,
        ]
        lines.append("| " + " | ".join(f"{v:<{width}}" for v, (_, width) in zip(values, cells, strict=True)) + " |")
    for name, row in results["contenders"].items():
        if "engine" in row:
            e = row["engine"]
            lines.append(
                f"{name}: measured bubble {e['bubble']:.3f} (idle {e['idle']:.3f}), "
                f"theoretical {e['theoretical_bubble']:.3f}"
            )
            if "wire_kb_per_step" in e:
                lines.append(
                    f"{name}: {e['wire_kb_per_step']:.1f} KB per step on the wire for {e['tensor_kb_per_step']:.1f} KB "
                    f"of tensors ({e['wire_kb_per_step'] / e['tensor_kb_per_step']:.0%}, compress={cfg['compress']}), "
                    f"compression {e['codec_ms_per_step']:.2f} ms of CPU per step, step {row['step_ms_median']:.1f} ms "
                    "median"
                )
    return "\n".join(lines)


def summary_table(paths: list[str]) -> str:
    """One markdown table of several result files (``--summary``): the columns the README quotes."""
    lines = [
        "| workload | stages | contender | samples/s median [min, max] | vs torch (paired) | vs torch (medians) |"
        " eff. vs bound | peak RSS MB/process | engine overhead/mb |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path in paths:
        results = json.loads(Path(path).read_text())
        cfg = results["config"]
        for name, row in results["contenders"].items():
            rate, overhead = row["samples_per_s"], _overhead(row)
            cells = [
                cfg["workload"],
                str(cfg["stages"]),
                name,
                f"{rate['median']:.1f} [{rate['min']:.1f}, {rate['max']:.1f}]",
                _fmt(row, "ratio_vs_torch_paired", 2),
                _fmt(row, "ratio_vs_torch", 2),
                _fmt(row, "efficiency_vs_bound", 2),
                " + ".join(f"{x:.0f}" for x in row["peak_rss_mb"]),
                overhead,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads per stage (default: cores/stages)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per contender before the rounds")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per contender per round")
    parser.add_argument("--contenders", default=None, help="comma-separated subset; default: all available")
    parser.add_argument(
        "--compress", default=None, help="message compression of the rpc contenders: bf16, fp16, zstd, bf16+zstd, ..."
    )
    parser.add_argument("--json", default=None, help="where to write the results (default: benchmarks/results/)")
    parser.add_argument("--summary", nargs="+", metavar="JSON", help="print one markdown table of result files")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary_table(args.summary))
        return {}

    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.stages)
    cfg = Config(
        workload=args.workload,
        stages=args.stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        threads=threads,
        unsplit_threads=min(cores, threads * args.stages),
        lr=args.lr,
        balance=WORKLOADS[args.workload].balance(args.stages),
        compress=args.compress,
    )
    names = ["unsplit", "torch", "engine"]
    if has_strategy():
        names.append("lightning_pipe")
    if "rpc" in available_transports():
        names += ["engine-rpc"] + (["lightning_pipe-rpc"] if has_strategy() else [])
    if args.contenders:
        names = [n.strip() for n in args.contenders.split(",")]
    print(f"contenders: {', '.join(names)}; balance {cfg.balance}", file=sys.stderr, flush=True)
    results = run(cfg, names, args.warmup, args.rounds, args.steps)
    table = format_table(results)
    print(table)
    path = (
        Path(args.json)
        if args.json
        else REPO
        / "benchmarks"
        / "results"
        / (
            f"{cfg.workload}-{cfg.stages}stages-{cfg.microbatches}mb-{cfg.schedule}"
            + (f"-{cfg.compress}" if cfg.compress else "")
            + ".json"
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    results["table"] = table
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
