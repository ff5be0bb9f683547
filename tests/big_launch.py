"""The launched runs of tests/test_big_models.py, in two launches side by side.

A process start costs seconds (torch and Lightning imported), so every launched run of the big-model tests
shares the processes of one launch of 4 (Lightning's launcher, as ``python big_model.py`` starts it) and one
of 2, each process doing its launch's runs one after another (`big_model_runs.py`): in the 4, the 512 MiB
model's runs first (their memory bounds measured before anything else ran there), then the small model's, then
the FSDP builds (`fsdp_build.py`), then GPT-2's 1 x 4; in the 2, Lightning DDP's runs, then GPT-2 under zbv.
Each part's runs write their own folder (``big``, ``small``, ``fsdp_build``, ``hf``). The 4 are not forked
(`launching.forked_ranks`): a forked rank faults its parent's pages in as it touches them, which a run's peak then
counts (the FSDP case measured 0.393-0.402 of the state against 0.38 in a cold process, over its 0.40 bound). The 2,
whose memory no test reads, are forked after one import (torchrun's variables; their subject is the run).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from launching import ROOT, Run, base_env, forked_command, free_port, run_all

RUNS = str(ROOT / "tests" / "big_model_runs.py")
sys.path.insert(0, str(ROOT / "examples"))
import big_model  # noqa: E402 - the example: its plain runs here


def launch_runs(*launches: tuple[Path, list[list[str]], int], timeout: float = 1200) -> Run:
    """Launches, all at once, each doing its ``runs`` (big_model.py and hf_weights_train.py command lines) one after
    another in the same processes (`big_model_runs.py`): Lightning's launcher, as ``python big_model.py`` starts it,
    where ``forked`` is 0, else ``forked`` ranks forked after one import (`launching.forked_command`). The timeout
    guards against a hang: a launch does the work of several of the 600 s launches it replaces."""
    commands = []
    for folder, runs, forked in launches:
        folder.mkdir(parents=True)
        (folder / "runs.json").write_text(json.dumps(runs))
        if forked:
            commands.append(forked_command(RUNS, [str(folder / "runs.json")], nproc=forked))
        else:
            env = base_env() | {"MASTER_PORT": str(free_port())}
            commands.append(([sys.executable, RUNS, str(folder / "runs.json")], env))
    run = run_all(commands, timeout)
    assert run.ok, f"launch failed ({run.returncodes}):\n{run.output[-6000:]}"
    return run


STATE_MIB = 3 * 32 * (2048 * 2048 + 2048) * 4 / 2**20  # the 512 MiB model: parameters + gradients + momentum
BIG_CASES = {  # in the order they run: the one closest to its bound first
    # 2 replicas of 8 rows each: the plain run's 16 rows per step. 2 microbatches, not 4: FSDP gathers each block
    # in every microbatch's forward and backward (gloo over loopback: 4 cost this launch 20 s more CPU); the peak
    # is the same (its activations are a few KiB)
    "fsdp": (
        ["--build", "meta", "--stages", "2", "--data-parallel", "fsdp", "--batch", "8", "--microbatches", "2"],
        0.40,
    ),
    "meta": (["--build", "meta"], 0.35),
    "configure_model": (["--build", "configure_model"], 0.35),
    "eager": (["--build", "eager"], 0.55),
}
SMALL = ["--width", "32", "--depth", "6", "--microbatches", "2"]
# FSDP 2 x 2 against Lightning DDP over 2 processes: optimizer, schedule, more arguments
AGAINST_DDP = {
    "sgd-gpipe": ("sgd", "gpipe", []),
    "adam-1f1b": ("adam", "1f1b", ["--clip", "0.05"]),
    "sgd-1f1b-acc": ("sgd", "1f1b", ["--accumulate", "2", "--recompute", "always"]),
    "sgd-looped-bfs-v2": ("sgd", "looped-bfs", ["--virtual-stages", "2"]),  # FSDP under a looped schedule
}
RESUMED = [*SMALL, "--optimizer", "adam", "--build", "meta"]  # a 2 x 2 FSDP run's checkpoint, resumed
LAYOUTS = {"1x4": ["--stages", "4", "--batch", "16"], "4x1": ["--stages", "1", "--batch", "4"]}
SEEDED = {"1x4": ["--stages", "4", "--single-file"], "2x2": ["--stages", "2"]}  # 1 x 4 writes one file
HF_SCHEDULES = {  # GPT-2: 1 x 4, and the V of zbv in 2 processes
    "1f1b": [],
    "zbv": ["--schedule", "zbv", "--devices", "2", "--virtual-stages", "2", "--microbatches", "4"],
}


def against_ddp(name: str, folder: Path) -> tuple[list[str], list[str]]:
    """The FSDP 2 x 2 run and the Lightning DDP run of a case of AGAINST_DDP."""
    optimizer, schedule, extra = AGAINST_DDP[name]
    case = [*SMALL, "--epochs", "3", "--optimizer", optimizer, "--batch", "8", *extra]
    fsdp, ddp = folder / f"fsdp-{name}", folder / f"ddp-{name}"
    ddp_case = [a for a in case if a not in ("--recompute", "always")]  # DDP has no stages to recompute
    return (
        ["big_model.py", *case, "--stages", "2", "--data-parallel", "fsdp", "--build", "eager", "--schedule",
         schedule, "--save-at-end", str(fsdp / "ckpt"), "--report", str(fsdp)],
        ["big_model.py", *ddp_case, "--ddp", "--devices", "2", "--save-at-end", str(ddp / "ckpt"), "--report",
         str(ddp)],
    )  # fmt: skip


def big_runs(folder: Path) -> list[list[str]]:
    """The 512 MiB model: its plain run here (3 steps, saved after the first), the resumed runs' command lines."""
    big_model.main(["--plain", "--save", str(folder / "plain.ckpt"), "--report", str(folder / "plain")])
    return [["big_model.py", *args, "--ckpt-path", str(folder / "plain.ckpt"), "--report", str(folder / name)]
            for name, (args, _) in BIG_CASES.items()]  # fmt: skip


