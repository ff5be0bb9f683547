"""Big models: memory splits like compute (examples/big_model.py, real processes on 127.0.0.1 over gloo).

Every launch runs ``examples/big_model.py``'s training as a user's script does (Lightning's launcher starts the
processes), several runs one after another in the same processes (`big_model_runs.py`: a launch costs every
process its imports); each process reports each run's losses and peak resident memory. The plain Trainer's
runs are the references. Every launched run of this module is in one of two launches side by side (the
`launched` fixture, tests/big_launch.py: 4 processes and 2); each test checks its runs' folders.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import fsdp_build
import lightning as L
import pytest
import torch
from big_launch import AGAINST_DDP, BIG_CASES, LAYOUTS, SEEDED, STATE_MIB, launch
from launching import ROOT

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.consolidate import consolidate

sys.path.insert(0, str(ROOT / "examples"))
import big_model  # noqa: E402 - the example, imported for its LightningModule


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


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every launched run of this module, once (`big_launch.launch`: the plain references run here first)."""
    return launch(tmp_path_factory.mktemp("launched"))


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


def fsdp_reports(out: Path, case: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in range(4)]


def fsdp_local(epochs: int, ckpt_path: Path | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Local mode (every stage whole, threads of this process): the same model, data and seed as fsdp_build.py."""
    L.seed_everything(0, verbose=False)
    record = big_model.Record(None, 0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, callbacks=[record], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=PipeStrategy(stages=2, microbatches=2, transport="local"),
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = big_model.Big(fsdp_build.WIDTH, fsdp_build.DEPTH, "meta", "adam")
    loader = torch.utils.data.DataLoader(fsdp_build.data(), batch_size=fsdp_build.ROWS)
    trainer.fit(model, loader, ckpt_path=str(ckpt_path) if ckpt_path is not None else None)
    return {f"model.{k}": v.detach().clone() for k, v in model.model.state_dict().items()}, record.losses


@pytest.mark.slow
def test_fsdp_builds_each_stage_shard_by_shard(launched: Path, tmp_path: Path) -> None:
    """Built from the seed, from a sharded folder and from a single file (`fsdp_build.py`, 2 x 2 with FSDP per
    stage), every process holds exactly its shard of its stage (a DTensor per parameter, half of each, nothing
    else of the model real) and never held more than one module of it whole; the seeded model equals local
    mode's; both resumes train as local mode does."""
    out = launched / "fsdp_build"
    width = fsdp_build.WIDTH
    module_bytes = (width * width + width) * 4  # one Linear's weight and bias: the largest module
    tensor_bytes = width * width * 4  # its weight: the largest tensor
    stage_bytes = fsdp_build.DEPTH // 2 * module_bytes
    for case in ("seeded", "folder", "file"):
        for rank, report in enumerate(fsdp_reports(out, case)):
            where = f"{case}, rank {rank}"
            params = report["params"]
            assert len(params) == fsdp_build.DEPTH, where  # 3 Linear layers of this process's stage: 6 tensors
            for name, p in params.items():
                assert p["dtensor"], f"{where}: {name} is not sharded"
                assert p["local"] == [p["shape"][0] // 2, *p["shape"][1:]], f"{where}: {name} holds {p['local']}"
            assert sum(p["bytes"] for p in params.values()) == stage_bytes // 2, where
            assert report["others_real"] == [], f"{where}: holds other tensors: {report['others_real']}"
            assert report["fsdp_groups_checked"] == 3, where  # the private attributes the reduce reads exist
            if case == "seeded":  # each module whole once, one at a time
                assert report["wholes_count"] == len(params) and report["wholes_peak"] <= module_bytes, where
                assert report["loaded"] == 0
            elif case == "folder":  # read as shards: nothing whole, ever
                assert report["wholes_count"] == 0 and report["loaded"] == len(params), where
            else:  # one tensor whole at a time, from the mapped file
                assert report["wholes_count"] == len(params) and report["wholes_peak"] <= tensor_bytes, where
    # the seeded FSDP model is the model every other layout builds from the same seed
    initial, _ = fsdp_local(0, None)
    seeded = state_of(out / "seeded", tmp_path / "seeded-one.ckpt")
    assert same_state(seeded, initial) == 0.0
    # resumed from the sharded folder or the file: local mode's steps (the replicas' mean loss is the global one)
    trained, local_losses = fsdp_local(2, out / "seeded")
    for case in ("folder", "file"):
        replicas = [r["losses"] for r in fsdp_reports(out, case) if r["losses"]]
        assert len(replicas) == 2
        mean = [sum(step) / 2 for step in zip(*replicas, strict=True)]
        assert mean == pytest.approx(local_losses, rel=1e-5), f"{case}: {mean} != {local_losses}"
    assert same_state(state_of(out / "folder", tmp_path / "folder-one.ckpt"), trained) < 1e-5


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
