"""Big models: memory splits like compute (examples/big_model.py, real processes on 127.0.0.1 over gloo).

Every launch runs ``examples/big_model.py``'s training as a user's script does (Lightning's launcher starts the
processes), several runs one after another in the same processes (`big_model_runs.py`: a launch costs every
process its imports); each process reports each run's losses and peak resident memory. The plain Trainer's
runs are the references. Every launched run of this module is in one of two launches side by side (the
`launched` fixture): 4 processes (the 512 MiB model's runs first, then the small model's, then the pretrained
GPT-2's) and 2 processes (Lightning DDP's runs, then GPT-2 under zbv); each test checks its runs' folders.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from launching import ROOT, Run, base_env, free_port, run_all

from lightning_pipe import PipeStrategy
from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.errors import ConfigurationError

RUNS = str(ROOT / "tests" / "big_model_runs.py")
sys.path.insert(0, str(ROOT / "examples"))
import big_model  # noqa: E402 - the example, imported for its LightningModule

MIB = 1 << 20


def launch_runs(*launches: tuple[Path, list[list[str]]], timeout: float = 1200) -> Run:
    """Launches (Lightning's launcher, as ``python big_model.py`` starts it), all at once, each doing its ``runs``
    (big_model.py and hf_weights_train.py command lines) one after another in the same processes
    (`big_model_runs.py`). The timeout guards against a hang: a launch does the work of several of the 600 s
    launches it replaces."""
    commands = []
    for folder, runs in launches:
        folder.mkdir(parents=True)
        (folder / "runs.json").write_text(json.dumps(runs))
        env = base_env() | {"MASTER_PORT": str(free_port())}
        commands.append(([sys.executable, RUNS, str(folder / "runs.json")], env))
    run = run_all(commands, timeout)
    assert run.ok, f"launch failed ({run.returncodes}):\n{run.output[-6000:]}"
    return run


def empty_mib(folder: Path) -> dict[int, float]:
    """Per rank, a launched process's memory before its first run (torch, Lightning and lightning_pipe imported)."""
    return {int(p.stem.removeprefix("empty-rank")): json.loads(p.read_text())["peak_mib"]
            for p in folder.glob("empty-rank*.json")}  # fmt: skip


def reports(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def losses(folder: Path) -> list[list[float]]:
    """The losses of each replica's coordinator (the processes that run Lightning's loop)."""
    return [r["losses"] for r in reports(folder) if r["losses"]]


def close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


def state_of(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """The module state of a checkpoint (a sharded folder is made one file first)."""
    if checkpoint.is_dir():
        checkpoint = consolidate(checkpoint, out)
    return torch.load(checkpoint, weights_only=True)["state_dict"]


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


STATE_MIB = 3 * 32 * (2048 * 2048 + 2048) * 4 / MIB  # the 512 MiB model: parameters + gradients + momentum
BIG_CASES = {  # in the order they run: the one closest to its bound first
    # 2 replicas of 8 rows each: the plain run's 16 rows per step
    "fsdp": (["--build", "meta", "--stages", "2", "--data-parallel", "fsdp", "--batch", "8"], 0.40),
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


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every launched run of this module, in two launches side by side: 4 processes (the 512 MiB model's runs
    first, their memory bounds measured before anything else ran there; then the small model's; then GPT-2's
    1 x 4) and 2 processes (Lightning DDP's runs, then GPT-2 under zbv). Folders: ``big``, ``small``, ``hf``."""
    folder = tmp_path_factory.mktemp("launched")
    for part in ("big", "small", "hf"):
        (folder / part).mkdir()
    four = big_runs(folder / "big")
    small_four, two = small_runs(folder / "small")
    four += small_four
    if importlib.util.find_spec("transformers") is not None:  # the GPT-2 test skips without it
        hf = hf_runs(folder / "hf")
        four.append(hf["1f1b"])
        two.append(hf["zbv"])
    launch_runs((folder / "four", four), (folder / "two", two))
    return folder


@pytest.mark.slow
def test_a_512_mib_model_resumed_per_stage_holds_a_stage_per_process(launched: Path) -> None:
    """32 x Linear(2048, 2048), SGD with momentum (1.5 GiB of training state), resumed from a plain Trainer's
    checkpoint: 1 x 4 (eager, meta, configure_model) and 2 x 2 FSDP (meta) take the plain run's losses, and
    every process stays within its share of the training state.

    The plain run trains in this process (only its losses and checkpoint are used); the four resumed runs are
    the first runs of the 4-process launch, each process measuring each run's peak on its own and the memory it
    started with (torch, Lightning and lightning_pipe imported: what a process costs before any model)."""
    folder = launched / "big"
    plain = losses(folder / "plain")[0][1:]  # the two steps after the checkpoint
    empty = empty_mib(launched / "four")
    for name, (_, share) in BIG_CASES.items():
        got = reports(folder / name)
        assert len(got) == 4
        peaks = [(r["peak_mib"] - empty[r["rank"]]) / STATE_MIB for r in got]
        assert max(peaks) <= share, f"{name}: peak memory per process / training state = {peaks} (> {share})"
        per_replica = losses(folder / name)  # each replica's loss is over its half of the rows: their mean is all
        got_losses = [sum(step) / len(step) for step in zip(*per_replica, strict=True)]
        assert close(got_losses, plain), f"{name}: {per_replica} != {plain}"


@pytest.mark.slow
def test_fsdp_2x2_equals_lightning_ddp_with_two_processes(launched: Path) -> None:
    """3 SGD steps (gpipe) and 3 Adam steps (1f1b, clipping) from the same eagerly built model: FSDP over each
    stage's 2 replicas takes Lightning DDP's steps (same per-process batch), losses and trained parameters to 1e-5;
    so does 1f1b with gradient accumulation and recomputation."""
    small_runs = launched / "small"
    for name in AGAINST_DDP:
        fsdp, ddp = small_runs / f"fsdp-{name}", small_runs / f"ddp-{name}"
        for a, b in zip(losses(fsdp), losses(ddp), strict=True):
            assert close(a, b), f"{name}: {a} != {b}"
        diff = same_state(state_of(fsdp / "ckpt", fsdp / "one.ckpt"), state_of(ddp / "ckpt", ddp / "one.ckpt"))
        assert diff < 1e-5, f"{name}: parameters differ from DDP's by {diff:.2e}"


@pytest.mark.slow
def test_a_sharded_fsdp_checkpoint_resumes_under_any_layout(launched: Path, tmp_path: Path) -> None:
    """A 2 x 2 FSDP run's sharded checkpoint resumes under 1 x 4 (DDP), 4 x 1 and local mode: the next step
    takes every layout to the same parameters (16 rows, one global batch); consolidated, it loads strictly into
    a plain Trainer's module with its own values."""
    small_runs = launched / "small"
    first = small_runs / "fsdp"
    expected = state_of(first / "final", tmp_path / "final.ckpt")
    for name in LAYOUTS:
        out = small_runs / name
        diff = same_state(state_of(out / "final", tmp_path / f"{name}.ckpt"), expected)
        assert diff < 1e-5, f"{name}: the resumed step differs from the 2 x 2 run's by {diff:.2e}"
    # local mode, in this process: all stages are threads here
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=PipeStrategy(stages=2, microbatches=2, transport="local"),
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = big_model.Big(32, 6, "meta", "adam")
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 32), torch.randn(16, 32))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16), ckpt_path=str(first / "saved"))
    local = {f"model.{k}": v for k, v in model.model.state_dict().items()}
    assert same_state(local, expected) < 1e-5
    # the folder as one file, in a plain Trainer's module: strict, equal to the folder's values
    single = state_of(first / "saved", tmp_path / "saved.ckpt")
    plain = big_model.Big(32, 6, "eager", "adam")
    plain.load_state_dict(single, strict=True)
    folder = open_folder_state(first / "saved")
    assert same_state({f"model.{k}": v for k, v in plain.model.state_dict().items()}, folder) == 0.0


def open_folder_state(folder: Path) -> dict[str, torch.Tensor]:
    from lightning_pipe.checkpoint.reader import open_checkpoint

    model = open_checkpoint(folder).model()
    return {key: model.get(key) for key in model.keys()}


@pytest.mark.slow
def test_the_same_seed_builds_the_same_model_in_every_layout(launched: Path, tmp_path: Path) -> None:
    """Built on meta with no checkpoint, each stage initialises its own tensors from the run's seed and their
    names: 1 x 4, 2 x 2 and local mode start from the same parameters (1 x 4 saves them as one file, written
    a tensor at a time: save_distributed_checkpoint=False)."""
    states = {}
    for name in SEEDED:
        out = launched / "small" / f"seeded-{name}"
        states[name] = state_of(out / "initial", tmp_path / f"{name}.ckpt")
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, strategy=PipeStrategy(stages=3, transport="local"),
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = big_model.Big(32, 6, "meta", "sgd")
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 32), torch.randn(8, 32))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    local = {f"model.{k}": v for k, v in model.model.state_dict().items()}
    assert same_state(states["1x4"], local) == 0.0
    assert same_state(states["2x2"], local) == 0.0
    assert local["model.0.weight"].std() > 0  # initialised, not zeros


