"""The processes of the p2p tests: ``python p2p_procs.py SCENARIO[,SCENARIO...] RANK WORLD PORT OUTDIR``.

Each process joins a gloo world on 127.0.0.1 and plays its part of each scenario in turn (a process start
costs seconds: one world serves several scenarios), writing ``OUTDIR/<scenario>/<rank>.json`` (``{"ok": ...}``
and what it measured, or the error's traceback); after a failed scenario it plays no more. A scenario that
kills a process comes last. Pipeline rank 0 of each pipeline compares against a local model itself.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rpc_models import FailsOn
from torch import nn

from lightning_pipe import Pipeline
from lightning_pipe.base.errors import StageError, TransportError
from lightning_pipe.comm.p2p import P2PCommunicator
from lightning_pipe.comm.p2p.frames import TENSOR_KINDS
from lightning_pipe.comm.p2p.serve import serve_stages
from lightning_pipe.engine import StageProtocol


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def data(seed: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)


class KillsItsProcess(nn.Module):
    """SIGKILLs the process it runs in at its first training forward (a stage lost mid-step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            os.kill(os.getpid(), signal.SIGKILL)
        return x


def describer(ranks: list[int], replica: int) -> Callable[[int], str]:
    return lambda g: f"global rank {g} (pipeline rank {ranks.index(g)} of replica {replica})"


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max())


def train_and_compare(comm: P2PCommunicator, stages: int, schedule: str, batches: list[Any]) -> dict[str, float]:
    """Two SGD steps on the pipeline and on the unsplit model; the largest differences."""
    model = mlp()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    out: dict[str, float] = {}
    with Pipeline(model, stages=stages, schedule=schedule, partition="uniform", transport=comm, timeout=60) as pipe:
        opt = pipe.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for step, (xs, ys) in enumerate(batches):
            opt.zero_grad()
            ref_opt.zero_grad()
            # 3 stages: 16 rows as 6 + 5 + 5, so the bundled inputs of microbatches 1 and 2 differ from the first's
            pipe.train_step(xs[0], ys[0], F.cross_entropy, microbatches=3 if stages == 3 else 4)
            sum(F.cross_entropy(reference(x), y) for x, y in zip(xs, ys, strict=True)).div(len(xs)).backward()
            opt.step()
            ref_opt.step()
            if step == 0:
                pipe.coordinator.settle()  # the first stages end their step after train_step returned
                comm.stats(reset=True)
        pipe.coordinator.settle()
        out["in_flight"] = max(comm.in_flight().values())
        stats = comm.stats()
        state = pipe.state_dict()
        out["state"] = max(close(state[k], v) for k, v in reference.state_dict().items())
        x, _ = data(99)
        out["forward"] = close(pipe.forward(x, microbatches=2), reference(x))
    kinds = [k for k in TENSOR_KINDS]
    out["tensor_pickled"] = sum(s.pickled_bytes[k] for s in stats.values() for k in kinds)
    out["tensor_messages"] = sum(s.messages[k] for s in stats.values() for k in kinds)
    out["tensor_header_bytes"] = sum(s.header_bytes[k] for s in stats.values() for k in kinds)
    out["tensor_bytes"] = sum(s.tensor_bytes[k] for s in stats.values() for k in kinds)
    return out


def coordinator_train(
    group: Any, ranks: list[int], replica: int = 0, on_build: Any = None, reverse: Any = None
) -> dict[str, Any]:
    comm = P2PCommunicator(group, ranks, describer(ranks, replica), on_build=on_build, timeout=60, reverse=reverse)
    result: dict[str, Any] = {}
    try:
        mine = [data(10 * replica + step) for step in range(2)]
        if on_build is None:
            batches = [([x], [y]) for x, y in mine]
        else:  # two replicas, gradients averaged: the unsplit model sees both replicas' batches
            other = [data(10 * (1 - replica) + step) for step in range(2)]
            batches = [([x, ox], [y, oy]) for (x, y), (ox, oy) in zip(mine, other, strict=True)]
        for schedule in ("gpipe", "1f1b"):
            result[schedule] = train_and_compare(comm, len(ranks), schedule, batches)
        if len(ranks) == 2 and on_build is None:
            result.update(large_tensor(comm), stage_error=stage_error(comm), posted_error=posted_error(comm))
    finally:
        comm.release()
    return result


def large_tensor(comm: P2PCommunicator) -> dict[str, Any]:
    """Messages larger than an inline frame: a 64 MiB activation there and back, then two of 16 MiB (the
    second into a body posted ahead), and a stage built with 16 MiB of parameters (a large control message)."""
    x = torch.randn(4096, 4096)
    with Pipeline(nn.Sequential(nn.ReLU(), nn.ReLU()), stages=2, partition="uniform", transport=comm) as pipe:
        start = time.perf_counter()
        y = pipe.forward(x)
        seconds = time.perf_counter() - start
    equal = torch.equal(y, x.relu())
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU())
    with Pipeline(model, stages=2, partition="uniform", transport=comm) as pipe:
        for step in range(2):
            x = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(step))
            equal = equal and torch.allclose(pipe.forward(x), model(x), atol=1e-6)

    return {"large_equal": bool(equal), "large_seconds": seconds}


def stage_error(comm: P2PCommunicator) -> str:
    model = nn.Sequential(nn.Linear(8, 8), FailsOn(7.0))
    x, y = data(3)
    x[0, 0] = 7.0  # the linear layer of stage 0 is the identity: the marked row reaches stage 1 as it is
    model[0].weight.data = torch.eye(8)
    model[0].bias.data.zero_()
    with Pipeline(model, stages=2, partition="uniform", transport=comm, timeout=60) as pipe:
        try:
            pipe.train_step(x, y, lambda out, target: out.sum())
        except StageError as exc:
            return str(exc)
    return "no StageError"


