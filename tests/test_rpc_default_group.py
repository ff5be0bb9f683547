"""transport="rpc" in a process with a default process group of its own: the data plane leaves it alone.

The rpc transport's process groups are made on its own store, never through ``init_process_group``:
the user's (or Lightning's) default group is the same object after a fit, and still works.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import lightning as L
import torch
import torch.distributed as dist
from helpers import QUIET, Classifier, loader, max_param_diff, twins
from processes import leftover_processes

from lightning_pipe import PipeStrategy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_users_default_process_group_is_left_alone() -> None:
    """A script with its own default group trains over rpc; afterwards its group is the same and still works."""
    init = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        piped, plain = twins(Classifier())
        strategy = PipeStrategy(stages=2, microbatches=2, transport="rpc", timeout=60)
        trainer = L.Trainer(**QUIET, max_steps=3, strategy=strategy)
        trainer.fit(piped, loader())
        L.Trainer(**QUIET, max_steps=3).fit(plain, loader())
        assert trainer.global_step == 3 and max_param_diff(piped, plain) < 1e-5
        assert dist.is_initialized() and dist.group.WORLD is group and dist.get_world_size() == 1
        total = torch.full((3,), 2.0)
        dist.all_reduce(total)
        assert torch.equal(total, torch.full((3,), 2.0))
    finally:
        dist.destroy_process_group()
    assert leftover_processes() == []
