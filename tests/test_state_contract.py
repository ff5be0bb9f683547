"""The training-state contract (docs/big-models.md, "Where your model's state lives"), asked of every mode the same way.

Modes: local mode built eagerly and on meta (``init_module(empty_init=True)``), launched mode 1 x 2 (DDP,
built eagerly) and 2 x 1 FSDP (built in ``configure_model``); formats: a single-file checkpoint, a sharded
folder, safetensors ``weights=``. The reference is a plain Trainer (no PipeStrategy) on the same data from the
same model (built eagerly from the seed; for a model built on meta, holding the tensors PipeStrategy's seeded
initialisation gave it, the same in every layout). A run resumed from the checkpoint of PipeStrategy's first 2
steps equals the plain Trainer's uninterrupted run (losses and parameters, 1e-5); a renamed key and an unexpected
key raise before the first step naming them; ``strict_loading = False`` trains and says what it initialised; a
second fit of the same module continues from where the first left it, as a plain Trainer's does. The files come
from a local run (any layout resumes any other); one launch does every case of both launched modes in sequence.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import QUIET, one_thread
from launching import ROOT, forked_ranks
from state_contract import BATCH, EXTRA, PART, RENAMED, STEPS, Losses, Net, fit, make_data, tensors, write_files
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.weights import materialize
from lightning_pipe.weights.keys import KeyMismatchError
from lightning_pipe.weights.sources import MODEL, TorchFileSource

SCRIPT = str(ROOT / "tests" / "state_contract.py")
BUILDS = ["eager", "init_module"]
FORMATS = ["file", "folder", "weights"]


def strategy(**kwargs: Any) -> PipeStrategy:
    return PipeStrategy(stages=2, microbatches=2, **kwargs)


def plain_fit(
    steps: int, start: dict[str, torch.Tensor] | None, net: Net | None = None
) -> tuple[L.Trainer, Net, Losses]:
    """The reference: a plain Trainer (no PipeStrategy) on the same data, ``steps`` steps of the model built eagerly
    from the seed, or holding ``start`` (a model built on meta gets its values from PipeStrategy's seeded
    initialisation, which only PipeStrategy does); ``net``: a module an earlier plain fit trained, fitted again."""
    L.seed_everything(0, verbose=False)
    if net is None:
        net = Net()
        if start is not None:
            net.load_state_dict(start)
    losses = Losses()
    trainer = L.Trainer(max_steps=steps, callbacks=[losses], **QUIET)
    with one_thread():
        trainer.fit(net, DataLoader(make_data(), batch_size=BATCH))
    return trainer, net, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per local build: PipeStrategy's first 2 steps and the files of its checkpoint; the reference, a plain Trainer's
    uninterrupted run from the same model (losses, trained tensors); the model's tensors as the fit started."""
    made: dict[str, dict[str, Any]] = {}
    for build in BUILDS:
        out = tmp_path_factory.mktemp(build)
        t, _, part = fit(strategy(), build, PART)
        t.save_checkpoint(out / "part.ckpt")
        start = part.start if build == "init_module" else None  # eager: the plain model is built from the seed
        plain, _, ref = plain_fit(STEPS, start)
        plain.save_checkpoint(out / "ref.ckpt")
        assert part.values == pytest.approx(ref.values[:PART], abs=1e-5)  # the first 2 steps: PipeStrategy's own
        made[build] = {
            "losses": ref.values,
            "tensors": torch.load(out / "ref.ckpt", weights_only=True)["state_dict"],
            "files": write_files(out / "part.ckpt", out),
            "start": part.start,
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
        start = runs[build]["start"] if build == "init_module" else None
        _, net, _ = plain_fit(PART, start)
        _, _, again = plain_fit(PART, None, net=net)  # a plain Trainer's later fit of the same module
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


class Parts(nn.Module):
    """One tensor of each kind a model holds, each set by ``reset_parameters`` to values that draw nothing, so the
    module built eagerly on the CPU is the reference for the one built on meta and made real by `materialize`:
    a float parameter, float / int64 / uint8 buffers, a causal bool mask and a step counter (both non-persistent).
    ``forget``: the tensor ``reset_parameters`` leaves unset (``count-half``: half of it); ``flags``: the uint8
    buffer's values."""

    def __init__(self, forget: str = "nothing", flags: tuple[int, ...] = (0, 0, 0, 0)) -> None:
        super().__init__()
        self.forget, self.flags_value = forget, flags
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.register_buffer("scale", torch.empty(4))
        self.register_buffer("count", torch.empty(4, dtype=torch.int64))
        self.register_buffer("flags", torch.empty(4, dtype=torch.uint8))  # set to zeros: initialised all the same
        self.register_buffer("mask", torch.empty(4, 4, dtype=torch.bool), persistent=False)
        self.register_buffer("steps", torch.empty((), dtype=torch.long), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        values = {
            "weight": torch.arange(16.0).view(4, 4) / 16, "scale": torch.full((4,), 2.0),
            "count": torch.tensor([7, -3, 5, 11]), "flags": torch.tensor(self.flags_value, dtype=torch.uint8),
            "mask": torch.ones(4, 4, dtype=torch.bool).tril(), "steps": torch.tensor(3),
        }  # fmt: skip
        with torch.no_grad():
            for name, value in values.items():
                if name == self.forget:
                    continue
                if name == "count" and self.forget == "count-half":
                    self.count[:2] = value[:2]
                else:
                    getattr(self, name).copy_(value)


FORGOTTEN = ("weight", "scale", "count", "count-half", "flags", "mask", "steps")


@pytest.mark.parametrize("forget", FORGOTTEN)
def test_a_tensor_its_initialisation_leaves_unwritten_raises_with_its_name(forget: str) -> None:
    """Of every dtype, persistent or not, fully or partly unwritten: materialize raises naming it (the uint8 buffer
    set to values other than zeros here: `test_a_model_built_on_meta_is_made_the_eager_model` has the zeros)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Parts(forget, flags=(1, 0, 2, 0)))
    name = forget.removesuffix("-half")
    with pytest.raises(ConfigurationError, match=rf"1\.{name}\b.* of Parts \(1\)"):
        materialize(model, "cpu", seed=0)


@pytest.mark.parametrize("flags", ["some", "zeros"])
def test_a_model_built_on_meta_is_made_the_eager_model(flags: str) -> None:
    """Every tensor its initialisation writes, whatever its dtype (a uint8 buffer of zeros too), equals the eager
    build's."""
    values = (1, 0, 2, 0) if flags == "some" else (0, 0, 0, 0)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), Parts(flags=values))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Parts(flags=values))
    materialize(model, "cpu", seed=0)
    model[0].load_state_dict(eager[0].state_dict())  # the Linear draws its values: its own seed, not the eager one's
    want = dict(eager.named_buffers()) | dict(eager.named_parameters())
    got = dict(model.named_buffers()) | dict(model.named_parameters())
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