def small_runs(folder: Path) -> tuple[list[list[str]], list[list[str]]]:
    """The small model's 4-process runs (FSDP against DDP, the resumed layouts, the seeded builds) and Lightning
    DDP's 2-process runs."""
    four, two = [], []
    for name in AGAINST_DDP:
        fsdp, ddp = against_ddp(name, folder)
        four.append(fsdp)
        two.append(ddp)
    first = folder / "fsdp"  # 2 x 2 FSDP, saved after its first step, then resumed under each layout
    four.append(["big_model.py", *RESUMED, "--stages", "2", "--data-parallel", "fsdp", "--batch", "8", "--epochs",
                 "2", "--save", str(first / "saved"), "--save-at-end", str(first / "final"), "--report",
                 str(first)])  # fmt: skip
    for name, args in LAYOUTS.items():
        out = folder / name
        four.append(["big_model.py", *RESUMED, *args, "--epochs", "2", "--ckpt-path", str(first / "saved"),
                     "--save-at-end", str(out / "final"), "--report", str(out)])  # fmt: skip
    for name, args in SEEDED.items():
        four.append(["big_model.py", *SMALL, *args, "--build", "meta", "--epochs", "0", "--save-at-end",
                     str(folder / f"seeded-{name}" / "initial")])  # fmt: skip
    return four, two


def hf_runs(folder: Path) -> dict[str, list[str]]:
    """A HF GPT-2 (from a config) saved with ``save_pretrained`` in small safetensors shards, its plain run here
    (``from_pretrained``), and its pipelined runs' command lines by schedule: 1 x 4, and zbv in 2 processes."""
    import hf_weights_train
    import transformers
    from causal_lm import CausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    CausalLM().model.save_pretrained(folder / "weights", max_shard_size="100KB")
    hf_weights_train.main(["--weights", str(folder / "weights"), "--report", str(folder / "plain"), "--plain"])
    return {schedule: ["hf_weights_train.py", "--weights", str(folder / "weights"), "--report",
                       str(folder / schedule), *more] for schedule, more in HF_SCHEDULES.items()}  # fmt: skip


def launch(folder: Path) -> Path:
    """Every run, the plain references first (here); returns ``folder``. Without transformers (the GPT-2 test
    skips then) GPT-2's runs are left out."""
    for part in ("big", "small", "fsdp_build", "hf"):
        (folder / part).mkdir()
    four = big_runs(folder / "big")
    small_four, two = small_runs(folder / "small")
    four += small_four
    four.append(["fsdp_build.py", "--out", str(folder / "fsdp_build")])
    if importlib.util.find_spec("transformers") is not None:
        hf = hf_runs(folder / "hf")
        four.append(hf["1f1b"])
        two.append(hf["zbv"])
    launch_runs((folder / "four", four, 0), (folder / "two", two, 2))
    return folder
