"""A stage worker process imports what serving a stage needs: not Lightning, and not ``torch.distributed.tensor``
until a DTensor reaches it (about a third of a second of CPU at each worker's start: `weights.dtensor_shards`)."""

from __future__ import annotations

import json
import subprocess
import sys

from launching import base_env

# a worker's entry, then what a link does with each tensor it sends, and the stash's and the optimizer's checks
WORKER = """
import json, sys
import torch
from lightning_pipe.comm.slot import run_spawned_slot
from lightning_pipe.comm.p2p.dtensor_frames import local_part
from lightning_pipe.base.dtensor_shards import is_sharded, local_of
tensor = torch.ones(2)
assert local_part(tensor) == (tensor, None) and local_of(tensor) is tensor and not is_sharded(tensor)
print(json.dumps(sorted(m for m in ("lightning", "torch.distributed.tensor") if m in sys.modules)))
"""


def test_a_stage_worker_imports_neither_lightning_nor_dtensors() -> None:
    env = base_env() | {"LIGHTNING_PIPE_WORKER": "1"}
    run = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.splitlines()[-1]) == []