class Table(nn.Module):
    """An embedding table whose reset_parameters writes values that draw nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.copy_(torch.arange(12.0).view(3, 4))


class Head(nn.Module):
    """A head whose weight is tied to a `Table`'s; its reset_parameters writes both its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 4))
        self.bias = nn.Parameter(torch.empty(3))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(-1.0)
            self.bias.fill_(0.5)


def tied() -> nn.Sequential:
    model = nn.Sequential(Table(), Head())
    model[1].weight = model[0].weight  # tied after both were built, as HF's tie_weights does
    return model


def test_a_tied_tensor_is_read_or_initialised_once(tmp_path: Path) -> None:
    """Initialised: the eager model's value (the first module's initialisation; the head's does not write it again).
    Read from a checkpoint holding it (and not the head's bias): the checkpoint's value, the bias initialised."""
    eager = tied()
    with torch.device("meta"):
        model = tied()
    materialize(model, "cpu", seed=0)
    assert model[1].weight is model[0].weight
    torch.testing.assert_close(model[0].weight, eager[0].weight, rtol=0, atol=0)
    torch.testing.assert_close(model[1].bias, eager[1].bias, rtol=0, atol=0)
    saved = torch.full((3, 4), 9.0)
    torch.save({MODEL: {"0.weight": saved}}, tmp_path / "tied.ckpt")
    with torch.device("meta"):
        model = tied()
    materialize(model, "cpu", source=TorchFileSource(tmp_path / "tied.ckpt"), seed=0)
    assert model[1].weight is model[0].weight
    torch.testing.assert_close(model[1].weight, saved, rtol=0, atol=0)
    torch.testing.assert_close(model[1].bias, eager[1].bias, rtol=0, atol=0)


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
