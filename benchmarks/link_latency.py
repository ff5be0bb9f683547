"""The round trip of one small message between two processes: where a pipeline action's transfer time goes.

    python benchmarks/link_latency.py --messages 2000 --rounds 5

Two processes of a gloo world on 127.0.0.1 send one ``2 x 32`` float32 tensor back and forth (a ping-pong: each
message waits for the one before, as the critical path of a 1f1b step does). Six ways, in the same processes,
alternating in each round:

- ``gloo``: torch.distributed's ``send``/``recv`` in the main thread (what torch.distributed.pipelining's schedules
  do: the thread that computes waits on the receive itself);
- ``gloo + thread``: the same receives made by a thread of each process, which hands each tensor to the main
  thread through a ``queue.SimpleQueue`` (the least a receiving thread per peer costs);
- ``lightning_pipe``: `lightning_pipe.comm.p2p.wire.Wire` with a group per direction, as launched mode and the rpc
  transport's data plane use it beyond two processes (inline frames, a receiving thread per peer delivering into
  the endpoint's inbox);
- ``lightning_pipe direct``: the same wire as a pipeline of two processes opens it (``direct=True``, launched mode
  and the rpc plane): the thread that waits for a message reads the link itself (`lightning_pipe.comm.p2p.direct`);
- ``lightning_pipe socket``: the direct wire on the two processes' own TCP connection instead of gloo's send and
  receive (`lightning_pipe.comm.p2p.socket_group`), as a pipeline of two processes of one machine opens it;
- ``tcp socket``: no library, the floor of a stream link: the tensor's bytes over one TCP connection
  (``TCP_NODELAY``) by ``sendall``, read by the waiting thread with ``recv_into`` and made a tensor again.

Reported: the median round trip in microseconds over the rounds, and the CPU microseconds of both processes per
round trip (every thread: gloo's I/O threads, the receiving threads). Writes ``benchmarks/results/link_latency.json``.
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("LIGHTNING_PIPE_WORKER", "1")  # the engine only: no process of this run imports Lightning

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.bench_procs import free_port, write_results  # noqa: E402

WAYS = ["gloo", "gloo + thread", "lightning_pipe", "lightning_pipe direct", "lightning_pipe socket", "tcp socket"]


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # the whole process: every thread
    return usage.ru_utime + usage.ru_stime


def gloo(rank: int, count: int, x: torch.Tensor) -> None:
    buffer = torch.empty_like(x)
    for _ in range(count):
        if rank == 0:
            dist.send(x, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(x, 0)


def gloo_thread(rank: int, count: int, x: torch.Tensor) -> None:
    inbox: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()

    def receive() -> None:
        for _ in range(count):
            buffer = torch.empty_like(x)
            work = dist.irecv(buffer, 1 - rank)
            assert work is not None  # None only for a rank outside the group
            work.wait()
            inbox.put(buffer)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    for _ in range(count):
        if rank == 0:
            dist.send(x, 1)
            inbox.get(timeout=60)
        else:
            inbox.get(timeout=60)
            dist.send(x, 0)
    thread.join(60)


def tcp(count: int, x: torch.Tensor, sock: socket.socket, first: bool) -> None:
    data = x.numpy().tobytes()
    buffer = bytearray(len(data))
    view = memoryview(buffer)

    def receive() -> torch.Tensor:
        got = 0
        while got < len(buffer):
            got += sock.recv_into(view[got:])
        return torch.frombuffer(buffer, dtype=x.dtype).clone().view(x.shape)

    for _ in range(count):
        if first:
            sock.sendall(data)
            receive()
        else:
            receive()
            sock.sendall(data)


def connect(rank: int) -> socket.socket:
    """A TCP connection between the two processes (rank 0 listens; the port crosses by the default group)."""
    if rank == 0:
        server = socket.create_server(("127.0.0.1", 0))
        port = [server.getsockname()[1]]
        dist.broadcast_object_list(port, src=0)
        sock, _ = server.accept()
        server.close()
    else:
        port = [0]
        dist.broadcast_object_list(port, src=0)
        sock = socket.create_connection(("127.0.0.1", port[0]), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(60)
    return sock


def wired(rank: int, count: int, x: torch.Tensor, wire: Any) -> None:
    from lightning_pipe.comm.base import Message, MessageKind
    from lightning_pipe.comm.p2p import direct

    inbox = wire.consumer_inbox(0)  # a plain inbox unless the wire is direct

    def get() -> Any:
        return inbox.get(60) if wire.direct is None else direct.receive(inbox, wire.direct.baton, wire.direct.pump, 60)

    for i in range(count):
        message = Message(MessageKind.ACTIVATION, 0, 0, i, (x,), rank)
        if rank == 0:
            wire.send(1, 0, message)
            get()
        else:
            get()
            wire.send(0, 0, message)


def run(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    from lightning_pipe.comm.p2p.socket_group import SocketGroup
    from lightning_pipe.comm.p2p.wire import Wire

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # groups of its own: a receive the wire posts ahead on the default group would take the plain ways' messages
    wire = Wire(dist.new_group([0, 1]), [0, 1], rank, str, 60.0, reverse=dist.new_group([0, 1]))
    direct = Wire(dist.new_group([0, 1]), [0, 1], rank, str, 60.0, reverse=dist.new_group([0, 1]), direct=True)
    x = torch.randn(2, 32)
    ways = {"gloo": lambda n: gloo(rank, n, x), "gloo + thread": lambda n: gloo_thread(rank, n, x)}
    ways["lightning_pipe"] = lambda n: wired(rank, n, x, wire)
    ways["lightning_pipe direct"] = lambda n: wired(rank, n, x, direct)
    sock = connect(rank)
    ways["tcp socket"] = lambda n: tcp(n, x, sock, rank == 0)
    own = SocketGroup(connect(rank), rank, 60.0)
    socket_wire = Wire(own, [0, 1], rank, str, 60.0, reverse=own, direct=True)
    ways["lightning_pipe socket"] = lambda n: wired(rank, n, x, socket_wire)
    for way in ways.values():  # warm up
        way(200)
    times: dict[str, list[float]] = {name: [] for name in ways}
    cpus: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        names = WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]
        for name in names:
            dist.barrier()
            start, used = time.perf_counter(), cpu()
            ways[name](args.messages)
            times[name].append((time.perf_counter() - start) / args.messages)
            cpus[name].append((cpu() - used) / args.messages)
    wire.close(10.0)
    direct.close(10.0)
    socket_wire.close(10.0)
    own.close()
    sock.close()
    out.put((rank, times, cpus))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="round trips per way per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "link_latency.json"))
    args = parser.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    processes = [ctx.Process(target=run, args=(rank, port, args, out)) for rank in range(2)]
    for process in processes:
        process.start()
    answers = {}
    for _ in processes:
        rank, times, cpus = out.get()
        answers[rank] = (times, cpus)
    for process in processes:
        process.join(60)
        if process.is_alive():
            process.kill()
    results: dict[str, Any] = {}
    for name in WAYS:
        trip = answers[0][0][name]  # rank 0 times whole round trips
        used = [a + b for a, b in zip(answers[0][1][name], answers[1][1][name], strict=True)]
        results[name] = {
            "round_trip_us": statistics.median(trip) * 1e6,
            "rounds_us": [round(t * 1e6, 1) for t in trip],
            "cpu_us_per_round_trip": statistics.median(used) * 1e6,
        }
    base = results["gloo"]["round_trip_us"]
    lines = ["| way | round trip us | vs gloo | CPU us per round trip (both processes) |", "| --- | --- | --- | --- |"]
    for name, r in results.items():
        trip, used = r["round_trip_us"], r["cpu_us_per_round_trip"]
        lines.append(f"| {name} | {trip:.0f} | {trip / base:.2f}x | {used:.0f} |")
    text = "\n".join(lines)
    print(text)
    return write_results(args.json, started, args, results, text)


if __name__ == "__main__":
    main()
