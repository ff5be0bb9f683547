"""A checkpoint is published at its path only once complete, and ``async_checkpoint=True`` writes it in the background.

The uninterrupted run is a plain Trainer's (no PipeStrategy): the model of `state_contract` (SGD with momentum,
one batch per epoch) trained 4 steps. A save that fails or is killed in the middle leaves ``last.ckpt`` as the
complete checkpoint before it, and ``fit(ckpt_path="last")`` resumes from that one to the uninterrupted run's end:
local mode (Lightning's file, a writer failing half way), and launched mode 1 x 2 (a sharded folder, the serving
process SIGKILLed in the background write, after its part's files and before DCP finished the folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from launching import ROOT, forked_ranks
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from state_contract import BATCH, PART, QUIET, STEPS, Net, make_data, tensors
from torch.utils.data import DataLoader

from lightning_pipe import PipeStrategy
from lightning_pipe.checkpoint.background import BackgroundWrites, CheckpointWriteError
from lightning_pipe.checkpoint.publish import publish, temporary_path

SCRIPT = str(ROOT / "tests" / "killed_save.py")


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.values.append(float(outputs["loss"]))


def fit(strategy: Any, folder: Path | None, steps: int = STEPS, ckpt: str | None = None, **kwargs: Any) -> Any:
    """A fit of `state_contract.Net` (seed 0); ``folder``: ModelCheckpoint's, ``last.ckpt`` after every step."""
    L.seed_everything(0, verbose=False)
    losses = Losses()
    callbacks: list[Any] = [losses]
    if folder is not None:
        callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=0, save_last=True))
    options = {**QUIET, "enable_checkpointing": folder is not None, **kwargs}
    trainer = L.Trainer(strategy=strategy, max_steps=steps, callbacks=callbacks, **options)
    trainer.fit(Net(), DataLoader(make_data(), batch_size=BATCH), ckpt_path=ckpt)
    return trainer, losses.values


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run, a plain Trainer's: its losses and its trained tensors."""
    out = tmp_path_factory.mktemp("plain")
    trainer, losses = fit("auto", None)
    trainer.save_checkpoint(out / "plain.ckpt")
    return {"losses": losses, "tensors": tensors(out / "plain.ckpt")}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5, msg=key)


def step_of(path: Path) -> int:
    """The global step a checkpoint (a file or a sharded folder) was written at."""
    file = path / "meta.pt" if path.is_dir() else path
    return int(torch.load(file, weights_only=False)["global_step"])


def resume_from_last(folder: Path, plain: dict[str, Any], tmp_path: Path, resumed_at: int) -> None:
    """``fit(ckpt_path="last")`` in local mode finds ``folder``'s last.ckpt (written at step ``resumed_at``) and
    ends equal to the plain run."""
    trainer, losses = fit(PipeStrategy(stages=2, microbatches=2), folder, ckpt="last")
    assert Path(trainer.ckpt_path) == folder / "last.ckpt"
    assert losses == pytest.approx(plain["losses"][resumed_at:], abs=1e-5)
    trainer.save_checkpoint(tmp_path / "resumed.ckpt")
    close(tensors(tmp_path / "resumed.ckpt"), plain["tensors"])


def test_publish_replaces_files_and_folders_in_one_step(tmp_path: Path) -> None:
    for old, new in (("file", "file"), ("folder", "folder"), ("file", "folder"), ("folder", "file"), (None, "folder")):
        final = tmp_path / f"{old}-{new}.ckpt"
        for what, path in ((old, final), (new, temporary_path(final))):
            if what == "file":
                path.write_text(str(path))
            elif what == "folder":
                path.mkdir()
                (path / "part").write_text(str(path))
        publish(temporary_path(final), final)
        written = (final / "part") if new == "folder" else final
        assert written.read_text() == str(temporary_path(final)), (old, new)
        assert not temporary_path(final).exists()
        assert {p.name for p in tmp_path.iterdir() if p.name.startswith(f".{final.name}")} == set()
    # ModelCheckpoint never takes a temporary name for a checkpoint (ckpt_path="last" reads its list)
    assert temporary_path(tmp_path / "last.ckpt").suffix != ".ckpt"


def test_steps_after_a_failed_write_do_not_run_and_its_error_is_raised_at_the_next_wait(tmp_path: Path) -> None:
    writes = BackgroundWrites()
    ran: list[str] = []

    def fails() -> None:
        raise OSError("disk full")

    writes.run(fails, tmp_path / "a.ckpt")
    writes.then(lambda: ran.append("publish"))
    writes.then(lambda: ran.append("remove the previous one"))
    with pytest.raises(CheckpointWriteError, match=r"a\.ckpt failed: OSError: disk full"):
        writes.wait()
    assert ran == []
    writes.run(lambda: ran.append("write"), tmp_path / "b.ckpt")
    writes.then(lambda: ran.append("publish"))
    writes.wait()
    assert ran == ["write", "publish"]


