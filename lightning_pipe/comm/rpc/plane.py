"""The data plane of an RPC world: a pipeline's messages between its processes, point to point.

Steps, calls, replies, activations and gradients go over private process groups in launched mode's p2p wire format,
made on the RPC world's own store apart from torch.distributed's default group (Lightning's): gloo over every
process of the world, NCCL between slots on CUDA devices that no other slot of their machine uses
(`PlaneLayout.describe` says who goes how). An endpoint's inbox is attached under an *address* of its launch
and rank, so a message of a pipeline that stopped never reaches the next one's stage (docs/internals.md).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_pipe.comm.base import Message, QueueInbox, deadline, remaining
from lightning_pipe.comm.p2p.direct import DirectLink
from lightning_pipe.comm.p2p.send import WireStats
from lightning_pipe.comm.p2p.socket_group import SocketGroup, pair_on_loopback
from lightning_pipe.comm.p2p.wire import Wire

#: how soon a plane's receiving thread notices that its stage left the link (`p2p.direct.Baton`): sooner than
#: launched mode's, because a message to a stage waiting on the link from its own process (the coordinator's) pokes
#: the peer, whose answer waits until its link is read (a look every 50 ms made the rpc tests about 8% slower)
RPC_LOOK = 0.005


def address(launch: str, rank: int) -> int:
    """Where the messages for ``rank`` (``COORDINATOR``: -1) of the pipeline ``launch`` arrive on the plane."""
    return (zlib.crc32(launch.encode()) << 20) + rank + 2  # positive: apart from the wire's own inbox (-2)


def world_rank(slot: int) -> int:
    """The world rank of the worker process in slot ``slot``: the coordinator is 0, slot k k + 1 (which pipeline
    rank a slot serves is each launch's: `rpc.home.RankProcesses`)."""
    return slot + 1


def describe_process(process: int) -> str:
    """World rank ``process`` in words (the coordinator names a worker better: its rank, host and pid)."""
    return "the coordinator" if process == 0 else f"the worker process of slot {process - 1}"


@dataclass(frozen=True)
class PlaneLayout:
    """Which processes of a world join which group (sent to every slot with its rank)."""

    size: int  # processes: the coordinator and the slots
    nccl: tuple[int, ...] = ()  # world ranks on CUDA devices of their own, ascending
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (device on its machine, world ranks) sharing a GPU

    @staticmethod
    def of(slots: Sequence[tuple[str, str]], coordinator: tuple[str, str] | None = None) -> PlaneLayout:
        """The layout for stage slots given as (machine, device), in rank order; ``coordinator``: the (machine,
        device) of the stage the coordinator's process holds itself (`rpc.home`), None if it holds none."""
        devices = [(host, _normalized(device)) for host, device in [coordinator or ("", "cpu"), *slots]]
        users = Counter(devices)
        cuda = [w for w, (_, device) in enumerate(devices) if is_cuda(device)]
        alone = tuple(w for w in cuda if users[devices[w]] == 1)
        shared: dict[tuple[str, str], list[int]] = {}
        for w in cuda:
            if users[devices[w]] > 1:
                shared.setdefault(devices[w], []).append(w)
        return PlaneLayout(
            len(slots) + 1,
            alone if len(alone) > 1 else (),
            tuple((f"{device} of {host}", tuple(ws)) for (host, device), ws in shared.items()),
        )

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "nccl": list(self.nccl), "shared": [[d, list(ws)] for d, ws in self.shared]}

    @staticmethod
    def from_json(data: dict[str, Any]) -> PlaneLayout:
        shared = tuple((str(d), tuple(int(w) for w in ws)) for d, ws in data.get("shared", []))
        return PlaneLayout(int(data["size"]), tuple(int(w) for w in data.get("nccl", [])), shared)

    def describe(self, home: int | None = None, served: Mapping[int, int] | None = None) -> str:
        """How tensors travel between the processes, for the log; ``home``: the pipeline rank the coordinator's
        process serves (its world rank 0), else that process is named as the coordinator; ``served``: the pipeline
        rank of each slot's world rank (default: slot k serves rank k)."""

        def ranks(ws: Sequence[int]) -> str:
            slots = [(served or {}).get(w, w - 1) for w in ws if w]
            named = sorted(slots + ([home] if 0 in ws and home is not None else []))
            text = ", ".join(str(r) for r in named)
            return text + (" and the coordinator" if 0 in ws and home is None else "")

        text = "activations and gradients go point to point over gloo"
        if self.nccl:
            text += f"; between ranks {ranks(self.nccl)} (CUDA devices of their own) over NCCL, GPU to GPU"
        for device, ws in self.shared:
            text += (
                f"; ranks {ranks(ws)} share {device}, which NCCL cannot serve to two processes: "
                "theirs go over gloo, through host memory"
            )
        return text


