"""Lightning's checkpoint hooks own the checkpoint in every mode (docs/big-models.md, "Migrating a checkpoint").

A checkpoint of an older version of the model (tests/checkpoint_hooks.py: a renamed key, a tensor stored in
half precision, one stored scaled, one missing) is migrated by the LightningModule's ``on_load_checkpoint``;
``drop``: the hook also drops a key, which ``strict_loading = False`` initialises. In local mode (built eagerly and
on meta), rpc mode (built on meta) and launched mode (DDP built eagerly and in configure_model, FSDP in
configure_model), from a single file and from a sharded folder, the resumed run equals a plain Trainer resuming
the single file with the same hook: its losses and its trained tensors. Its ``on_save_checkpoint`` exports the
trained state under other keys: what every mode writes (a file, or each process its part of a folder) equals what
the plain Trainer writes with the same hook, the optimizer state under the parameter's new name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_hooks import DROPPED, EXPORTED, LAUNCHED, LAUNCHED_CASES, STEPS, fit, write_old_files
from launching import ROOT, forked_ranks
from processes import leftover_processes
from state_contract import tensors

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.lazy_state import LazyTensor
from lightning_pipe.checkpoint.reader import open_checkpoint

SCRIPT = str(ROOT / "tests" / "checkpoint_hooks.py")
LENIENT = f"1 tensor initialised instead of read ('{DROPPED}')"


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The old checkpoint's file and folder, and per hook (``drop``) the plain Trainer's resumed run."""
    out = tmp_path_factory.mktemp("old")
    files = write_old_files(out)
    plain = {}
    for drop in (False, True):
        saved = out / f"plain-{drop}.ckpt"
        _, _, losses = fit("auto", "eager", STEPS, ckpt=files["file"], drop=drop, save=saved)
        momentum = torch.load(saved, weights_only=True)["optimizer_states"][0]["state"][6]["momentum_buffer"]
        plain[drop] = {"losses": losses.values, "tensors": tensors(saved), "momentum": momentum}
    return {"files": files, "plain": plain, "out": out}


def written(path: Path, want: dict[str, Any], what: str) -> None:
    """The checkpoint at ``path`` holds what the plain Trainer's does, the exported parameter's momentum too."""
    same(tensors(path), want["tensors"], what)
    reader = open_checkpoint(path)
    try:
        if path.is_dir():  # by name: the state follows the parameter's exported key
            momentum = reader.optimizer_state(0, EXPORTED[1])["momentum_buffer"]
        else:  # by position, as torch saves it
            momentum = reader.content["optimizer_states"][0]["state"][6]["momentum_buffer"]  # type: ignore[attr-defined]
        torch.testing.assert_close(momentum, want["momentum"], rtol=0, atol=1e-6, msg=what)
    finally:
        reader.close()


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=f"{what}: {key}")


def lenient_said(said: list[str], drop: bool) -> None:
    """strict_loading=False says once what it initialised: the dropped key only (the hook's other edits read)."""
    lenient = [s for s in said if s.startswith("strict_loading=False")]
    assert len(lenient) == (1 if drop else 0), lenient
    if drop:
        assert LENIENT in lenient[0] and "ignored" not in lenient[0], lenient[0]


@pytest.mark.parametrize("drop", [False, True], ids=["migrate", "drop"])
@pytest.mark.parametrize("fmt", ["file", "folder"])
@pytest.mark.parametrize("build", ["eager", "init_module"])
def test_local_mode_reads_what_the_hook_left(old: dict, build: str, fmt: str, drop: bool, tmp_path: Path) -> None:
    strategy = PipeStrategy(stages=2, microbatches=2)
    t, _, losses = fit(strategy, build, STEPS, ckpt=old["files"][fmt], drop=drop, save=tmp_path / "saved.ckpt")
    want = old["plain"][drop]
    assert losses.values == pytest.approx(want["losses"], abs=1e-6)
    written(tmp_path / "saved.ckpt", want, f"local {build} {fmt}")
    lenient_said(t.said, drop)  # type: ignore[attr-defined]


@pytest.fixture
def no_worker_left() -> Iterator[None]:
    yield
    assert leftover_processes() == [], "worker processes left behind"


