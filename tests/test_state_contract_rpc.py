"""The training-state contract asked of rpc mode (``PipeStrategy(transport="rpc")``), as of the other modes.

- resume from a sharded folder and from a single file equals the uninterrupted run (losses and parameters);
- a key the model has and the checkpoint lacks, or the other way round, raises with its name before any
  stage is built; ``strict_loading = False`` trains and says how many tensors it initialised;
- with the model built on meta (``trainer.init_module(empty_init=True)``), the checkpoints written during
  (``ModelCheckpoint``) and after ``fit`` hold the trained values, equal to local mode's with the same seed,
  and load into a plain model; the script's process never gathers the stages' values or optimizer state
  (the calls that would are made to fail here) and clones no optimizer state on resume;
- a later fit of a module built on meta starts where its rpc fit left it (the workers' folder), as local mode's;
- local mode with several devices: each stage's tensors (and their optimizer state) are its own device's (on a
  machine with only a CPU, one stage on a second device that tests/second_device.py makes of the CPU).

Each rpc fit starts a worker process (seconds on a busy machine), so one fit checks several things.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import second_device
import torch
from helpers import QUIET, Classifier, dataset, loader, mlp
from lightning.pytorch.callbacks import ModelCheckpoint
from processes import leftover_processes
from second_device import in_fresh_process

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.consolidate import consolidate

STEPS, EVERY = 4, 2  # an epoch is 2 batches: the checkpoint at step 2 ends epoch 0


class Momentum(Classifier):
    """SGD with momentum (optimizer state to save and resume); records each step's loss."""

    def __init__(self) -> None:
        super().__init__(mlp())
        self.losses: dict[int, float] = {}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[self.trainer.global_step] = float(outputs["loss"])


