"""The old import paths of modules that moved (issue 39) give the module at its new path, and warn once."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from lightning_pipe.base.moved import GONE_PACKAGES, MOVED
from lightning_pipe.comm.slot import WORKER_ENV


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_and_warns(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)


def test_old_names_import_from_a_fresh_interpreter() -> None:
    """``from OLD import NAME`` as users wrote it, in a process that never imported the new paths first."""
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import lightning_pipe\n"
        "try:\n"
        "    from lightning_pipe.executors import ForwardModule\n"
        "except DeprecationWarning as w:\n"
        "    print('warned', w)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from lightning_pipe.executors import ForwardModule\n"
        "from lightning_pipe.memory.plan import MemoryPlan\n"
        "from lightning_pipe.engine.executors import ForwardModule as New\n"
        "assert ForwardModule is New\n"
        "from lightning_pipe.pipeline import Pipeline\n"
        "print('ok')\n"
    )
    # a stage worker's environment: `import lightning_pipe` skips Lightning (seconds), which no moved module needs
    env = os.environ | {WORKER_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "warned lightning_pipe.executors moved to lightning_pipe.engine.executors" in out.stdout
    assert out.stdout.strip().endswith("ok")


def test_every_new_path_exists_and_no_old_one_does() -> None:
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        assert old not in {m for m in MOVED.values()}, f"{old} is both moved and a module"
    assert all(package not in MOVED.values() for package in GONE_PACKAGES)
