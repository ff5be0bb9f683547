"""``transport="rpc"``: stage workers in the processes of a private torch.distributed.rpc world.

`communicator` (the coordinator's side), `hosted` and `world` (the world it holds), `plane` (the
gloo/NCCL groups tensors cross), `endpoint` (a participant's inbox and sends), `build` (remote builds
and the ready ping), `stages` (what a worker process serves), `home` (the rank the coordinator's
process holds itself). `RpcCommunicator` is imported on first use: a worker process imports only the
modules it serves with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_pipe.comm.rpc.communicator import RpcCommunicator

__all__ = ["RpcCommunicator"]


def __getattr__(name: str) -> Any:
    if name == "RpcCommunicator":
        from lightning_pipe.comm.rpc import communicator

        return communicator.RpcCommunicator
    raise AttributeError(f"module 'lightning_pipe.comm.rpc' has no attribute {name!r}")