@pytest.mark.parametrize(("fmt", "drop"), [("file", False), ("folder", True)])
def test_rpc_mode_reads_what_the_hook_left(
    old: dict, fmt: str, drop: bool, tmp_path: Path, no_worker_left: None
) -> None:
    strategy = PipeStrategy(stages=2, microbatches=2, transport="rpc", timeout=120)
    saved = tmp_path / "saved"  # a folder: the workers write their stages, this process the rest
    t, _, losses = fit(strategy, "init_module", STEPS, ckpt=old["files"][fmt], drop=drop, default_root_dir=tmp_path,
                       save=saved)  # fmt: skip
    want = old["plain"][drop]
    assert losses.values == pytest.approx(want["losses"], abs=1e-6)
    written(saved, want, f"rpc {fmt}")
    lenient_said(t.said, drop)  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="on_save_checkpoint changed the state_dict"):
        t.save_checkpoint(tmp_path / "after")  # after the fit: the folder the workers left, written before the hook


def test_launched_modes_read_what_the_hook_left(old: dict, tmp_path: Path) -> None:
    """One launch of 2 processes: DDP 1 x 2 built eagerly and in configure_model, FSDP 2 x 1 in configure_model,
    each from the file and the folder, each with the lenient hook and the strict one (`LAUNCHED_CASES`); each writes
    the folder its fit ended with."""
    (tmp_path / "files.json").write_text(json.dumps(old["files"]))
    run = forked_ranks(SCRIPT, ["--files", str(tmp_path / "files.json"), "--out", str(tmp_path)], nproc=2, timeout=400)
    assert run.ok, run.output[-3000:]
    replicas_of = {name: replicas for name, _, _, replicas, _ in LAUNCHED}
    assert {(name, fmt) for name, fmt, _ in LAUNCHED_CASES} == {(n, f) for n in replicas_of for f in ("file", "folder")}
    for name, fmt, drop in LAUNCHED_CASES:
        case = f"{name}-{fmt}-{'drop' if drop else 'migrate'}"
        results = [json.loads((tmp_path / f"{case}-rank{r}.json").read_text()) for r in (0, 1)]
        assert all("error" not in r for r in results), (case, results)
        each = [r["losses"] for r in results if r["losses"]]  # the coordinators': one per replica
        assert len(each) == replicas_of[name], case
        mean = [sum(step) / len(step) for step in zip(*each, strict=True)]  # equal halves of the batch
        want = old["plain"][drop]
        assert mean == pytest.approx(want["losses"], abs=1e-6), case
        written(tmp_path / case, want, case)
        lenient_said(results[0]["said"], drop)


def test_a_folder_hook_sees_every_tensor_unread_and_reads_only_what_it_touches(old: dict) -> None:
    """The folder's state_dict a hook sees: every key, as lazy tensors with their shapes and dtypes; reading one
    reads that one only."""
    from lightning_pipe.checkpoint.resume import Resume

    resume = Resume(old["files"]["folder"])
    try:
        state = resume.for_lightning(1)["state_dict"]
        file = torch.load(old["files"]["file"], weights_only=True)["state_dict"]
        assert state.keys() == file.keys()
        assert all(isinstance(v, LazyTensor) and v.loaded is None for v in state.values())
        assert all(state[k].shape == file[k].shape and state[k].dtype == file[k].dtype for k in file)
        key = next(iter(file))
        torch.testing.assert_close(state[key] * 1, file[key])
        assert [k for k, v in state.items() if v.loaded is not None] == [key]
    finally:
        resume.close()


def test_a_hook_that_renames_keys_moves_no_tensor_to_the_stages(old: dict) -> None:
    """What the stages are told after a rename: names only (no tensor travels); converted values go only to the
    worker that holds them."""
    from torch import nn

    from lightning_pipe.checkpoint.resume import Resume
    from lightning_pipe.weights.stage_init import StageInit

    resume = Resume(old["files"]["file"])
    try:
        state = resume.for_lightning(1)["state_dict"]
        state["model.renamed.weight"] = state.pop("model.legacy.weight")
        resume.edited(state)
        assert resume.edits is not None and resume.edits.given == {}
        assert resume.edits.moved == {"model.renamed.weight": "model.legacy.weight"}
        init = StageInit(path=resume.path, checkpoint=True, prefix="model.", edits=resume.edits)
        first = nn.Sequential(nn.Linear(8, 16))
        given = StageInit(path=resume.path, checkpoint=True, prefix="model.", edits=type(resume.edits)(
            given={"model.0.weight": torch.zeros(16, 8), "model.4.weight": torch.zeros(4, 16)}))  # fmt: skip
        assert set(given.for_shards([first]).edits.given) == {"model.0.weight"}  # type: ignore[union-attr]
        assert init.for_shards([first]) is init
    finally:
        resume.close()
