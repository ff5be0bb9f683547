"""The training-state contract (docs/big-models.md, "Where your model's state lives"), asked of every mode the same way.

Modes: local mode built eagerly and on meta (``init_module(empty_init=True)``), launched mode 1 x 2 (DDP,
built eagerly) and 2 x 1 FSDP (built in ``configure_model``); formats: a single-file checkpoint, a sharded
folder, safetensors ``weights=``. A run resumed from the checkpoint of the uninterrupted run's first 2 steps
equals it (losses and parameters, 1e-5); a renamed key and an unexpected key raise before the first step
naming them; ``strict_loading = False`` trains and says what it initialised; a second fit of the same module
continues from where the first left it, as local mode's does. The files come from a local run
(any layout resumes any other); one launch does every case of both launched modes in sequence.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from launching import ROOT, forked_ranks
from state_contract import EXTRA, PART, RENAMED, STEPS, fit, tensors, write_files
from torch import nn

from lightning_pipe import PipeStrategy
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.weights import materialize
from lightning_pipe.weights.keys import KeyMismatchError

SCRIPT = str(ROOT / "tests" / "state_contract.py")
BUILDS = ["eager", "init_module"]
FORMATS = ["file", "folder", "weights"]


def strategy(**kwargs: Any) -> PipeStrategy:
    return PipeStrategy(stages=2, microbatches=2, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per local build: the uninterrupted run (losses, trained tensors) and the files of its first 2 steps."""
    made: dict[str, dict[str, Any]] = {}
    for build in BUILDS:
        out = tmp_path_factory.mktemp(build)
        t, _, ref = fit(strategy(), build, STEPS)
        t.save_checkpoint(out / "ref.ckpt")
        t, _, _ = fit(strategy(), build, PART)
        t.save_checkpoint(out / "part.ckpt")
        made[build] = {
            "losses": ref.values,
            "tensors": tensors(out / "ref.ckpt"),
            "files": write_files(out / "part.ckpt", out),
        }
    return made


def resume(build: str, fmt: str, kind: str, steps: int = STEPS, **kwargs: Any) -> Any:
    files = kwargs.pop("files")
    if fmt == "weights":  # pretrained weights: the model's tensors, a new optimizer; one step from them
        return fit(strategy(weights=files[f"weights-{kind}"]), build, 1, **kwargs)
    return fit(strategy(), build, steps, ckpt=files[f"{fmt}-{kind}"], **kwargs)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("build", BUILDS)
def test_local_resume_equals_the_uninterrupted_run(runs: dict, build: str, fmt: str, tmp_path: Path) -> None:
    ref = runs[build]
    t, _, losses = resume(build, fmt, "good", files=ref["files"])
    if fmt == "weights":  # the first step's loss is the read model's; it starts as the checkpoint's tensors
        assert losses.values == pytest.approx(ref["losses"][PART : PART + 1], abs=1e-5)
        close({f"model.{k}": v for k, v in tensors_of(ref["files"]["file-good"]).items()}, losses.start)
        return
    assert losses.values == pytest.approx(ref["losses"][PART:], abs=1e-5)
    t.save_checkpoint(tmp_path / "resumed.ckpt")
    close(tensors(tmp_path / "resumed.ckpt"), ref["tensors"])


def tensors_of(path: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in tensors(path).items()}


@pytest.mark.parametrize("kind", ["renamed", "extra"])
@pytest.mark.parametrize("build", BUILDS)
def test_local_mismatched_keys_raise_before_the_first_step_naming_them(runs: dict, build: str, kind: str) -> None:
    for fmt in FORMATS:
        with pytest.raises(KeyMismatchError) as raised:
            resume(build, fmt, kind, files=runs[build]["files"])
        said = str(raised.value)
        prefix = "" if fmt == "weights" else "model."
        names = [RENAMED[0], RENAMED[1]] if kind == "renamed" else [EXTRA]
        for name in names:
            assert repr(prefix + name.removeprefix("model.")) in said, (fmt, said)
        assert "strict_loading = False" in said


