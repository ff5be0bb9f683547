"""Several runs of ``examples/big_model.py`` in one launch: ``python tests/big_model_runs.py RUNS.json``.

``RUNS.json`` is a list of command lines, ``[script, *arguments]`` with script ``big_model.py``,
``fsdp_build.py`` or ``hf_weights_train.py`` (tests/), run one after the other in the same processes:
Lightning's launcher starts them at the first ``fit`` and the later runs reuse them, as a user's script with
several fits does. Each run's report is its script's own (big_model.py: its losses, its peak resident memory).

Memory per run: before each run every process hands its freed memory back to the system (``gc``, glibc's
``malloc_trim``) and resets its peak resident memory to what it holds now (``/proc/self/clear_refs``), so a
run's peak is its own, plus whatever earlier runs still hold (never less than a fresh process would show).
Each process also writes ``<RUNS.json's folder>/empty-rank<g>.json``: its memory before any run, with
torch, Lightning and lightning_pipe imported (what ``big_model.py --empty`` measures in a process of its own).
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import big_model  # noqa: E402 - the example: torch, Lightning and lightning_pipe imported


def fresh_peak() -> None:
    """Free what no one holds, give it back to the system, and start this process's peak memory from here."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size (VmHWM) to the current


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def main() -> None:
    faulthandler.enable()
    runs_file = Path(sys.argv[1])
    (runs_file.parent / f"empty-rank{rank()}.json").write_text(json.dumps({"peak_mib": big_model.peak_mib()}))
    for script, *argv in json.loads(runs_file.read_text()):
        fresh_peak()
        if script == "hf_weights_train.py":
            import hf_weights_train  # transformers: imported only by the processes that run it, after the others

            hf_weights_train.main(argv)
        elif script == "fsdp_build.py":
            import fsdp_build

            fsdp_build.main(argv)
        else:
            assert script == "big_model.py", script
            big_model.main(argv)


if __name__ == "__main__":
    main()