class DataPlane:
    """This process's side of the data plane: its wires, and which wire reaches which process."""

    def __init__(
        self,
        me: int,
        layout: PlaneLayout,
        routes: dict[int, tuple[Wire, int]],
        wires: list[Wire],
        sockets: Sequence[SocketGroup] = (),
    ) -> None:
        self.me = me
        self.layout = layout
        self._routes = routes  # world rank -> (the wire that reaches it, its index on that wire)
        self._wires = wires
        #: the connections a wire runs on instead of gloo's (`p2p.socket_group`), closed after the wires
        self.sockets = list(sockets)

    def send(self, process: int, destination: int, messages: list[Message], control: bool = False) -> None:
        """Deliver ``messages`` (in order) to ``destination`` in world rank ``process``; ``control``: over the gloo
        link, which reaches every process (tensor messages may take NCCL's)."""
        wire, peer = (self._wires[0], process) if control else self._routes[process]
        if len(messages) == 1:
            wire.send(peer, destination, messages[0])
        else:
            wire.send_many(peer, destination, messages)

    def through_host(self, process: int) -> bool:
        """Whether tensors to ``process`` cross through host memory (gloo), not device to device."""
        return process != self.me and self._routes[process][0].device.type == "cpu"

    def stats(self, reset: bool = False) -> dict[int, WireStats]:
        """What each endpoint of this process (by rank; ``COORDINATOR``: -1) sent over the plane: messages
        (a bundle counts once), tensor bytes, and the frames' headers and pickled bytes."""
        out: dict[int, WireStats] = {}
        for wire in self._wires:
            for source, stats in wire.stats(reset).items():
                total = out.setdefault(source, WireStats())
                for name in ("messages", "tensor_bytes", "pickled_bytes", "header_bytes", "local"):
                    getattr(total, name).update(getattr(stats, name))
                total.signatures += stats.signatures
        return out

    @property
    def direct(self) -> DirectLink | None:
        """The plane's one link, where a stage reads it itself (`p2p.direct`); None where the plane has a receiving
        thread per peer."""
        return self._wires[0].direct if len(self._wires) == 1 else None

    def attach(self, destination: int, inbox: QueueInbox) -> None:
        for wire in self._wires:
            wire.attach(destination, inbox)

    def detach(self, destination: int) -> None:
        for wire in self._wires:
            wire.drop_inbox(destination)

    def lost(self) -> tuple[int, str] | None:
        """The first process whose link broke (world rank) and why, if any."""
        for wire in self._wires:
            if wire.lost is not None:
                peer, reason = wire.lost
                return wire.ranks[peer], reason
        return None

    def forget(self, processes: Sequence[int], reason: str) -> None:
        """Send nothing more to ``processes`` (lost) and do not wait for them when closing."""
        for process in processes:
            if process in self._routes:
                wire, peer = self._routes[process]
                wire.mark_lost(peer, reason)

    def close(self, timeout: float) -> list[str]:
        """Close every link (bounded by ``timeout``); the names of receiving threads still running."""
        until = deadline(timeout)
        left: list[str] = []
        for wire in self._wires:
            left += wire.close(remaining(until))
        for connection in self.sockets:
            connection.close()
        return left