@pytest.mark.parametrize("build", BUILDS)
def test_local_strict_loading_false_trains_and_says_what_it_initialised(runs: dict, build: str) -> None:
    files = runs[build]["files"]
    for fmt in FORMATS:
        t, _, losses = resume(build, fmt, "renamed", steps=PART + 1, files=files, strict=False)
        said = [s for s in t.said if s.startswith("strict_loading=False")]
        assert len(said) == 1 and "1 tensor initialised instead of read" in said[0], (fmt, t.said)
        assert "2.weight" in said[0] and len(losses.values) == 1
        part = tensors_of(files["file-good"])
        assert not torch.equal(losses.start["model.2.weight"], part["2.weight"])  # not read: it was renamed
        torch.testing.assert_close(losses.start["model.4.weight"], part["4.weight"])  # the others were read


@pytest.mark.slow
def test_launched_modes_keep_the_contract(runs: dict, tmp_path: Path) -> None:
    """DDP 1 x 2 built eagerly and FSDP 2 x 1 built in configure_model: one launch of 2 processes doing every case
    of DDP's, then every case of FSDP's."""
    modes = {"ddp": "eager", "fsdp": "init_module"}
    args: list[str] = []
    for mode, build in modes.items():
        out = tmp_path / mode
        out.mkdir()
        (out / "files.json").write_text(json.dumps(runs[build]["files"]))
        args += ["--mode", mode, "--files", str(out / "files.json"), "--out", str(out)]
    run = forked_ranks(SCRIPT, args, nproc=2, timeout=400)
    assert run.ok, run.output[-3000:]
    for mode, build in modes.items():
        _, net, _ = fit(strategy(), build, PART)
        _, _, again = fit(strategy(), build, PART, net=net)  # local mode: a later fit of the same module
        check_launched(mode, tmp_path / mode, runs[build] | {"again": again.values})


def check_launched(mode: str, out: Path, ref: dict[str, Any]) -> None:
    def result(case: str, rank: int = 0) -> dict[str, Any]:
        return json.loads((out / f"{case}-rank{rank}.json").read_text())

    ranks = [0, 1]

    def losses(case: str) -> list[float]:  # the global batch's: the mean of the replicas' (equal halves)
        each = [result(case, rank)["losses"] for rank in ranks if result(case, rank)["losses"]]
        return [sum(step) / len(step) for step in zip(*each, strict=True)]

    # the same seed, the same model in every layout: the launched run equals the local one
    assert losses("ref") == pytest.approx(ref["losses"], abs=1e-5)
    close(tensors(out / "ref"), ref["tensors"])
    for fmt in ("file", "folder"):
        assert losses(f"resume-{fmt}") == pytest.approx(ref["losses"][PART:], abs=1e-5)
        close(tensors(out / f"resume-{fmt}"), ref["tensors"])
    assert losses("resume-weights") == pytest.approx(ref["losses"][PART : PART + 1], abs=1e-5)
    assert losses("again") == pytest.approx(ref["again"], abs=1e-5)  # fitted again from where its first fit left it
    for fmt in FORMATS:
        for kind, name in (("renamed", RENAMED[1]), ("extra", EXTRA)):
            key = name.removeprefix("model.") if fmt == "weights" else name
            for rank in ranks:  # every process fails, each naming the key
                error = result(f"{fmt}-{kind}", rank).get("error", "")
                assert "KeyMismatchError" in error and repr(key) in error, (mode, fmt, kind, rank, error)
    for case, what in (("lenient-file", "1 tensor initialised instead of read"), ("lenient-weights", "ignored")):
        said = [s for s in result(case, 0)["said"] if s.startswith("strict_loading=False")]
        assert len(said) == 1 and what in said[0], (mode, case, said)
        assert all("error" not in result(case, rank) for rank in ranks)
    if mode == "fsdp":  # no seed_everything, each process seeded differently: the model is rank 0's seed's
        check_unseeded(out)


