"""The RPC world a coordinator hosts: its control server, stage slots, rendezvous store, data plane and
worker processes; opened and closed with every wait bounded.

Opening: listen on the control port, start local worker processes (or wait for ``lightning-pipe
worker`` slots), hand out ranks with the store's port and the data plane's layout, make the data plane
(`rpc.plane`) with every slot at once, then join the RPC world (the coordinator is its rank 0).
Closing: ask each live slot to leave, close the data plane meanwhile, leave the world, end the
worker processes (lost ones are killed first, so nothing waits for them).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.rpc as rpc

from lightning_pipe.comm.base import COORDINATOR, deadline, remaining
from lightning_pipe.comm.control import ControlServer, Slot, interface_of
from lightning_pipe.comm.local_workers import check_spawned, kill_lost, reap, spawn_workers
from lightning_pipe.comm.rpc.plane import DataPlane, PlaneLayout, describe_process, open_plane, world_rank
from lightning_pipe.comm.rpc.stages import quiet_worker, request_exit
from lightning_pipe.comm.rpc.world import host_store, join_world, leave_world, quiet_closing

log = logging.getLogger("lightning_pipe")


@dataclass
class HostedWorld:
    """One RPC world as its coordinator holds it (world rank 0; rank r's slot is world rank r + 1)."""

    server: ControlServer
    host: str
    tag: str = field(default_factory=lambda: secrets.token_hex(4))
    slots: list[Slot] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)  # RPC worker names by rank (COORDINATOR: -1)
    hosts: dict[int, str] = field(default_factory=dict)  # where each rank runs, for messages
    store: Any = None
    processes: list[Any] = field(default_factory=list)  # the worker processes this coordinator started
    plane: DataPlane | None = None
    joined: bool = False  # this process's RPC agent runs in this world

    def open(self, count: int, timeout: float, spawn: tuple[list[str], int] | None, home: str | None = None) -> None:
        """Wait for ``count`` slots (first starting local workers: ``spawn`` = (devices, threads)), assign their
        ranks, make the data plane and join the RPC world. ``home``: the device of the stage the coordinator's
        process holds (`rpc.home`), which its side of the data plane uses."""
        until = deadline(timeout)
        server = self.server
        if spawn is not None:
            devices, threads = spawn
            self.processes += spawn_workers(f"127.0.0.1:{server.port}", server.token, devices, threads, timeout)
        slots = server.wait_for(count, until, lambda: check_spawned(self.processes))
        used, unused = slots[:count], slots[count:]
        self.store = host_store(self.host, timeout)
        self.slots = used
        tag = self.tag
        self.names = {COORDINATOR: f"lp{tag}-coordinator"} | {r: f"lp{tag}-{r}" for r in range(len(used))}
        self.hosts = {COORDINATOR: "the coordinator"} | {r: s.where() for r, s in enumerate(used)}
        here = (socket.gethostname(), home) if home is not None else None
        layout = PlaneLayout.of([(slot.host, slot.device) for slot in used], here)
        # a worker reaches the store where it reached us (HOST may be a wildcard such as 0.0.0.0)
        assignment = {
            "world_size": len(used) + 1, "store_port": self.store.port, "tag": tag, "timeout": timeout,
            "plane": layout.to_json(),
        }  # fmt: skip
        server.assign(used, unused, assignment)
        interface = interface_of(self.host)
        # the data plane before the RPC world: a slot serves builds once in the world, and has its plane then
        prefix = f"lp{tag}-plane"
        self.plane = open_plane(self.store, prefix, 0, layout, interface, timeout, describe_process, home)
        join_world(self.names[COORDINATOR], 0, len(used) + 1, self.store, timeout, interface, f"lp{tag}")
        self.joined = True

    def lost(self, heartbeat_timeout: float) -> list[tuple[Slot, str]]:
        """Slots whose worker is gone, with the reason: the control channel's word, else the data plane's."""
        lost = self.server.lost(heartbeat_timeout)
        broken = self.plane.lost() if self.plane is not None else None
        if lost or broken is None:
            return lost
        # a link of the data plane broke: the worker's control connection closes about as soon if it died,
        # and says more (its exit code); otherwise the link's own reason stands
        confirming = deadline(_CONFIRM)
        while remaining(confirming) > 0:
            time.sleep(0.05)
            lost = self.server.lost(heartbeat_timeout)
            if lost:
                return lost
        process, reason = broken
        slot = self.slots[process - 1] if 0 < process <= len(self.slots) else None
        return [(slot, f"its data link broke: {reason}")] if slot is not None else []

    def drop_lost(self, heartbeat_timeout: float) -> list[tuple[Slot, str]]:
        """Let nothing wait for the workers that are lost (hung, stopped, gone): kill the local ones and mark their
        data links lost (a thread reading one wakes); their slots and why."""
        slots = self.server.lost(heartbeat_timeout)
        lost = {slot.pid for slot, _ in slots}
        kill_lost(self.processes, lost)
        if self.plane is not None:
            gone = [world_rank(r) for r, slot in enumerate(self.slots) if slot.pid in lost]
            self.plane.forget(gone, "its worker is lost")
        return slots

    def close(self, timeout: float, heartbeat_timeout: float) -> None:
        """End the world and every worker process; returns within about ``timeout`` seconds."""
        until = deadline(timeout)
        lost = {slot.pid for slot, _ in self.drop_lost(heartbeat_timeout)}
        if self.joined:
            restore = quiet_closing()
            try:
                # every process holds its closing warnings back before the first one leaves
                for call in (quiet_worker, request_exit):
                    futures = []
                    for rank, slot in enumerate(self.slots):
                        if slot.pid not in lost:
                            with contextlib.suppress(Exception):
                                futures.append(rpc.rpc_async(self.names[rank], call))
                    wait_all(futures, deadline(min(5.0, remaining(until))))
                self._close_plane(until)  # the slots close theirs now, before they leave
                # let workers leave on their own (their control connections close), then stop ours
                leaving = deadline(min(5.0, remaining(until)))
                while remaining(leaving) > 0 and any(s.gone is None and s.pid not in lost for s in self.slots):
                    time.sleep(0.05)
                leave_world()
            finally:
                restore()
        self._close_plane(until)
        self.server.close()
        reap(self.processes, until, lost)

    def _close_plane(self, until: float) -> None:
        plane, self.plane = self.plane, None
        if plane is not None:
            left = plane.close(min(5.0, remaining(until)))
            if left:
                log.debug("lightning_pipe rpc: data plane threads still waiting: %s", ", ".join(left))


_CONFIRM = 1.0  # seconds the control channel gets to confirm a broken data link


def wait_all(futures: list[Any], until: float) -> None:
    """Wait for RPC futures until ``until``; their errors are the caller's to find elsewhere."""
    for future in futures:
        if wait_future(future, remaining(until)):
            with contextlib.suppress(Exception):
                future.wait()


def wait_future(future: Any, timeout: float) -> bool:
    """Whether ``future`` finished within ``timeout`` seconds."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done.wait(timeout)