def test_background_sharded_saves_hold_the_state_at_each_save_while_training_goes_on(tmp_path: Path) -> None:
    """Three saves of one process's part through `BackgroundWrites` as launched mode makes them: the coordinator
    expects the write and queues its publish before the stage begins it; the copy is made in a thread into the kept
    buffers (reused by every save after the first). After each save a forward updates a buffer at once (the save
    copied it, `hold`), the optimizer step waits for the copy (`staged`) and changes the parameter and its momentum
    in place while the write may still run: each folder holds the state at its save, as torch.save of a clone then
    holds it, with the stage's generator states, and is published after its write."""
    from torch.distributed.checkpoint import load

    from lightning_pipe.checkpoint.reader import IN_PARTS, OURS, ShardedCheckpoint, optimizer_key
    from lightning_pipe.checkpoint.sharded import OptimizerPart
    from lightning_pipe.weights.sources import MODEL

    torch.manual_seed(0)
    weight, momentum, buffer = torch.randn(64, 32), torch.randn(64, 32), torch.zeros(32)
    generator = torch.Generator().manual_seed(1)
    writes, expected, published = BackgroundWrites(), [], []
    meta = {OURS: {"random_state": {"stages": IN_PARTS}}}
    try:
        for save in range(3):
            folder = tmp_path / str(save)
            folder.mkdir()
            expected.append((weight.clone(), momentum.clone(), buffer.clone(), generator.get_state()))
            writes.expect(folder)  # the coordinator: the save is posted to the stage
            writes.then(lambda folder=folder: published.append((folder, (folder / ".metadata").exists())))
            writes.before_save()  # the stage: the write it fulfils is not waited for
            part = OptimizerPart({"w": {"momentum_buffer": momentum}})
            model = {"w": weight, **writes.hold({"b": buffer})}
            writes.save_sharded(folder, model, [part], meta, {0: {"cpu": generator.get_state()}})
            buffer.add_(1.0), torch.rand(3, generator=generator)  # the next forward, at once
            writes.staged()  # the next optimizer step waits for the copy, then changes the tensors in place
            weight.add_(1.0), momentum.mul_(0.5)
            writes.wait()
    finally:
        writes.release()
    assert published == [(tmp_path / str(save), True) for save in range(3)]
    for save, (w, m, b, state) in enumerate(expected):
        read = {MODEL: {"w": torch.zeros_like(w), "b": torch.zeros_like(b)},
                optimizer_key(0): {"state": {"w": {"momentum_buffer": m * 0}}}}  # fmt: skip
        load(read, checkpoint_id=tmp_path / str(save))
        assert torch.equal(read[MODEL]["w"], w), save
        assert torch.equal(read[MODEL]["b"], b), save
        assert torch.equal(read[optimizer_key(0)]["state"]["w"]["momentum_buffer"], m), save
        random = ShardedCheckpoint(tmp_path / str(save)).lightning_state()[OURS]["random_state"]
        assert torch.equal(random["stages"][0]["cpu"], state), save


class FailingIO(TorchCheckpointIO):
    """Writes half of the ``fail_at``-th checkpoint's bytes, then fails (a process that dies while it writes)."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.saves = fail_at, 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saves += 1
        if self.saves == self.fail_at:
            Path(path).write_bytes(b"PK\x03\x04 half a checkpoint")
            raise OSError("the writer died half way")
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_local_a_failed_save_leaves_last_at_the_complete_one_before_it(
    plain: dict[str, Any], tmp_path: Path, asynchronous: bool
) -> None:
    folder = tmp_path / "checkpoints"
    strategy = PipeStrategy(stages=2, microbatches=2, async_checkpoint=asynchronous, checkpoint_io=FailingIO(PART + 1))
    raised = CheckpointWriteError if asynchronous else OSError  # in the background: raised at the next save
    with pytest.raises(raised, match="the writer died half way"):
        fit(strategy, folder)
    assert step_of(folder / "last.ckpt") == PART
    assert temporary_path(folder / "last.ckpt").exists()  # the half-written one, under its temporary name
    resume_from_last(folder, plain, tmp_path, PART)


def test_local_async_checkpoints_equal_the_plain_runs_and_the_last_is_written_when_fit_returns(
    plain: dict[str, Any], tmp_path: Path
) -> None:
    folder = tmp_path / "checkpoints"
    _, losses = fit(PipeStrategy(stages=2, microbatches=2, async_checkpoint=True), folder)
    assert losses == pytest.approx(plain["losses"], abs=1e-5)
    assert sorted(os.listdir(folder)) == ["last.ckpt"] and step_of(folder / "last.ckpt") == STEPS
    close(tensors(folder / "last.ckpt"), plain["tensors"])


@pytest.mark.slow
def test_launched_async_checkpoints_and_a_process_killed_in_a_background_write(
    plain: dict[str, Any], tmp_path: Path
) -> None:
    """One launch of 2 processes (1 x 2): an async run, then a run whose serving process dies in its third save."""
    run = forked_ranks(SCRIPT, [str(tmp_path)], nproc=2, timeout=200)
    assert not run.ok, "the second run's rank 1 was killed: the launch fails"
    found = json.loads((tmp_path / "async-rank0.json").read_text())
    assert found == {"metadata": True, "global_step": STEPS, "left": ["last.ckpt"]}, run.output[-3000:]
    close(tensors(tmp_path / "async" / "last.ckpt"), plain["tensors"])  # the background writes hold the trained state
    killed = tmp_path / "killed"
    partial = temporary_path(killed / "last.ckpt")
    assert partial.is_dir() and not (partial / ".metadata").exists(), run.output[-3000:]  # killed mid-save
    assert step_of(killed / "last.ckpt") == PART
    resume_from_last(killed, plain, tmp_path, PART)
