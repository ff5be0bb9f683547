"""Exact restarts (docs/faults.md): a run killed mid-epoch and restarted with ``fit(ckpt_path="last")`` ends equal to
the run that never stopped, in every mode.

The run (`restart_train`): dropout inside the stages, SGD with momentum, a step-wise LR schedule, torchdata's
``StatefulDataLoader`` (shuffled), ``ModelCheckpoint(every_n_train_steps=3, save_last=True)``; it is cut after step 5
(its last checkpoint: step 3, mid-epoch) and resumed from ``last`` to step 10. Local mode: against its uninterrupted
run, and without dropout against a plain Trainer (an independent reference: the stages' streams aside, the same math
and data order); rpc mode: against local mode's uninterrupted run (the same stages, the same streams);
``schedule="auto"``, ``"async"`` and a GradScaler in local mode. One launch of 4 forked processes runs launched DDP
(2 x 2), FSDP (2 x 2) and 3-D (1 x 2 x 2) one after the other, each cut (every coordinator raises, as a lost process
ends the attempt) and resumed in the same processes, against its uninterrupted run. A kill with SIGKILL under
``torchrun --max-restarts`` is ``benchmarks/restarts.py``'s (20 cycles), not a test's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from launching import ROOT, forked_ranks
from restart_train import KILL_AT, STEPS, run

from lightning_pipe.checkpoint.reader import ShardedCheckpoint

SCRIPT = str(ROOT / "tests" / "restart_train.py")
LAUNCHED = ("ddp", "fsdp", "3d")


def result(out: Path, mode: str, attempt: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{mode}-{attempt}-rank{rank}.json").read_text())


def assert_resumed_equal(resumed: dict[str, Any], reference: dict[str, Any], what: str) -> None:
    """The resumed attempt trained from the last checkpoint (step 3) to the end: its losses (where it ran the steps)
    and the trained tensors it holds are the reference's, 1e-6."""
    assert "error" not in resumed, (what, resumed.get("error"))
    if reference["losses"]:  # a process that ran the steps (a serving process ran its stage: its tensors)
        assert resumed["steps"] == STEPS, what
        expected = {k: v for k, v in reference["losses"].items() if int(k) > 3}
        assert resumed["losses"].keys() == expected.keys(), what
        assert list(resumed["losses"].values()) == pytest.approx(list(expected.values()), abs=1e-6, rel=0), what
    assert reference["tensors"], what
    assert resumed["tensors"].keys() == reference["tensors"].keys(), what
    for key, value in reference["tensors"].items():
        torch.testing.assert_close(torch.tensor(resumed["tensors"][key]), torch.tensor(value), rtol=0, atol=1e-6,
                                   msg=f"{what}: {key}")  # fmt: skip


def assert_cut(out: Path, mode: str, rank: int = 0) -> None:
    cut = result(out, mode, "cut", rank)
    assert "killed after step" in cut.get("error", "") and max(map(int, cut["losses"])) == KILL_AT, cut.get("error")


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Local mode's uninterrupted run (the reference of local and rpc mode)."""
    out = tmp_path_factory.mktemp("local")
    run("local", "ref", out, 1, None)
    return out


def test_local_mode_resumed_mid_epoch_equals_the_uninterrupted_run(local: Path) -> None:
    run("local", "cut", local, 1, "raise")
    run("local", "resume", local, 1, None)
    assert_cut(local, "local")
    assert_resumed_equal(result(local, "local", "resume"), result(local, "local", "ref"), "local")
    said = result(local, "local", "resume")["said"]
    assert not [s for s in said if "keeps no position" in s], said  # a StatefulDataLoader: nothing to say


def test_schedule_async_resumes_with_every_update_of_the_batches_before_the_checkpoint(tmp_path: Path) -> None:
    """``schedule="async"``: a stream of batches ends where ModelCheckpoint writes (step 3), so the checkpoint holds
    every update before it and the stages' generator states, and the resumed run goes on as the uninterrupted one
    (before, a checkpoint mid-stream missed the updates in flight: 0.057 off after 10 steps)."""
    for attempt, kill in (("ref", None), ("cut", "raise"), ("resume", None)):
        run("local-async", attempt, tmp_path, 1, kill)
    ref, resumed = result(tmp_path, "local-async", "ref"), result(tmp_path, "local-async", "resume")
    assert not [s for s in ref["said"] + resumed["said"] if "in the middle of a stream" in s]
    meta = torch.load(tmp_path / "local-async-ckpt" / "epoch=0-step=3.ckpt", weights_only=False)["lightning_pipe"]
    assert sorted(meta["random_state"]["stages"]) == [0, 1]
    assert_resumed_equal(resumed, ref, "async")


def test_a_grad_scaler_resumes_where_it_was(tmp_path: Path) -> None:
    """``"16-mixed"`` with a GradScaler whose scale grows every 2 steps: the checkpoint holds its state, and the
    resumed run ends with the uninterrupted run's scale and model."""
    for attempt, kill in (("ref", None), ("cut", "raise"), ("resume", None)):
        run("local-fp16", attempt, tmp_path, 1, kill)
    ref, resumed = result(tmp_path, "local-fp16", "ref"), result(tmp_path, "local-fp16", "resume")
    saved = torch.load(tmp_path / "local-fp16-ckpt" / "epoch=0-step=3.ckpt", weights_only=False)["MixedPrecision"]
    assert saved["scale"] != 2.0**8 and ref["scaler"]["scale"] != saved["scale"], (saved, ref["scaler"])  # it grew
    assert resumed["scaler"] == ref["scaler"]
    assert_resumed_equal(resumed, ref, "16-mixed")


