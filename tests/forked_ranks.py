"""Run a training script's ranks as torchrun or SLURM starts them, each rank forked from this process.

``python tests/forked_ranks.py --nproc N [--nodes M] [--cluster slurm] script.py ARGS...`` sets in each of its
N x M processes the variables torchrun (torchelastic) gives a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``TORCHELASTIC_RUN_ID``, ...), or with ``--cluster slurm`` those ``srun`` gives a task (``SLURM_PROCID``, ...), so
Lightning finds that cluster environment and starts no process itself, and runs ``script.py`` as ``__main__`` with
``ARGS``. The ranks are forked (``torch.multiprocessing.start_processes``) after torch, Lightning
and lightning_pipe were imported here once: a process that imports them cold spends about 5 s of CPU doing it,
most of a small launched test. Only tests whose subject is not the launcher use it (`launching.forked_ranks`);
Lightning's launcher, torchrun and SLURM keep launches of their own. The M "nodes" are simulated on this machine
(``GROUP_RANK``), as `launching.slurm` simulates SLURM's. A rank that fails ends the others
(``start_processes`` terminates them, as torchrun's agent does) and this process exits with 1; with
``--on-failure wait`` it ends none: each rank must end by itself (what a test of a lost rank checks), within
``--timeout`` seconds, after which this process ends the rest and exits with 1.
"""

from __future__ import annotations

import argparse
import os
import pickle
import runpy
import sys
import time

import lightning.pytorch  # noqa: F401  (imported once, before the ranks are forked)
import torch.multiprocessing as mp
from launching import CLUSTERS

import lightning_pipe  # noqa: F401


def run_rank(index: int, script: str, args: list[str], nproc: int, nodes: int, cluster: str) -> None:
    """Process ``index`` of ``nproc x nodes``: the cluster's variables, then the script as ``__main__``."""
    os.environ.update(CLUSTERS[cluster](index, nproc, nodes))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` puts its folder first
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes per node")
    parser.add_argument("--nodes", type=int, default=1, help="nodes simulated on this machine")
    parser.add_argument("--cluster", choices=sorted(CLUSTERS), default="torchelastic", help="whose variables")
    parser.add_argument(
        "--on-failure",
        choices=["stop", "wait"],
        default="stop",
        help="a failing rank ends the others (stop), or each rank ends by itself (wait)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="with --on-failure wait: seconds at most")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        sys.exit("forked_ranks.py: set MASTER_ADDR and MASTER_PORT (launching.forked_ranks does)")
    ranks = mp.start_processes(
        run_rank, args=(options.script, options.args, options.nproc, options.nodes, options.cluster),
        nprocs=options.nproc * options.nodes, start_method="fork", join=options.on_failure == "stop",
    )  # fmt: skip
    if ranks is not None:  # --on-failure wait
        sys.exit(wait_for_each(ranks.processes, ranks.error_files, options.timeout))


def wait_for_each(processes: list, error_files: list[str], timeout: float) -> int:
    """Wait for every rank to end by itself (none is ended because another failed), ``timeout`` seconds at most,
    then end the rest; print each failed rank's traceback (``start_processes`` writes it to its error file); 0 if
    every rank exited with 0, else 1."""
    until = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, until - time.monotonic()))
    left = [process for process in processes if process.is_alive()]
    for process in left:
        process.kill()
        process.join(10)
    if left:
        print(f"forked_ranks.py: {len(left)} rank(s) still running after {timeout:.0f} s, killed", file=sys.stderr)
    for index, (process, error_file) in enumerate(zip(processes, error_files, strict=True)):
        if os.path.exists(error_file):
            with open(error_file, "rb") as file:
                print(f"forked_ranks.py: rank {index} failed:\n{pickle.load(file)}", file=sys.stderr)
            os.unlink(error_file)
        elif process.exitcode != 0:
            print(f"forked_ranks.py: rank {index} ended with exit code {process.exitcode}", file=sys.stderr)
    return 0 if not left and all(process.exitcode == 0 for process in processes) else 1


if __name__ == "__main__":
    main()
