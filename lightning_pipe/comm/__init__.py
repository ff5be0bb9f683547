"""Communicators: how the coordinator and stage workers exchange messages."""

from lightning_pipe.comm.base import COORDINATOR, Communicator, Endpoint, Message, MessageKind
from lightning_pipe.comm.local import LocalCommunicator

__all__ = ["COORDINATOR", "Communicator", "Endpoint", "LocalCommunicator", "Message", "MessageKind"]
