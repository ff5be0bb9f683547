"""Processes of a helper script forked after one import: ``python tests/forked_processes.py SPEC.json``.

SPEC: ``{"script": path, "timeout": seconds, "processes": [[log, arg, ...], ...], "all_succeed": bool}``. Each
process runs ``script``
as ``__main__`` with its arguments and its output (stdout and stderr) into its ``log`` file, as
``python script arg ... > log 2>&1`` does, but forked from this process after torch and lightning_pipe were
imported here once (a process that imports them cold spends seconds of CPU doing it; `launching.forked_ranks`
does the same for a training script's ranks). A process that fails or is killed ends no other (a scenario that
kills one checks that the others notice); what still runs ``timeout`` seconds after the start is SIGKILLed. This
process exits with 0 once every one of them has ended by itself, with 1 if one had to be killed or, where
``all_succeed`` is set, ended with another code than 0 (it prints which); else the processes report through
their own files.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch  # noqa: F401  (imported once, before the processes are forked)

import lightning_pipe  # noqa: F401


def run_child(script: str, args: list[str], log: str) -> None:
    """In a forked child: its output into ``log``, ``script`` as ``__main__``, then exit with the script's code."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    code = 1
    try:
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` puts its folder first
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    with open(sys.argv[1]) as file:
        spec = json.load(file)
    children = []
    for log, *args in spec["processes"]:
        pid = os.fork()
        if pid == 0:
            run_child(spec["script"], args, log)
        children.append(pid)
    until = time.monotonic() + spec["timeout"]
    left, codes = set(children), {}
    while left and time.monotonic() < until:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            left.discard(pid)
            codes[pid] = os.waitstatus_to_exitcode(status)
        else:
            time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if left:
        print(f"forked_processes.py: {len(left)} process(es) still running after {spec['timeout']} s, killed")
    logs = [log for log, *_ in spec["processes"]]
    failed = [f"{log} ({codes[pid]})" for pid, log in zip(children, logs, strict=True) if codes.get(pid, 0)]
    if spec.get("all_succeed") and failed:
        print(f"forked_processes.py: ended with another code than 0: {', '.join(failed)}")
    sys.exit(1 if left or (spec.get("all_succeed") and failed) else 0)


if __name__ == "__main__":
    main()