def posted_error(comm: P2PCommunicator) -> str:
    """A posted call fails on the remote stage only (it has no stage 5): raised at the next step."""
    x, y = data(3)
    with Pipeline(mlp(), stages=2, partition="uniform", transport=comm, timeout=60) as pipe:
        pipe.coordinator.stages.post_each(StageProtocol.load_random_state, [({},), ({5: {}},)])
        try:
            pipe.train_step(x, y, F.cross_entropy)
        except StageError as exc:
            return str(exc)
    return "no StageError"


def kill_stage(group: Any, ranks: list[int]) -> dict[str, Any]:
    comm = P2PCommunicator(group, ranks, describer(ranks, 0), timeout=60)
    model = nn.Sequential(nn.Linear(8, 8), KillsItsProcess())
    x, y = data(0)
    start = time.monotonic()
    error = "no TransportError"
    try:
        with Pipeline(model, stages=2, partition="uniform", transport=comm, timeout=60) as pipe:
            start = time.monotonic()
            try:
                pipe.train_step(x, y, lambda out, target: out.sum())
            except TransportError as exc:
                error = str(exc)
    finally:
        comm.release("stage lost", timeout=10)
    return {"error": error, "seconds": time.monotonic() - start}


def kill_coordinator(group: Any, ranks: list[int], outdir: str) -> None:
    comm = P2PCommunicator(group, ranks, describer(ranks, 0), timeout=60)
    pipe = Pipeline(mlp(), stages=len(ranks), partition="uniform", transport=comm, timeout=60).start()
    x, y = data(0)
    pipe.train_step(x, y, F.cross_entropy)
    write(outdir, 0, {"ok": True, "killed_at": time.time()})
    os.kill(os.getpid(), signal.SIGKILL)


def coordinator_last(group: Any, reverse: Any) -> dict[str, Any]:
    """The layout launched mode uses: global rank 0 holds the last stage and feeds stage 0 in rank 1 (a group per
    direction, as launched mode makes them)."""
    comm = P2PCommunicator(group, [1, 0], describer([1, 0], 0), timeout=60, coordinator=1, reverse=reverse)
    try:
        batches = [([x], [y]) for x, y in (data(step) for step in range(2))]
        result: dict[str, Any] = {"1f1b": train_and_compare(comm, 2, "1f1b", batches)}
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())
        x = torch.randn(4096, 1024)  # 4 microbatches of 4 MiB: inputs 1-3 are one bundle too large for a frame
        with Pipeline(model, stages=2, partition="uniform", transport=comm) as pipe:
            result["bundle_equal"] = bool(torch.allclose(pipe.forward(x, microbatches=4), model(x), atol=1e-6))
            result["small_bundle_equal"] = bool(torch.allclose(pipe.forward(x[:64], microbatches=4), model(x[:64])))
    finally:
        comm.release()
    return result


def serve(
    group: Any, ranks: list[int], replica: int, on_build: Any = None, coordinator: int = 0, reverse: Any = None
) -> dict[str, Any]:
    start = time.time()
    try:
        describe = describer(ranks, replica)
        serve_stages(group, ranks, describe, on_build=on_build, timeout=60, coordinator=coordinator, reverse=reverse)
    except TransportError as exc:
        return {"error": str(exc), "at": time.time(), "start": start}
    return {"error": None}


def run(scenario: str, rank: int, world: int, outdir: str) -> dict[str, Any]:
    if scenario == "dp":  # two pipelines of two; each stage's gradients averaged over the replicas
        pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        replica, ranks = rank // 2, [2 * (rank // 2), 2 * (rank // 2) + 1]
        dp = replicas[rank % 2]
        on_build = lambda worker: worker.replicate(dp)  # noqa: E731
        if rank % 2 == 0:
            return coordinator_train(pipelines[replica], ranks, replica, on_build)
        return serve(pipelines[replica], ranks, replica, on_build)
    ranks = list(range(world))
    group = dist.new_group(ranks)
    # training runs with a group per direction (launched mode's), the faults over one group
    reverse = dist.new_group(ranks) if scenario in ("train", "last") else None
    if scenario == "last":
        if rank == 0:
            return coordinator_last(group, reverse)
        return serve(group, [1, 0], 0, coordinator=1, reverse=reverse)
    if rank > 0:
        return serve(group, ranks, 0, reverse=reverse)
    if scenario == "train":
        return coordinator_train(group, ranks, reverse=reverse)
    if scenario == "kill_stage":
        return kill_stage(group, ranks)
    if scenario == "kill_coordinator":
        kill_coordinator(group, ranks, outdir)
    raise ValueError(scenario)


def write(outdir: str, rank: int, result: dict[str, Any]) -> None:
    path = os.path.join(outdir, f"{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    scenarios, rank, world, port, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    for scenario in scenarios.split(","):
        folder = os.path.join(outdir, scenario)
        os.makedirs(folder, exist_ok=True)
        try:
            result = {"ok": True} | run(scenario, rank, world, folder)
        except BaseException:
            result = {"ok": False, "traceback": traceback.format_exc()}
        write(folder, rank, result)
        print(f"[rank {rank}] scenario {scenario} ended", flush=True)
        if not result["ok"]:
            break
    sys.stdout.flush()
    os._exit(0)  # the world may hold a lost peer: destroying it could wait for that peer


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    main()
