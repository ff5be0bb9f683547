"""A process that imported torch, Lightning and lightning_pipe once and forks each forked launch's runner from there.

``python tests/zygote.py`` (`launching.Zygote` starts one per test process, at its first forked launch): a cold
process spends about 5 s of CPU importing torch, Lightning and lightning_pipe, and every `forked_ranks.py` run
paid it again before forking its ranks (`forked_processes.py` its processes); the suite starts about twenty such
runs. Here the import is paid once per test process: each run is a child forked from this one, which then does what
``python tests/forked_ranks.py ARGS`` does (its ranks forked from it in turn).

The protocol is lines of JSON. On standard input, a request: ``{"runner": "forked_ranks.py", "argv": [...], "env":
{...}, "output": path}`` (runner: ``forked_ranks.py`` or ``forked_processes.py``);
this process forks a child that starts a session of its own (so that `launching.kill` ends it and its ranks as it
ends a started process's), writes its standard output and error to ``output``, takes ``env`` as its environment
and runs the runner's ``main`` with ``argv``. On standard output, the reply: ``{"pid": pid}``. When a child ends,
its exit code (negative: the signal that ended it, as `subprocess` gives it) is written to ``output + ".rc"``
(written to a temporary name first, then renamed: a reader never sees half of it). The end of standard input (the
test process ended, even killed) ends this process; its children are in sessions of their own and the test that
started each ends it.
"""

from __future__ import annotations

import json
import os
import select
import sys

import forked_processes
import forked_ranks  # torch, Lightning and lightning_pipe: imported here once

RUNNERS = {"forked_ranks.py": forked_ranks, "forked_processes.py": forked_processes}


def run_child(request: dict) -> None:
    """In the forked child: a session of its own, the request's output and environment, then forked_ranks.py."""
    os.setsid()
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    runner = RUNNERS[request["runner"]]
    sys.argv = [runner.__file__, *request["argv"]]
    code = 0
    try:
        runner.main()
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        if not isinstance(exit.code, int | None):
            print(exit.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def reap(children: dict[int, str]) -> None:
    """Write the exit code of every child that ended."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        output = children.pop(pid, None)
        if output is not None:
            with open(output + ".rc.tmp", "w") as file:
                file.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(output + ".rc.tmp", output + ".rc")


def main() -> None:
    children: dict[int, str] = {}
    requests = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        reap(children)
        if not ready:
            continue
        line = requests.readline()
        if not line:  # the test process ended
            return
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request)
        children[pid] = request["output"]
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    main()
