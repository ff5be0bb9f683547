"""Under pytest-xdist, a test marked ``timed`` never runs beside a test that launches many processes.

A ``timed`` test bounds a wait by the clock (a lost process noticed within seconds, Ctrl-C ending a run in time):
run beside another worker's 8-process launch on a 2-core machine, its bound would measure the neighbour. The tests of
the files that launch (conftest's `LAUNCHES`) each hold a shared lock on a file the workers of one run share
(``fcntl.flock``), a ``timed`` test an exclusive one: it waits for the other worker's running launch to end and
keeps the next from starting. The other tests take no lock and run beside either. A second lock, the turnstile,
taken briefly before either, keeps a waiting ``timed`` test from being passed forever by the launches' shared locks
(``flock`` itself has no order of waiters). Without xdist (one process runs every test) nothing is locked.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def lock_folder(config: pytest.Config) -> Path | None:
    """The folder the workers of this run share (their controller's basetemp), or None without xdist."""
    if not hasattr(config, "workerinput") or not config.option.basetemp:
        return None
    return Path(config.option.basetemp).parent  # a worker's basetemp is <controller's basetemp>/popen-gwN


@contextmanager
def machine_share(item: pytest.Item, launches: bool) -> Iterator[None]:
    """Around one test's setup, call and teardown: no launch beside a ``timed`` test; ``launches``: the test's file
    launches many processes."""
    folder = lock_folder(item.config)
    exclusive = item.get_closest_marker("timed") is not None
    if folder is None or not (exclusive or launches):
        yield
        return
    with open(folder / "machine.lock", "a") as machine, open(folder / "turnstile.lock", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
