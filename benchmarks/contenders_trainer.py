"""The Lightning Trainer contenders: ``Trainer(strategy=PipeStrategy(...))`` as a user writes it.

Lightning drives the loop; a callback times the steps and answers the orchestrator's commands.
PipeStrategy gets the run's stages, microbatches and schedule and its defaults for everything else.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
import warnings
from multiprocessing.connection import Connection
from typing import Any

import torch

from benchmarks.bench_procs import ROUND_WARMUP, Config, cpu_seconds
from benchmarks.contenders_local import check_split, note_worker_rss, timeline_info, wire_info
from benchmarks.workloads import build_model, loss_fn, make_batches


def quiet_lightning(cfg: Config) -> None:
    """Lightning's warnings and info lines off; this process's intra-op threads as every contender's."""
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # as in EngineRunner; PipeStrategy's default then gives each stage thread min(cfg.threads, cores // stages)
    torch.set_num_threads(cfg.threads)


def make_net(cfg: Config) -> Any:
    """The benchmark's model as a LightningModule: the loss in ``training_step``, SGD."""
    import lightning as L

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

    return Net()


def strategy_arguments(cfg: Config, transport: str) -> dict[str, Any]:
    """The run's configuration (as torch's); everything else PipeStrategy's defaults, as a user gets it.

    ``"p2p"`` passes no transport: launched mode is the default when the Trainer has several processes.
    """
    kwargs: dict[str, Any] = dict(stages=cfg.stages, microbatches=cfg.microbatches, schedule=cfg.schedule)
    if cfg.virtual_stages > 1:  # several stages per process: cut where torch's are cut
        kwargs.update(virtual_stages=cfg.virtual_stages, partition=list(cfg.balance))
    if cfg.backend:
        kwargs["backend"] = cfg.backend
    if transport == "rpc":
        kwargs["transport"] = transport
        if cfg.compress:
            kwargs["compress"] = cfg.compress
    return kwargs


def serve_trainer(conn: Connection, cfg: Config, transport: str) -> None:
    """A Lightning Trainer with PipeStrategy.

    Local transport: the whole benchmark is one fit (`serve_one_fit`). rpc: each command is one ``fit``
    over the steps it asks for; every fit sets the pipeline up again (outside the timed steps, which
    start after `ROUND_WARMUP` untimed ones), so the workers only live during its rounds (they once
    busy-polled in TensorPipe's shared-memory transport, which the rpc transport no longer uses).
    """
    import lightning as L

    quiet_lightning(cfg)
    batches = make_batches(cfg.workload)
    strategy_kwargs = strategy_arguments(cfg, transport)
    net = make_net(cfg)
    conn.send(("ready", os.getpid()))
    if transport == "local":
        serve_one_fit(conn, cfg, net, strategy_kwargs, batches)
        return

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
            seconds = settled_step_seconds(trainer, self.start)
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


def serve_one_fit(
    conn: Connection,
    cfg: Config,
    net: Any,
    strategy_kwargs: dict[str, Any],
    batches: list[Any],
    devices: int | str = "auto",
    wire: bool = False,
) -> None:
    """The whole benchmark as one ``fit``, as a user trains: the commands are taken between steps.

    With the local transport nothing polls while the contender waits for its turn, so, like the
    other local contenders, it keeps its stages between rounds (no restart, no per-round warm-up).
    Before a step the module takes the next command when the last one is done; after its last step
    a command is answered; ``stop`` ends the fit (``on_train_batch_start`` returns -1). With ``wire``
    each ``run`` also reports the tensor bytes its steps sent between processes (read after its last step).
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
            self.trainer: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.trainer = trainer

        def wire_totals(self) -> dict[str, float]:
            """The wire statistics since the last call (zeroed by reading them), when asked for."""
            pipeline = self.trainer.strategy.pipeline if wire and self.trainer is not None else None
            return wire_info(pipeline.communicator) if pipeline is not None else {}

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
            self.wire_totals()
            self.cpu_start = cpu_seconds(os.getpid())
            return True

        def step_start(self) -> bool:
            if self.todo == 0 and not self.next_command():
                return False
            self.start = time.perf_counter()
            return True

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(settled_step_seconds(trainer, self.start))
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
            per_step = {k: v / len(self.times) for k, v in self.wire_totals().items()}
            info = [i | per_step for i in self.info]
            last = _last_result(trainer)  # which schedule ran (schedule="auto": the chosen one) and its prediction
            ran = {"schedule": getattr(getattr(last, "schedule", None), "name", None)}
            ran |= {"microbatches": len(last.losses), "predicted_s": last.predicted} if last is not None else {}
            choice = getattr(trainer.strategy, "schedule_choice", None)  # auto: every candidate's prediction
            if choice is not None:
                ran["placement"] = choice.chosen.placement
                ran["predictions_s"] = {
                    c.name: c.predicted
                    for c in choice.candidates
                    if c.predicted is not None and c.microbatches == choice.chosen.microbatches
                }
            conn.send(("ok", {"times": self.times, "info": info, "cpu": cpu, "ran": ran}))

    driven = Driven()

    class Module(type(net)):  # type: ignore[misc]
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            return None if driven.step_start() else -1  # -1: the epoch (the fit) ends here

    net.__class__ = Module
    trainer = quiet_trainer(strategy_kwargs, driven, devices=devices, max_epochs=1)
    trainer.fit(net, endless_loader(batches))
    conn.send(("ok", {"worker_rss_mb": []}))


def endless_loader(batches: list[Any]) -> Any:
    """``batches`` over and over, in order: one epoch as long as the driver wants."""

    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            index = 0
            while True:
                yield batches[index % len(batches)]
                index += 1

    return torch.utils.data.DataLoader(Endless(), batch_size=None)


def quiet_trainer(strategy_kwargs: dict[str, Any], callback: Any, devices: int | str = "auto", **limits: Any) -> Any:
    """A CPU Trainer with PipeStrategy(**strategy_kwargs) and nothing else that costs time per step."""
    import lightning as L

    from lightning_pipe.strategy import PipeStrategy

    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=PipeStrategy(**strategy_kwargs),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback] if callback is not None else [],
        **limits,
    )


def settled_step_seconds(trainer: Any, start: float) -> float:
    """Seconds since ``start`` until every rank has finished the step, as torch's step is timed (a barrier
    before it, the slowest rank's time). Where the stages own their parameters a train step returns once the
    last stage is done (`Coordinator.settle`); a user's next batch overlaps the first stages' last
    backwards, which this does not count."""
    pipeline = trainer.strategy.pipeline
    if pipeline is not None:
        pipeline.coordinator.settle()
    return time.perf_counter() - start


def _last_result(trainer: Any) -> Any:
    """The last `StepResult` of the strategy's pipeline (``PipeStrategy.last_step``)."""
    return getattr(trainer.strategy, "last_step", None)


def serve_trainer_entry(conn: Connection, cfg: Config, transport: str) -> None:
    try:
        serve_trainer(conn, cfg, transport)
    except Exception:
        conn.send(("error", traceback.format_exc()))
