"""The processes a test started, found by what it gave them: a leftover check never names anyone else's.

torch (inductor's compile workers), CUDA libraries and pytest-xdist start helper processes of their
own, children of the test process like the stage workers are. So a leftover check does not list the
children of the test process: it looks for the processes whose environment says who started them.
Worker processes that lightning_pipe spawns carry ``LIGHTNING_PIPE_SPAWNED_BY=local-<pid>-<tag>``
(``pid``: the process that spawned them); processes a test starts itself get
``LIGHTNING_PIPE_TEST_OWNER=<pid of the test process>`` from `owned_env`, and their own children
inherit it. A launched run is followed by its process group instead (`group_members`).
"""

from __future__ import annotations

import os
import time

from lightning_pipe.comm.local_workers import SPAWNED_ENV

OWNER_ENV = "LIGHTNING_PIPE_TEST_OWNER"
#: processes a test process keeps for its whole life, never a test's leftover (`zygote_client.Zygote`)
EXEMPT: set[int] = set()


def owned_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` marked as this test process's: the processes started with it count in `leftover_processes`."""
    return env | {OWNER_ENV: str(os.getpid())}


def started_by(pid: int | None = None) -> list[int]:
    """Live (not zombie) processes started by ``pid`` (default: this process), directly or by lightning_pipe."""
    pid = os.getpid() if pid is None else pid
    found = []
    for entry in _pids():
        if entry == os.getpid() or entry in EXEMPT or _state(entry) in (None, "Z"):
            continue
        if marked_by(_read(f"/proc/{entry}/environ").split(b"\0"), pid):
            found.append(entry)
    return found


def marked_by(variables: list[bytes], pid: int) -> bool:
    """Whether an environment (``NAME=value`` entries) marks its process as started by ``pid``.

    The owner's value must be exactly ``pid`` (``...OWNER=123`` is not owned by 1234); lightning_pipe's
    own mark is ``local-<pid>-<tag>``, so its prefix up to the dash after the pid is exact too.
    """
    owner = f"{OWNER_ENV}={pid}".encode()
    spawned = f"{SPAWNED_ENV}=local-{pid}-".encode()
    return any(variable == owner or variable.startswith(spawned) for variable in variables)


def leftover_processes(timeout: float = 15.0) -> list[int]:
    """The processes this test process started that still run after ``timeout`` seconds (empty when all ended)."""
    until = time.monotonic() + timeout
    while True:
        left = started_by()
        if not left or time.monotonic() > until:
            return left
        time.sleep(0.05)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    return _members(2, pgid)


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    return _members(3, sid)


def _members(field: int, value: int) -> list[int]:
    """Live processes whose stat ``field`` (2: process group, 3: session) is ``value``."""
    members = []
    for entry in _pids():
        stat = _stat(entry)
        if stat is not None and stat[0] != "Z" and int(stat[field]) == value:
            members.append(entry)
    return members


def wait_group_gone(pgid: int, timeout: float) -> list[int]:
    """Members of process group ``pgid`` still alive after ``timeout`` seconds (empty when all ended)."""
    until = time.monotonic() + timeout
    while True:
        left = group_members(pgid)
        if not left or time.monotonic() > until:
            return left
        time.sleep(0.05)


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...), or None once gone."""
    text = _read(f"/proc/{pid}/stat").decode(errors="replace")
    return text.rsplit(")", 1)[1].split() if ")" in text else None


def _state(pid: int) -> str | None:
    stat = _stat(pid)
    return stat[0] if stat else None


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours to read
        return b""
