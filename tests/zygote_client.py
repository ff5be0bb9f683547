"""This test process's `Zygote`: `forked_ranks.py` runs forked from one process that imported everything once.

`launching.run_all` asks `ZYGOTE` first for every command; it takes the ``python tests/forked_ranks.py ...``
(and ``forked_processes.py``) commands and leaves every other command to a process of its own. A run whose
environment differs from the one the zygote started with (`PER_RUN` aside) gets a new zygote started with it: a
variable that torch or Lightning read when imported would not take effect in a fork. What a test gets back behaves
as the ``subprocess.Popen`` it replaces does for `launching.run_all` and `launching.kill`: a process id that leads a
session of its own, ``communicate`` with a timeout, the exit code (negative: the signal that ended it).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import processes

HERE = Path(__file__).resolve().parent
FORKED_RANKS = str(HERE / "forked_ranks.py")
RUNNERS = {FORKED_RANKS, str(HERE / "forked_processes.py")}  # the scripts the zygote runs (tests/zygote.py)
#: variables read when a run connects, or by no one: never at import, so a fork may take another value
PER_RUN = {"MASTER_PORT", "WORLD_SIZE", "PYTEST_CURRENT_TEST"}


class ForkedRun:
    """A `forked_ranks.py` run forked by the zygote: its output and exit code come through files."""

    def __init__(self, pid: int, output: Path) -> None:
        self.pid = pid
        self.output = output
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with_code = Path(f"{self.output}.rc")
            if with_code.exists():
                self.returncode = int(with_code.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        until = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if until is not None and time.monotonic() > until:
                raise subprocess.TimeoutExpired(FORKED_RANKS, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for the run to end (``timeout``: raise ``subprocess.TimeoutExpired``), then its output. Without a
        timeout (after `launching.kill`) the wait is bounded all the same: a run whose end the zygote did not report
        within 60 s counts as killed."""
        try:
            self.wait(timeout if timeout is not None else 60.0)
        except subprocess.TimeoutExpired:
            if timeout is not None:
                raise
            self.returncode = -9
        return self.output.read_text(errors="replace"), None


class Zygote:
    """Started at the first forked run of this test process, ended with it (or when this process ends)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self.folder = ""
        self.folders: list[str] = []  # the runs' outputs, removed when this process ends
        atexit.register(self.shutdown)

    def start(self, command: list[str], env: dict[str, str]) -> ForkedRun | None:
        """The run of ``command`` forked from the zygote (started, or started again, with ``env``), or None where it
        is not a command of `RUNNERS`."""
        if len(command) < 2 or command[1] not in RUNNERS or os.environ.get("LIGHTNING_PIPE_TEST_NO_ZYGOTE"):
            return None
        fixed = {k: v for k, v in env.items() if k not in PER_RUN}
        if self.process is not None and (self.process.poll() is not None or fixed != self.env):
            self.close()  # ended, or another environment (a test's setting): a zygote of that environment
        if self.process is None:
            self.launch(command[0], fixed)
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        handle, output = tempfile.mkstemp(prefix="forked-", suffix=".log", dir=self.folder)
        os.close(handle)
        request = {"runner": Path(command[1]).name, "argv": command[2:], "env": env, "output": output}
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError("the zygote process (tests/zygote.py) ended; its output went to this test's stderr")
        return ForkedRun(json.loads(reply)["pid"], Path(output))

    def launch(self, python: str, env: dict[str, str]) -> None:
        self.env = env
        self.folder = tempfile.mkdtemp(prefix="zygote-")
        self.folders.append(self.folder)
        self.process = subprocess.Popen(
            [python, str(HERE / "zygote.py")], env=env, cwd=HERE.parent, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        processes.EXEMPT.add(self.process.pid)  # never a test's leftover: it lives as long as this test process

    def close(self) -> None:
        """End the zygote (the end of its input ends it; killed if it does not within 10 s)."""
        process, self.process = self.process, None
        if process is None:
            return
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        processes.EXEMPT.discard(process.pid)

    def shutdown(self) -> None:
        """At this process's end: the zygote, then the runs' outputs."""
        self.close()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


ZYGOTE = Zygote()