def check_unseeded(out: Path) -> None:
    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.manual_seed(100)
    t, _, _ = fit(strategy(), "init_module", 1, seed=None)
    t.save_checkpoint(out / "unseeded-local.ckpt")
    close(tensors(out / "unseeded"), tensors(out / "unseeded-local.ckpt"))


class Scaled(nn.Module):
    """A module whose reset_parameters forgets one of its tensors (``forget``)."""

    def __init__(self, forget: str) -> None:
        super().__init__()
        self.forget = forget
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.scale = nn.Parameter(torch.empty(4))
        self.register_buffer("steps", torch.empty((), dtype=torch.long), persistent=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.forget != "scale":
            nn.init.ones_(self.scale)
        if self.forget != "steps":
            self.steps.zero_()


@pytest.mark.parametrize("forget", ["scale", "steps"])  # a parameter; a non-persistent buffer
def test_a_tensor_its_initialisation_leaves_empty_raises_with_its_name(forget: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled(forget))
    with pytest.raises(ConfigurationError, match=rf"1\.{forget} of Scaled \(1\) still hold uninitialised memory"):
        materialize(model, "cpu", seed=0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled("nothing"))
    materialize(model, "cpu", seed=0)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


class Loose(dict):  # type: ignore[type-arg]
    """A state dict of a class of its own: torch.load(weights_only=True) refuses to unpickle it."""


def test_a_file_that_needs_weights_only_false_is_opened_only_when_allowed(runs: dict, tmp_path: Path) -> None:
    path = tmp_path / "loose.pt"
    torch.save(Loose(tensors_of(runs["eager"]["files"]["file-good"])), path)
    with pytest.raises(ConfigurationError, match=r"weights_only=False") as raised:
        fit(strategy(weights=str(path)), "init_module", 1)
    assert "PipeStrategy(weights=..., weights_only=False)" in str(raised.value)
    assert isinstance(raised.value.__cause__, pickle.UnpicklingError)
    _, _, losses = fit(strategy(weights=str(path), weights_only=False), "init_module", 1)
    assert losses.values == pytest.approx(runs["eager"]["losses"][PART : PART + 1], abs=1e-5)


def test_a_path_this_process_cannot_see_fails_naming_it_and_the_host(tmp_path: Path) -> None:
    missing = tmp_path / "not-here.ckpt"
    with pytest.raises(ConfigurationError) as raised:
        fit(strategy(weights=str(missing)), "init_module", 1)
    assert str(missing) in str(raised.value) and socket.gethostname() in str(raised.value)
    with pytest.raises(ConfigurationError) as raised:
        fit(strategy(), "init_module", 1, ckpt=str(missing))
    assert str(missing) in str(raised.value) and "all share" in str(raised.value)


def test_optimizer_state_that_does_not_match_raises(runs: dict, tmp_path: Path) -> None:
    checkpoint = torch.load(runs["init_module"]["files"]["file-good"], weights_only=True)
    del checkpoint["optimizer_states"]
    torch.save(checkpoint, tmp_path / "weights-only.ckpt")
    with pytest.raises(KeyError, match="contains only the model"):  # Lightning's own words
        fit(strategy(), "init_module", STEPS, ckpt=str(tmp_path / "weights-only.ckpt"))
    checkpoint = torch.load(runs["init_module"]["files"]["file-good"], weights_only=True)
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    groups.append({**groups[0], "params": groups[0]["params"][4:]})
    groups[0]["params"] = groups[0]["params"][:4]
    torch.save(checkpoint, tmp_path / "two-groups.ckpt")
    with pytest.raises(ValueError, match="different number of parameter groups"):
        fit(strategy(), "init_module", STEPS, ckpt=str(tmp_path / "two-groups.ckpt"))
