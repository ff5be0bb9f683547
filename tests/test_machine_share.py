"""tests/machine_share.py: under xdist a ``timed`` test waits for a running launch and holds back the next one.

Two "workers" are threads here, each opening the lock files itself (``flock`` locks belong to an open file, so
two opens exclude each other as two processes' do)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from machine_share import lock_folder, machine_share


def item(folder: Path, timed: bool, worker: str = "gw0") -> Any:
    """What `machine_share` reads of a pytest item under xdist: its config (worker, basetemp) and its marker."""
    config = SimpleNamespace(workerinput={"workerid": worker}, option=SimpleNamespace(basetemp=str(folder / worker)))
    marker = object() if timed else None
    return SimpleNamespace(config=config, get_closest_marker=lambda name: marker if name == "timed" else None)


def test_a_timed_test_waits_for_the_running_launch_and_holds_back_the_next(tmp_path: Path) -> None:
    events: list[str] = []
    running = threading.Event()
    release = threading.Event()

    def launch(name: str, hold: threading.Event | None) -> None:
        with machine_share(item(tmp_path, timed=False, worker="gw1"), launches=True):
            events.append(f"{name} start")
            running.set()
            if hold is not None:
                assert hold.wait(10)
            events.append(f"{name} end")

    def timed() -> None:
        with machine_share(item(tmp_path, timed=True), launches=False):
            events.append("timed start")
            time.sleep(0.2)
            events.append("timed end")

    first = threading.Thread(target=launch, args=("first", release))
    first.start()
    assert running.wait(10)
    waiting = threading.Thread(target=timed)
    waiting.start()
    time.sleep(0.3)  # the timed test now waits for the first to end, holding the turnstile
    second = threading.Thread(target=launch, args=("second", None))
    second.start()
    time.sleep(0.3)
    assert events == ["first start"], events  # neither the timed test nor the next launch started
    with machine_share(item(tmp_path, timed=False, worker="gw2"), launches=False):
        events.append("ordinary")  # a test that launches nothing waits for neither
    assert events == ["first start", "ordinary"], events
    release.set()
    for thread in (first, waiting, second):
        thread.join(10)
        assert not thread.is_alive()
    expected = ["first start", "ordinary", "first end", "timed start", "timed end", "second start", "second end"]
    assert events == expected, events


def test_launches_run_side_by_side_and_nothing_is_locked_without_xdist(tmp_path: Path) -> None:
    inside = threading.Barrier(2, timeout=10)  # both inside at once, or the barrier breaks

    def launch(worker: str) -> None:
        with machine_share(item(tmp_path, timed=False, worker=worker), launches=True):
            inside.wait()

    threads = [threading.Thread(target=launch, args=(w,)) for w in ("gw0", "gw1")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert not inside.broken
    # without xdist (no workerinput: one process runs every test) no lock file is opened
    plain = SimpleNamespace(option=SimpleNamespace(basetemp=str(tmp_path / "plain")))
    assert lock_folder(plain) is None  # type: ignore[arg-type]
