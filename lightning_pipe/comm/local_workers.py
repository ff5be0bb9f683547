"""Stage worker processes on this machine: started without the training script, reaped with bounded waits.

multiprocessing's ``spawn`` would import the user's ``__main__`` in every child, which runs a
training script that has no ``if __name__ == "__main__":`` guard a second time (and fails there
with multiprocessing's bootstrapping error). The workers are therefore plain interpreters that
import only lightning_pipe, with this process's ``sys.path`` (as spawn gives it); the script's own
classes and functions reach them by value (`by_value`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from typing import Any

from lightning_pipe.base.errors import TransportError
from lightning_pipe.comm.base import deadline, remaining
from lightning_pipe.comm.slot import TOKEN_ENV, WORKER_ENV

#: set in the environment of every worker process started here: ``local-<coordinator pid>-<tag>``, so that
#: ``/proc/<pid>/environ`` (or ``ps e``) tells whose worker a process is, and a test finds exactly its own
SPAWNED_ENV = "LIGHTNING_PIPE_SPAWNED_BY"

# the worker's first lines: this process's import path, then the slot (arguments as JSON, the token in the environment)
_BOOT = (
    "import json, sys; arguments = json.loads(sys.argv[1]); sys.path[:] = arguments['path']; "
    "from lightning_pipe.comm.slot import run_spawned_slot; run_spawned_slot(arguments['slot'])"
)


def spawn_workers(
    coordinator: str, token: str, devices: list[str], threads: int, timeout: float
) -> list[subprocess.Popen[bytes]]:
    """Start one worker process per device on this machine (new interpreters, so CUDA is safe to use)."""
    group = f"local-{os.getpid()}-{secrets.token_hex(2)}"
    # `import lightning_pipe` in the worker skips Lightning; the token stays out of the command line (ps shows it)
    env = os.environ | {WORKER_ENV: "1", TOKEN_ENV: token, SPAWNED_ENV: group}
    processes = []
    try:
        for index, device in enumerate(devices):
            slot = dict(
                coordinator=coordinator, device=device, group=group, index=index,
                threads=threads, wait=timeout, interface="lo", local=True,
            )  # fmt: skip
            arguments = json.dumps({"path": [str(p) for p in sys.path], "slot": slot})
            processes.append(subprocess.Popen([sys.executable, "-c", _BOOT, arguments], env=env))
    except BaseException:
        reap(processes, deadline(5.0), set())
        raise
    return processes


def check_spawned(processes: list[subprocess.Popen[bytes]]) -> None:
    """Raise if a worker process ended before it joined the coordinator."""
    for index, process in enumerate(processes):
        code = process.poll()
        if code is not None:
            raise TransportError(
                f"stage worker process {index} (pid {process.pid}) {exitcode_text(code)} "
                "before joining the coordinator; its output above says why"
            )


def exit_reason(processes: list[subprocess.Popen[bytes]], pid: int) -> str | None:
    """How the worker process ``pid`` ended, if it is one of ``processes`` and ended within half a second."""
    for process in processes:
        if process.pid == pid:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return exitcode_text(process.wait(0.5))
    return None


def exitcode_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def kill_lost(processes: list[Any], lost: set[int]) -> None:
    """Kill the worker processes whose pid is in ``lost`` (hung or stopped: they would not answer a terminate)."""
    for process in processes:
        if process.pid in lost and process.poll() is None:
            process.kill()


def reap(processes: list[Any], until: float, lost: set[int]) -> None:
    """Wait for worker processes; kill lost ones at once, terminate and then kill whatever still runs."""
    kill_lost(processes, lost)
    joining = deadline(min(5.0, remaining(until)))
    for process in processes:
        _wait(process, remaining(joining))
    for process in processes:
        if process.poll() is None:
            process.terminate()
            _wait(process, 2.0)
        if process.poll() is None:
            process.kill()
            _wait(process, 2.0)


def _wait(process: subprocess.Popen[bytes], timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(max(0.0, timeout))