class WeightsOnly(L.Callback):
    """``trainer.save_checkpoint(path, weights_only=True)`` after the last step, in the fit."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == STEPS:
            trainer.save_checkpoint(self.path, weights_only=True)


def fit(transport: str, root: Path, ckpt: Path | str | None = None, meta: bool = True, saves: Path | None = None,
        folders: bool = True, strict: bool = True, more: tuple[L.Callback, ...] = ()
        ) -> tuple[L.Trainer, Momentum]:  # fmt: skip
    """A fit of `STEPS` steps in ``root`` (its ``default_root_dir``); ``saves``: a folder for
    ``ModelCheckpoint(every_n_train_steps=EVERY)``."""
    strategy = PipeStrategy(stages=2, microbatches=2, transport=transport, timeout=120,
                            save_distributed_checkpoint=folders)  # fmt: skip
    callbacks = [ModelCheckpoint(dirpath=saves, every_n_train_steps=EVERY, save_top_k=-1)] if saves else []
    callbacks += list(more)
    trainer = L.Trainer(**(QUIET | {"enable_checkpointing": saves is not None}), max_steps=STEPS, strategy=strategy,
                        callbacks=callbacks, default_root_dir=root)  # fmt: skip
    if meta:
        with trainer.init_module(empty_init=True):
            module = Momentum()
    else:
        module = Momentum()
    module.strict_loading = strict
    trainer.fit(module, loader(dataset(rows=32), 16), ckpt_path=ckpt)
    return trainer, module


def one_file(saved: Path, tmp: Path) -> dict[str, Any]:
    """A checkpoint as a plain Trainer reads it (a folder consolidated first)."""
    if saved.is_dir():
        saved = consolidate(saved, tmp / (saved.name + ".one"))
    return torch.load(saved, weights_only=False)


def assert_trained(checkpoint: dict[str, Any], module: Momentum, optimizer: torch.optim.Optimizer) -> None:
    """``checkpoint`` holds ``module``'s values and ``optimizer``'s momentum, and loads into a plain model."""
    plain = Momentum()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: the unsplit keys, all of them
    for (name, got), want in zip(plain.state_dict().items(), module.state_dict().values(), strict=True):
        assert got.device.type == "cpu" and not got.is_meta, name
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)
    saved, wanted = checkpoint["optimizer_states"][0]["state"], optimizer.state_dict()["state"]
    assert sorted(saved) == sorted(wanted)
    for index, state in wanted.items():
        torch.testing.assert_close(saved[index]["momentum_buffer"], state["momentum_buffer"], atol=1e-5, rtol=0)


@pytest.fixture
def nothing_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calls that would bring the stages' values or optimizer state into the script's process fail."""

    def gathers(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the script's process gathered the stages' state")

    monkeypatch.setattr("lightning_pipe.pipeline.optimizers.StageOptimizers.state_dict", gathers)
    monkeypatch.setattr("lightning_pipe.pipeline.pipeline.Pipeline.sync_module", gathers)
    monkeypatch.setattr("lightning_pipe.checkpoint.resume.Resume.optimizer_states", gathers)


@pytest.fixture(autouse=True)
def no_worker_left() -> Iterator[None]:
    yield
    assert leftover_processes() == [], "worker processes left behind"


def test_meta_model_checkpoints_during_and_after_fit_hold_the_trained_values_and_resume(
    tmp_path: Path, nothing_gathered: None
) -> None:
    """One uninterrupted rpc fit saving a folder every 2 steps and after the fit; local mode with the same seed;
    a resume of the rpc run from its step-2 folder writing single files; a later fit of each fitted module: all the
    same values."""
    local_trainer, local = fit("local", tmp_path, saves=tmp_path / "local")
    trainer, piped = fit("rpc", tmp_path, saves=tmp_path / "rpc", more=(WeightsOnly(tmp_path / "weights"),))
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert all(p.is_meta for p in piped.parameters()), "the script's process took no stage's values"
    assert piped.losses == pytest.approx(local.losses, abs=1e-5) and len(piped.losses) == STEPS

    # during the fit: a folder per save, each equal to local mode's single file of that step
    for step in (EVERY, STEPS):
        name = f"epoch={step // EVERY - 1}-step={step}.ckpt"
        assert (tmp_path / "rpc" / name / ".metadata").is_file()
        got = one_file(tmp_path / "rpc" / name, tmp_path)
        want = torch.load(tmp_path / "local" / name, weights_only=False)
        assert got["global_step"] == want["global_step"] == step
        for key, value in want["state_dict"].items():
            torch.testing.assert_close(got["state_dict"][key], value, atol=1e-5, rtol=0, msg=f"step {step}: {key}")
        for index, state in want["optimizer_states"][0]["state"].items():
            torch.testing.assert_close(got["optimizer_states"][0]["state"][index]["momentum_buffer"],
                                       state["momentum_buffer"], atol=1e-5, rtol=0)  # fmt: skip
    weights = one_file(tmp_path / "weights", tmp_path)  # weights_only=True: no optimizer state written
    assert weights["optimizer_states"] == [] and weights["global_step"] == STEPS
    for key, value in local.state_dict().items():
        torch.testing.assert_close(weights["state_dict"][key], value, atol=1e-5, rtol=0, msg=key)
    # after the fit: the trained values (the workers left them before they stopped)
    assert_trained(one_file(tmp_path / "after.ckpt", tmp_path), local, local_trainer.optimizers[0])

    # resume from the step-2 folder, each worker reading its own part; single files written this time
    step_two = tmp_path / "rpc" / f"epoch=0-step={EVERY}.ckpt"
    resumed_trainer, resumed = fit("rpc", tmp_path, step_two, saves=tmp_path / "again", folders=False)
    resumed_trainer.save_checkpoint(tmp_path / "resumed.ckpt")
    assert sorted(resumed.losses) == list(range(EVERY + 1, STEPS + 1))
    assert resumed.losses == pytest.approx({s: piped.losses[s] for s in resumed.losses}, abs=1e-5)
    assert (tmp_path / "again" / f"epoch=1-step={STEPS}.ckpt").is_file()
    assert not list((tmp_path / "again").glob("*.shards")), "the folder a single file is made of is removed"
    for saved in (tmp_path / "again" / f"epoch=1-step={STEPS}.ckpt", tmp_path / "resumed.ckpt"):
        assert saved.is_file()
        assert_trained(torch.load(saved, weights_only=False), local, local_trainer.optimizers[0])

    # a later fit of the fitted module (a new Trainer, a new optimizer) starts where its fit left it, as local mode's
    # does: the script's process holds none of its stages' values; the workers' folder holds them
    for module, transport in ((local, "local"), (piped, "rpc")):
        module.losses = {}
        strategy = PipeStrategy(stages=2, microbatches=2, transport=transport, timeout=120)
        later = L.Trainer(**QUIET, max_steps=EVERY, strategy=strategy, default_root_dir=tmp_path)
        later.fit(module, loader(dataset(rows=32), 16))
    assert piped.losses == pytest.approx(local.losses, abs=1e-5) and len(piped.losses) == EVERY


def test_single_file_resume_and_strict_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain Trainer's checkpoint after step 2, resumed under rpc with an eager model: each worker reads its
    tensors and its optimizer state from the file, and the run equals the plain Trainer's uninterrupted one.
    The same file with a key renamed, or one added, raises with the names before any worker starts; with
    ``strict_loading = False`` the renamed one trains, and the run says what it initialised."""

    def cloned(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the script's process assembled the optimizers' whole state")

    monkeypatch.setattr("lightning_pipe.checkpoint.resume.Resume.optimizer_states", cloned)
    whole = Momentum()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=EVERY, save_top_k=-1)
    plain = L.Trainer(**(QUIET | {"enable_checkpointing": True}), max_steps=STEPS, callbacks=[saver])
    plain.fit(whole, loader(dataset(rows=32), 16))
    saved = tmp_path / f"epoch=0-step={EVERY}.ckpt"

    _, resumed = fit("rpc", tmp_path, saved, meta=False)
    assert resumed.losses == pytest.approx({s: whole.losses[s] for s in range(EVERY + 1, STEPS + 1)}, abs=1e-5)
    for (name, p), q in zip(resumed.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)

    checkpoint = torch.load(saved, weights_only=False)
    renamed, added = tmp_path / "renamed.ckpt", tmp_path / "added.ckpt"
    state = checkpoint["state_dict"]
    torch.save({**checkpoint, "state_dict": {**state, "model.extra.weight": torch.zeros(2)}}, added)
    state["model.renamed.weight"] = state.pop("model.2.weight")
    torch.save(checkpoint, renamed)
    both = r"'model\.2\.weight'.*'model\.renamed\.weight'.*strict_loading = False"
    with pytest.raises(ConfigurationError, match=both):
        fit("rpc", tmp_path, renamed)
    with pytest.raises(ConfigurationError, match=r"'model\.extra\.weight'"):
        fit("rpc", tmp_path, added, meta=False)
    said = r"strict_loading=False.*1 tensor initialised instead of read.*'model\.2\.weight'"
    with pytest.warns(UserWarning, match=said):
        _, lenient = fit("rpc", tmp_path, renamed, strict=False)
    assert sorted(lenient.losses) == [3, 4] and all(torch.isfinite(torch.tensor(list(lenient.losses.values()))))


class StageDevices(L.Callback):
    """After each step: every tensor of a stage, its optimizer state included, is its own device's, and the
    LightningModule's parameters are the stages' own tensors (no copy of them anywhere else)."""

    def __init__(self) -> None:
        self.checked = 0
        self.devices: set[torch.device] = set()  # where the tensors checked are

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        pipeline = trainer.strategy.pipeline  # type: ignore[attr-defined]
        optimizer = trainer.optimizers[0]
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        module_params = {id(p): name for name, p in pl_module.named_parameters()}
        seen: set[str] = set()
        for shard in pipeline.shards:
            device = torch.device(shard.device)
            for name, tensor in [*shard.module.named_parameters(), *shard.module.named_buffers()]:
                assert tensor.device == device, f"stage {shard.index}'s {name} is on {tensor.device}, not {device}"
                self.devices.add(tensor.device)
            for name, param in shard.module.named_parameters():
                assert id(param) in module_params and id(param) in held, f"stage {shard.index}'s {name} was copied"
                seen.add(module_params[id(param)])
                for value in optimizer.state[param].values():
                    if isinstance(value, torch.Tensor) and value.dim():
                        assert value.device == device, f"the optimizer state of {name} is on {value.device}"
        assert seen == set(module_params.values()), "every parameter of the module is a stage's own"
        self.checked += 1


def check_stage_devices(devices: list[str]) -> None:  # also run by tests/second_device.py
    """A local fit of 2 steps on ``devices`` (a model built on meta), checked after each step."""
    strategy = PipeStrategy(stages=2, microbatches=2, devices=devices)
    checks = StageDevices()
    trainer = L.Trainer(**QUIET, max_steps=2, strategy=strategy, callbacks=[checks])
    with trainer.init_module(empty_init=True):
        module = Momentum()
    trainer.fit(module, loader(dataset(rows=32), 16))
    assert checks.checked == 2
    assert checks.devices == {torch.device(d) for d in devices}, "each stage's tensors were checked on its device"


def test_local_stages_hold_their_tensors_on_their_own_devices() -> None:
    """Stage 0 on a second device (tests/second_device.py: the CPU's values under another device's name), stage 1
    on the CPU: a tensor of either on the other's device fails. In a process of its own, where that device exists."""
    in_fresh_process("test_state_contract_rpc:check_stage_devices", [second_device.DEVICE, "cpu"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_local_stages_on_cpu_and_gpu_hold_their_tensors_on_their_own_devices() -> None:
    """Stage 0 on the CPU, stage 1 on the GPU: a tensor of either on the other's device fails."""
    check_stage_devices(["cpu", "cuda:0"])
