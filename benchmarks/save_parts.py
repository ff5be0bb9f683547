"""Where a checkpoint save's time goes, on every process: ``benchmarks/checkpoint.py --parts`` times each part.

`install` (in each of the run's processes, before ``fit``) wraps the functions a launched save runs through with a
timer; every call is recorded with its thread's name (the training loop's, a stage's, DCP's write thread, the
staging thread) and written at the process's exit to ``parts-<pid>.json`` in the folder given. `table` reads them
back: per part and global rank, the seconds of the run's first save and the mean of the later ones (the first save
allocates the staging copy). What the parts mean:

- the coordinator's loop (global ranks 0 and 2 in 2 x 2, 0 in 1 x 4): ``generator states`` (the strategy asks the
  stages for them: it waits for every process of the pipeline to end the step), ``broadcast path`` and ``barrier``
  (among the coordinators), ``previous write`` (the save before, written), ``coordinator part`` (the tensors outside
  the pipeline), ``ranks' parts`` (the control call that has every process of the pipeline write its part; posted:
  the time to send it);
- every process's stage: ``part total`` (its part of a save), ``model state_dict`` and ``optimizer state_dict``
  (with FSDP the sharded ones), ``dcp.save`` (a synchronous save: plan, write and finish), ``async_save`` (staging
  and the start of the write thread), ``staging copy``, ``staged`` (an optimizer step's wait for a staging copy in
  the background);
- DCP (in the write thread when asynchronous): ``dcp plan`` (the planning collective), ``dcp write`` (this
  process's files), ``dcp write+finish`` (the write and the collective after it, which writes the metadata),
  ``publish``. A process that serves a stage (not a coordinator) serves it in its main thread.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

#: (label, module, attribute path): what `install` times
PARTS = [
    ("strategy save_checkpoint", "lightning_pipe.strategy.strategy", "PipeStrategy.save_checkpoint"),
    ("generator states", "lightning_pipe.strategy.checkpoints", "Checkpoints.saving"),
    ("launched save", "lightning_pipe.strategy.modes.launched_checkpoints", "LaunchedCheckpoints.save"),
    ("broadcast path", "lightning_pipe.strategy.modes.launched_collectives", "CoordinatorCollectives.broadcast"),
    ("barrier", "lightning_pipe.strategy.modes.launched_checkpoints", "LaunchedCheckpoints._together"),
    ("previous write", "lightning_pipe.checkpoint.background", "CheckpointWrites.wait"),
    ("coordinator part", "lightning_pipe.strategy.model_state", "ModelState.coordinator_part"),
    ("ranks' parts", "lightning_pipe.strategy.modes.launched_checkpoints", "write_sharded"),
    ("part total", "lightning_pipe.checkpoint.stage_part", "StageCheckpoint.call_save_sharded"),
    ("model state_dict", "lightning_pipe.checkpoint.stage_part", "StageCheckpoint._model"),
    ("optimizer state_dict", "lightning_pipe.checkpoint.stage_part", "StageCheckpoint._optimizer_state"),
    ("dcp.save", "lightning_pipe.checkpoint.background", "save_sharded"),
    ("async_save", "lightning_pipe.checkpoint.background", "save_sharded_in_background"),
    ("staging copy", "torch.distributed.checkpoint.staging", "DefaultStager._stage"),
    ("staged", "lightning_pipe.checkpoint.background", "CheckpointWrites.staged"),
    ("dcp plan", "torch.distributed.checkpoint.utils", "_DistWrapper.reduce_scatter"),
    ("dcp write", "torch.distributed.checkpoint.filesystem", "_FileSystemWriter.write_data"),
    ("dcp write+finish", "torch.distributed.checkpoint.utils", "_DistWrapper.all_reduce"),
    ("publish", "lightning_pipe.strategy.modes.launched_checkpoints", "publish"),
]

_records: list[tuple[str, str, float, float]] = []


def install(folder: str) -> None:
    """Time every part in `PARTS` in this process; the records go to ``folder/parts-<pid>.json`` at exit."""
    for label, module_name, path in PARTS:
        owner: Any = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for attribute in outer:
            owner = getattr(owner, attribute)
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None:
            continue  # a part this version does not have
        setattr(owner, name, _timed(label, original))
    atexit.register(_dump, Path(folder))


def _timed(label: str, function: Any) -> Any:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _records.append((label, threading.current_thread().name, start, time.perf_counter()))

    return timed


def _dump(folder: Path) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"parts-{os.getpid()}.json").write_text(json.dumps({"rank": rank, "records": _records}))


def thread_kind(name: str) -> str:
    """The loop's thread, a stage's, DCP's write thread or the staging thread."""
    if name.startswith("AsyncCheckpointExecutor"):
        return "dcp thread"
    if name.startswith("ThreadPoolExecutor"):
        return "staging thread"
    return "main" if name == "MainThread" else "stage"


def table(folder: Path) -> list[dict[str, Any]]:
    """Per (part, thread kind, global rank): how many calls, the first one's seconds, the later ones' mean."""
    rows: dict[tuple[str, str, int], list[float]] = {}
    for file in sorted(folder.glob("parts-*.json")):
        found = json.loads(file.read_text())
        for label, thread, start, end in found["records"]:
            rows.setdefault((label, thread_kind(thread), found["rank"]), []).append(end - start)
    order = {label: i for i, (label, _, _) in enumerate(PARTS)}
    out = []
    for (label, kind, rank), seconds in sorted(rows.items(), key=lambda r: (order[r[0][0]], r[0][1], r[0][2])):
        later = seconds[1:]
        out.append({"part": label, "thread": kind, "rank": rank, "calls": len(seconds), "first_s": seconds[0],
                    "later_mean_s": statistics.mean(later) if later else None})  # fmt: skip
    return out


def show(rows: list[dict[str, Any]], title: str) -> None:
    print(f"{title}: seconds per call (first save | mean of the later ones), per global rank")
    ranks = sorted({r["rank"] for r in rows})
    print(f"  {'part':<26} {'thread':<14} " + " ".join(f"{'rank ' + str(k):>15}" for k in ranks))
    keys = sorted({(r["part"], r["thread"]) for r in rows}, key=lambda k: ([p[0] for p in PARTS].index(k[0]), k[1]))
    for part, kind in keys:
        cells = []
        for rank in ranks:
            found = [r for r in rows if (r["part"], r["thread"], r["rank"]) == (part, kind, rank)]
            if not found:
                cells.append(f"{'-':>15}")
                continue
            later = found[0]["later_mean_s"]
            cells.append(f"{found[0]['first_s']:>6.3f} | {'-' if later is None else f'{later:.3f}':>6}")
        print(f"  {part:<26} {kind:<14} " + " ".join(cells))
