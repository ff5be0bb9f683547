"""Starting training scripts the way users do (Lightning's launcher, torchrun, SLURM), always ending them.

Every launch runs in its own process session; whatever is left of it when the launch returns (a
timeout, a failure) is SIGKILLed with the whole session, so no test leaves a process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from processes import owned_env
from zygote_client import ZYGOTE, ForkedRun

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Run:
    returncodes: list[int | None]
    output: str
    seconds: float
    ended: float  # time.time() when the last process had ended

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MASTER_ADDR"] = "127.0.0.1"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a crash (SIGSEGV, SIGABRT) prints every thread's Python stack
    return owned_env(env)


def start_session(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``command`` in a session (and process group) of its own, output captured."""
    return subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True
    )


def run_all(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> Run:
    """Start every command (each in a session of its own), wait for all within ``timeout``, kill what is left. A
    `forked_command` runs forked from this test process's `Zygote` where its environment allows."""
    start = time.monotonic()
    procs = [ZYGOTE.start(cmd, env) or start_session(cmd, env) for cmd, env in commands]
    outputs = []
    try:
        for proc in procs:
            left = max(1.0, timeout - (time.monotonic() - start))
            try:
                out, _ = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                kill(proc)
                out, _ = proc.communicate()
                out += f"\n[test] killed after {timeout:.0f} s"
            outputs.append(out)
    finally:
        for proc in procs:
            kill(proc)
    return Run([p.returncode for p in procs], "\n".join(outputs), time.monotonic() - start, time.time())


def kill(proc: subprocess.Popen | ForkedRun) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's children are in its session
    except (ProcessLookupError, PermissionError):
        pass


def lightning_launch(script: str, args: list[str], timeout: float = 240) -> Run:
    """``python script.py ...``: Lightning's own launcher starts the other processes."""
    env = base_env()
    env["MASTER_PORT"] = str(free_port())
    return run_all([([sys.executable, script, *args], env)], timeout)


def torchrun(script: str, args: list[str], nproc: int = 4, timeout: float = 240) -> Run:
    """``torchrun --nproc-per-node N --master-addr 127.0.0.1 --master-port P script.py ...``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *args,
    ]  # fmt: skip
    return run_all([(cmd, base_env())], timeout)


def forked_ranks(
    script: str,
    args: list[str],
    nproc: int,
    nodes: int = 1,
    timeout: float = 240,
    cluster: str = "torchelastic",
    on_failure: str = "stop",
) -> Run:
    """The ranks as torchrun (or ``cluster="slurm"``: srun) starts them, its variables, forked from one process that
    imported torch, Lightning and lightning_pipe once (`forked_ranks.py`, itself forked from this test process's
    `zygote_client.Zygote`, which imported them once for all its runs): for the tests whose subject is a run, not
    the process launcher (a cold process spends about 5 s of CPU importing them). ``nodes`` simulates that many nodes
    of ``nproc`` processes. ``on_failure="wait"``: a failing rank ends no other, each must end by itself (a test of
    a lost rank); ``"stop"`` ends them, as torchrun does."""
    return run_all([forked_command(script, args, nproc, nodes, cluster, on_failure, timeout)], timeout)


def forked_command(
    script: str,
    args: list[str],
    nproc: int,
    nodes: int = 1,
    cluster: str = "torchelastic",
    on_failure: str = "stop",
    timeout: float = 600,
) -> tuple[list[str], dict[str, str]]:
    """`forked_ranks`' command and environment (a port of its own), for `run_all` beside other commands."""
    env = base_env()
    env["MASTER_PORT"] = str(free_port())
    command = [sys.executable, str(ROOT / "tests" / "forked_ranks.py"), "--nproc", str(nproc), "--nodes", str(nodes),
               "--cluster", cluster, "--on-failure", on_failure, "--timeout", str(timeout)]  # fmt: skip
    return [*command, script, *args], env


def slurm(script: str, args: list[str], nodes: int = 2, tasks_per_node: int = 2, timeout: float = 240) -> Run:
    """What ``srun`` starts on ``nodes`` nodes, simulated here: one process per task with SLURM's variables."""
    port = str(free_port())
    commands = []
    for rank in range(nodes * tasks_per_node):
        env = base_env() | slurm_variables(rank, tasks_per_node, nodes) | {"MASTER_PORT": port}
        commands.append(([sys.executable, script, *args], env))
    return run_all(commands, timeout)


def torchelastic_variables(index: int, nproc: int, nodes: int) -> dict[str, str]:
    """The variables torchrun gives worker ``index`` of ``nproc x nodes``."""
    node, local = divmod(index, nproc)
    world = nproc * nodes
    return dict(
        RANK=str(index), LOCAL_RANK=str(local), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(nodes), ROLE_RANK=str(index), ROLE_WORLD_SIZE=str(world),
        ROLE_NAME="default", TORCHELASTIC_RUN_ID="forked-ranks", TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )  # fmt: skip


def slurm_variables(index: int, nproc: int, nodes: int) -> dict[str, str]:
    """The variables ``srun`` gives task ``index`` of ``nproc`` tasks per node on ``nodes`` nodes."""
    node, local = divmod(index, nproc)
    return dict(
        SLURM_NTASKS=str(nproc * nodes), SLURM_NTASKS_PER_NODE=str(nproc), SLURM_NNODES=str(nodes),
        SLURM_PROCID=str(index), SLURM_LOCALID=str(local), SLURM_NODEID=str(node), SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="train", SLURM_NODELIST="127.0.0.1",
    )  # fmt: skip


#: the variables of each cluster environment `forked_ranks.py` simulates, by name
CLUSTERS = {"torchelastic": torchelastic_variables, "slurm": slurm_variables}
