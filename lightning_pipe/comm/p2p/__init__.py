"""Launched mode's communicator: stages in the processes of a torch.distributed group, messages point to point.

`communicator` (the coordinator's side), `serve` (the serving processes' side), `wire` (a process's links
and inboxes), `send` and `receive` (its two halves), `frames` (the frame format both halves import).
"""

from lightning_pipe.comm.p2p.communicator import P2PCommunicator
from lightning_pipe.comm.p2p.serve import serve_stages

__all__ = ["P2PCommunicator", "serve_stages"]
