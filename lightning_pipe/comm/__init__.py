"""Communicators: how the coordinator and stage workers exchange messages."""

from lightning_pipe.comm.base import COORDINATOR, Communicator, Endpoint, Message, MessageKind
from lightning_pipe.comm.local import LocalCommunicator
from lightning_pipe.comm.p2p import P2PCommunicator, serve_stages

__all__ = [
    "COORDINATOR",
    "Communicator",
    "Endpoint",
    "LocalCommunicator",
    "Message",
    "MessageKind",
    "P2PCommunicator",
    "serve_stages",
]