def open_plane(
    store: dist.Store,
    prefix: str,
    me: int,
    layout: PlaneLayout,
    interface: str | None,
    timeout: float,
    describe: Callable[[int], str],
    device: str | None = None,
) -> DataPlane:
    """Make this process's groups and wires (every process of the world calls it at once: it rendezvouses).

    ``device``: this process's CUDA device for NCCL (default: its current one; the coordinator's process names
    the device of the stage it holds, without making it the current device of the user's process).
    """
    everyone = list(range(layout.size))
    # a world of two processes on the CPU: each hears from one peer, and its stage reads that link itself (`p2p.direct`)
    direct = layout.size == 2 and not layout.nccl
    # two processes of one machine: one TCP connection on 127.0.0.1, not gloo's send and receive (`p2p.socket_group`)
    sock = pair_on_loopback(store, prefix, me, timeout) if direct else None
    sockets = [SocketGroup(sock, me, timeout)] if sock is not None else []
    if sockets:
        gloo = reverse = sockets[0]  # one connection carries both directions
    else:
        gloo = _gloo_group(dist.PrefixStore(f"{prefix}-gloo", store), me, layout.size, interface, timeout)
        # a group per direction: a link's sends and receives never share a gloo pair (`p2p.wire`)
        reverse = _gloo_group(dist.PrefixStore(f"{prefix}-gloo-up", store), me, layout.size, interface, timeout)
    wire = Wire(
        gloo, everyone, me, describe, timeout, group_ranks=everyone, backend="gloo", reverse=reverse, direct=direct,
        look=RPC_LOOK,
    )  # fmt: skip
    routes = {w: (wire, w) for w in everyone}  # to itself: into its own inbox, by reference
    wires = [wire]
    if me in layout.nccl:
        members = list(layout.nccl)
        index = members.index(me)
        for direction in ("up", "down"):
            group = _nccl_group(dist.PrefixStore(f"{prefix}-nccl-{direction}", store), index, len(members), timeout)
            targets = range(index + 1, len(members)) if direction == "up" else range(index)
            sources = range(index) if direction == "up" else range(index + 1, len(members))
            directed = Wire(
                group, members, index, describe, timeout, group_ranks=range(len(members)), backend="nccl",
                sends_to=list(targets), hears_from=list(sources), device=_normalized(device) if device else None,
            )  # fmt: skip
            wires.append(directed)
            routes.update({members[k]: (directed, k) for k in targets})
    return DataPlane(me, layout, routes, wires, sockets)


def _gloo_group(store: dist.Store, rank: int, size: int, interface: str | None, timeout: float) -> Any:
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    device = dist.ProcessGroupGloo.create_device(interface=interface) if interface else None
    options._devices = [device if device is not None else dist.ProcessGroupGloo.create_default_device()]
    options._timeout = timedelta(seconds=timeout)
    return dist.ProcessGroupGloo(store, rank, size, options)


def _nccl_group(store: dist.Store, rank: int, size: int, timeout: float) -> Any:
    """An NCCL group on this process's current CUDA device (torch builds with CUDA only)."""
    from torch.distributed import ProcessGroupNCCL  # type: ignore[attr-defined]

    options = ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout)
    return ProcessGroupNCCL(store, rank, size, options)


def is_cuda(device: str) -> bool:
    """Whether a slot's device (any runtime's name: ``"cuda:1"``, ``"cpu"``, a custom one) is a CUDA GPU."""
    return device.split(":")[0] == "cuda"


def _normalized(device: str) -> str:
    """``"cuda"`` names the first GPU of its machine, as a slot offers it."""
    return "cuda:0" if device == "cuda" else device