def test_schedule_auto_resumes_with_the_choice_the_checkpoint_holds(tmp_path: Path) -> None:
    """``schedule="auto"`` (and ``microbatches="auto"``) measures in step 1 and chooses before step 2; the checkpoint
    of step 3 holds the choice, and the resumed run runs it from its first step instead of measuring again. Measured
    again it can choose otherwise (two runs here chose 2 and 8 microbatches): so the reference is the killed run
    itself, whose steps 4 and 5 the resumed run repeats to 1e-6."""
    run("local-auto", "cut", tmp_path, 1, "raise")
    run("local-auto", "resume", tmp_path, 1, None)
    cut, resumed = result(tmp_path, "local-auto", "cut"), result(tmp_path, "local-auto", "resume")
    assert cut["chosen"] is not None and cut["resumed"] is None
    meta = torch.load(tmp_path / "local-auto-ckpt" / "epoch=0-step=3.ckpt", weights_only=False)["lightning_pipe"]
    assert meta["schedule"] == cut["chosen"] and {"random_state", "schedule"} <= meta.keys(), meta
    assert resumed["resumed"] == cut["chosen"] and resumed["chosen"] == cut["chosen"]
    assert "error" not in resumed and resumed["steps"] == STEPS
    repeated = [resumed["losses"][str(step)] for step in (4, 5)]
    assert repeated == pytest.approx([cut["losses"][str(step)] for step in (4, 5)], abs=1e-6, rel=0)


def test_local_mode_resumed_equals_a_plain_trainer(tmp_path: Path) -> None:
    """Without dropout (a plain Trainer draws its masks from torch's global generator, which Lightning's checkpoint
    does not restore: its own restart is not exact with dropout), local mode cut and resumed ends where the plain
    Trainer's uninterrupted run ends."""
    run("plain", "ref", tmp_path, 1, None, dropout=0.0)
    run("local", "cut", tmp_path, 1, "raise", dropout=0.0)
    run("local", "resume", tmp_path, 1, None, dropout=0.0)
    assert_resumed_equal(result(tmp_path, "local", "resume"), result(tmp_path, "plain", "ref"), "local vs plain")


@pytest.mark.slow
def test_rpc_mode_resumed_mid_epoch_equals_the_uninterrupted_run(local: Path) -> None:
    run("rpc", "cut", local, 1, "raise")
    run("rpc", "resume", local, 1, None)
    assert_cut(local, "rpc")
    assert_resumed_equal(result(local, "rpc", "resume"), result(local, "local", "ref"), "rpc vs local")


def test_a_loader_without_a_position_says_once_at_resume_that_the_epoch_starts_over(tmp_path: Path) -> None:
    run("local", "cut", tmp_path, 1, "raise", loader="plain")
    run("local", "resume", tmp_path, 1, None, loader="plain")
    said = [s for s in result(tmp_path, "local", "resume")["said"] if "keeps no position" in s]
    assert len(said) == 1, said
    assert "epoch 0 (after batch 3)" in said[0] and "starts over from its first batch" in said[0]
    assert "StatefulDataLoader" in said[0]
    assert not [s for s in result(tmp_path, "local", "cut")["said"] if "keeps no position" in s]  # a fresh run: no


@pytest.mark.slow
def test_launched_ddp_fsdp_and_3d_resumed_mid_epoch_equal_their_uninterrupted_runs(tmp_path: Path) -> None:
    """One launch of 4 processes: DDP 2 x 2, FSDP 2 x 2, 3-D 1 x 2 x 2, each uninterrupted, cut and resumed."""
    run_ = forked_ranks(SCRIPT, ["--modes", ",".join(LAUNCHED), "--out", str(tmp_path)], nproc=4, timeout=400)
    assert run_.ok, run_.output[-3000:]
    for mode in LAUNCHED:
        for rank in range(4):
            if result(tmp_path, mode, "ref", rank)["losses"]:  # a coordinator: it ran the steps
                assert_cut(tmp_path, mode, rank)
            else:  # a serving process: its coordinator's failure ended its fit
                assert "failed" in result(tmp_path, mode, "cut", rank).get("error", "")
            what = f"{mode} rank {rank}"
            assert_resumed_equal(result(tmp_path, mode, "resume", rank), result(tmp_path, mode, "ref", rank), what)
        check_what_the_checkpoint_holds(tmp_path / f"{mode}-ckpt" / "last.ckpt", mode)


def check_what_the_checkpoint_holds(folder: Path, mode: str) -> None:
    """``last`` (written at step 9 of the resumed attempt) holds what a restart needs besides the tensors: the
    stages' generator states (each process's part holds its own stages'), the LR scheduler, the loader's position (its
    sampler's too), the loops' progress."""
    meta = ShardedCheckpoint(folder, weights_only=False).lightning_state()
    streams = meta["lightning_pipe"]["random_state"]
    assert sorted(streams["stages"]) == [0, 1], mode  # both stages' generators
    assert meta["lr_schedulers"][0]["last_epoch"] == 9, mode
    position = meta["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert position["_num_yielded"] == 3 and "sampler_state" in position["_sampler_iter_state"], (mode, position)
    assert meta["global_step"] == 9, mode
