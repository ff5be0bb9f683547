"""Launched mode ends cleanly: many short runs back to back exit without an abort, and Ctrl-C to a launched
run (after an earlier fit) ends every one of its processes within seconds.

A launched process was seen to die now and then with SIGABRT ("terminate called without an active
exception") after writing its results. One way to get exactly that: a thread blocked in a gloo wait
when the interpreter exits is unwound by force once the wait returns. Runs here must end with code 0,
join the pipeline's threads before ``fit`` returns (`launched_exits` writes the ones still alive),
destroy the process groups at exit and print no crash.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from ctrl_c import sigint_raises
from launching import ROOT, Run, base_env, free_port, kill, slurm, start_session
from processes import group_members, wait_group_gone

SCRIPT = str(ROOT / "tests" / "launched_exits.py")
STOPPED_WITHIN = 10.0  # seconds from Ctrl-C to the end of the run's shutdown ("a few", on a loaded 2-core machine)
CRASHES = ("terminate called", "Fatal Python error", "Aborted", "core dumped")
pytestmark = [pytest.mark.slow, pytest.mark.timed]  # bounds waits by the clock: alone under xdist


SHORT_RUNS = 6  # launched runs one after another in `test_short_launched_runs_in_a_row_end_without_an_abort`


def crash_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if any(crash in line for crash in CRASHES)]


def threads_left(out: Path, processes: int) -> dict[int, list[str]]:
    """Per rank, the lightning_pipe threads still running after its last fit (`launched_exits` writes them)."""
    return {rank: (out / f"done-rank{rank}").read_text().split() for rank in range(processes)}


def exits(out: Path, processes: int) -> list[tuple[str, float]]:
    """Per rank, whether its process groups were destroyed at exit, and when (`launched_exits.note_exit`)."""
    notes = [(out / f"exit-rank{rank}").read_text().splitlines() for rank in range(processes)]
    return [(state, float(when)) for state, when in notes]


def test_short_launched_runs_in_a_row_end_without_an_abort(tmp_path: Path) -> None:
    """2 processes (both started at once, under SLURM's variables), a 2-stage pipeline, 2 steps: `SHORT_RUNS` times
    (20 took 33 s of the suite alone on the machine, 10 about 16 s; `benchmarks/restarts.py` runs 20 restarts).

    Each run is a child forked from one process per rank that imported torch and Lightning once
    (`launched_exits.fork_runs`): the run and the interpreter's shutdown after it are a launched process's,
    without 40 interpreter starts.
    """
    ports = ",".join(str(free_port()) for _ in range(SHORT_RUNS))
    run: Run = slurm(SCRIPT, ["--out", str(tmp_path), "--ports", ports], nodes=1, tasks_per_node=2, timeout=300)
    assert run.ok and not crash_lines(run.output), f"{run.returncodes}:\n{run.output[-4000:]}"
    for rank in range(2):
        assert (tmp_path / f"children-rank{rank}").read_text().split() == ["0"] * SHORT_RUNS, run.output[-4000:]
    for attempt in range(SHORT_RUNS):
        out = tmp_path / str(attempt)
        where = f"run {attempt + 1} of {SHORT_RUNS}:\n{run.output[-4000:]}"
        assert threads_left(out, 2) == {0: [], 1: []}, where
        assert [state for state, _ in exits(out, 2)] == ["destroyed"] * 2, where


def test_ctrl_c_after_an_earlier_fit_ends_every_process_of_a_launched_run(tmp_path: Path) -> None:
    """``python launched_exits.py`` (devices=2, Lightning's launcher): a fit, then Ctrl-C to the run's process
    group in the middle of the second fit's first step (stage 0 waits for it)."""
    env = base_env() | {"MASTER_PORT": str(free_port())}
    with sigint_raises():  # a process started now takes Ctrl-C as in a terminal, however the tests were started
        process = start_session([sys.executable, SCRIPT, "--out", str(tmp_path), "--fits", "2", "--ctrl-c"], env)
    try:
        until = time.monotonic() + 180
        while not list(tmp_path.glob("waiting-rank*")) and process.poll() is None and time.monotonic() < until:
            time.sleep(0.05)
        assert list(tmp_path.glob("waiting-rank*")), f"the second fit never started:\n{process.communicate()[0]}"
        assert len(group_members(process.pid)) >= 2  # the script and the process Lightning's launcher started
        pressed = time.time()
        os.killpg(process.pid, signal.SIGINT)
        left = wait_group_gone(process.pid, 30)
        output = process.communicate(timeout=30)[0]
    finally:
        kill(process)
    assert left == [], f"processes of the run still alive 30 s after Ctrl-C: {left}\n{output[-4000:]}"
    # the run's own shutdown: until each process reached its exit (the interpreter's teardown follows)
    [(state, when)] = exits(tmp_path, 1)  # rank 0's (Lightning's launcher SIGKILLs rank 1 as it shuts down)
    assert when - pressed < STOPPED_WITHIN, f"the run stopped {when - pressed:.1f} s after Ctrl-C:\n{output[-4000:]}"
    assert state == "destroyed", output[-4000:]
    assert sorted(p.name for p in tmp_path.glob("fit0-rank*")) == ["fit0-rank0", "fit0-rank1"]  # the earlier fit
    assert not list(tmp_path.glob("fit1-rank*")) and not list(tmp_path.glob("done-rank*"))
    assert "Detected KeyboardInterrupt" in output, output[-4000:]
    assert not crash_lines(output), output[-4000:]