@pytest.mark.slow
def test_pretrained_safetensors_weights_are_read_per_stage(launched: Path) -> None:
    """A HF GPT-2 (from a config) saved with ``save_pretrained`` in small safetensors shards: 1 x 4 with the model
    built on meta reads each stage's tensors in that stage's process (its tied head from the embedding's key),
    nothing else, and trains as the plain model loaded with ``from_pretrained`` does (here, in this process)."""
    pytest.importorskip("transformers")
    folder = launched / "hf"
    assert (folder / "weights" / "model.safetensors.index.json").is_file()
    want, got = reports(folder / "plain")[0]["losses"], reports(folder / "1f1b")
    assert close(got[0]["losses"], want), f"{got[0]['losses']} != {want}"
    held: list[str] = []
    for report in got:
        assert report["read"] == report["holds"], "a process read tensors that are not its stage's"
        held += report["holds"]
    assert "lm_head.weight" in held and len(set(held)) == len(held)  # every stage its own keys, once
    # the V of zbv in 2 processes: the embedding (stage 0) and its tied head (stage 3) both in process 0
    for schedule in ("zbv",):
        got = reports(folder / schedule)
        assert len(got) == 2
        assert close(got[0]["losses"], want), f"{schedule}: {got[0]['losses']} != {want}"
        assert all(set(report["read"]) <= set(report["holds"]) for report in got), schedule  # its own tensors only


def test_fsdp_refuses_split_backwards_and_one_file_before_any_work() -> None:
    for schedule in ("zero-bubble", "interleaved-zero-bubble", "zbv", "dualpipev"):
        refused = f"schedule='{schedule}'.*splits backwards.*'looped-bfs' with FSDP"
        with pytest.raises(ConfigurationError, match=refused):
            PipeStrategy(data_parallel="fsdp", schedule=schedule)
    PipeStrategy(data_parallel="fsdp", schedule="looped-bfs")  # a full backward: FSDP runs it
    with pytest.raises(ConfigurationError, match="consolidate"):
        PipeStrategy(data_parallel="fsdp", save_distributed_checkpoint=False)
    with pytest.raises(ConfigurationError, match="pass 'ddp'"):
        PipeStrategy(data_parallel="zero")
