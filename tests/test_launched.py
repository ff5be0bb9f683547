"""Launched mode end to end: 4 real processes on 127.0.0.1 (gloo), started the three ways users start them.

Lightning's launcher and torchrun start their own launches; SLURM's variables, the 2-process schedules' runs and the
run that loses a rank are given to processes forked after one import (`launching.forked_ranks`: their subject is the
run, not the launcher).

Each launch trains several cases (layouts R x P, optimizers, schedules, accumulation and clipping) in
the same processes; the coordinators save what they trained, and here it must equal the unsplit
model trained on the global batch (to 1e-5), on every replica. A checkpoint written under 2 x 2
resumes under 1 x 4 and under local mode, and consolidated into one file it loads into a plain Trainer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from launched_train import DROPOUT, GLOBAL_BATCH, STEPS, Net, make_data, make_model, masked_mse, parse_case
from launching import ROOT, Run, forked_ranks, lightning_launch, torchrun
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipe import PipeStrategy
from lightning_pipe.checkpoint.consolidate import consolidate

SCRIPT = str(ROOT / "tests" / "launched_train.py")
pytestmark = pytest.mark.slow


def shuffled(rows: int, epoch: int) -> list[int]:
    """The global order of Lightning's distributed sampler in an epoch (it shuffles training data, seeded by
    ``seed_everything``); replica r reads every R-th index of it, so a step's R batches are its next R x b rows."""
    sampler = DistributedSampler(range(rows), num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def in_order(rows: int, epoch: int) -> list[int]:
    return list(range(rows))


def reference(name: str, steps: int = STEPS, orders: tuple[Any, ...] = (shuffled, shuffled)) -> dict[str, torch.Tensor]:
    """The unsplit model trained on the global batches as Lightning would (accumulation, clipping);
    ``orders[e]`` gives the rows of epoch ``e`` in the order they are read."""
    case = parse_case(name)
    torch.manual_seed(0)
    model = make_model(DROPOUT if case["dropout"] else 0.0, case["gelu"]).eval()  # a dropout case: without its masks
    if case["optimizer"] == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_data(STEPS * case["accumulate"]).tensors
    batches = STEPS * case["accumulate"]
    batch = 0
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(case["accumulate"]):
            epoch, index = divmod(batch, batches)
            rows = orders[epoch](len(x), epoch)[index * GLOBAL_BATCH : (index + 1) * GLOBAL_BATCH]
            loss = masked_mse if case["masked"] else F.mse_loss
            (loss(model(x[rows]), y[rows]) / case["accumulate"]).backward()
            batch += 1
        if case["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        optimizer.step()
    return model.state_dict()


def check_trained(
    out: Path, name: str, coordinators: list[int], steps: int = STEPS, expected: dict[str, torch.Tensor] | None = None
) -> None:
    """Each replica's processes (its coordinator's block of ranks) together hold the trained model, each its
    own stage; put together, it equals the unsplit model (or ``expected``)."""
    expected = reference(name, steps) if expected is None else expected
    stages = parse_case(name)["stages"]
    for rank in coordinators:
        got: dict[str, torch.Tensor] = {}
        for member in range(rank, rank + stages):
            own = torch.load(out / f"{name}-rank{member}.pt")
            assert not got.keys() & own.keys() or stages == 1, f"{name}: ranks of one replica share tensors"
            got.update(own)
        assert got.keys() == expected.keys()
        for key in expected:
            diff = (got[key] - expected[key]).abs().max().item()
            assert diff < 1e-5, f"{name}: {key} of rank {rank} differs from the unsplit model by {diff:.2e}"


def local_run(name: str) -> dict[str, torch.Tensor]:
    """A one-replica case trained in local mode on the rows in the launched run's order. With dropout the oracle is
    the pipeline itself: each stage draws from generators seeded by the run's seed and its index, wherever it runs."""
    case = parse_case(name)
    L.seed_everything(0, verbose=False)
    model = Net(case["optimizer"], dropout=DROPOUT if case["dropout"] else 0.0)
    strategy = PipeStrategy(
        stages=case["stages"] * case["virtual"], virtual_stages=case["virtual"], microbatches=case["microbatches"],
        schedule=case["schedule"], checkpoint="always" if case["dropout"] else "auto", transport="local",
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = make_data(STEPS)
    trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH, sampler=shuffled(len(data), 0)))
    return {k: v.detach().clone() for k, v in model.model.state_dict().items()}


def coordinators(name: str, processes: int = 4) -> list[int]:
    stages = parse_case(name)["stages"]
    return list(range(0, processes, stages))


def assert_ok(run: Run) -> None:
    assert run.ok, f"launch failed ({run.returncodes}):\n{run.output[-6000:]}"


LIGHTNING_CASES = ["s2-sgd-gpipe", "s2-adam-1f1b-acc2-clip", "s4-sgd-1f1b", "s1-adam-gpipe", "s2-adam-1f1b-save"]
CHECKPOINT = "s2-adam-1f1b-save.ckpt"  # written by the 2 x 2 case "save", resumed in the torchrun launch


@pytest.fixture(scope="module")
def lightning_launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    """``python train.py``, devices=4, every case of LIGHTNING_CASES in one launch."""
    out = tmp_path_factory.mktemp("lightning")
    run = lightning_launch(SCRIPT, ["--devices", "4", "--cases", ",".join(LIGHTNING_CASES), "--out", str(out)])
    assert_ok(run)
    return out, run


def test_lightning_launcher_trains_like_the_unsplit_model_on_the_global_batch(
    lightning_launched: tuple[Path, Run],
) -> None:
    """``python train.py``, devices=4: 2 x 2 (gpipe SGD; 1f1b Adam, accumulation 2, clipping), 1 x 4, 4 x 1."""
    out, run = lightning_launched
    for name in LIGHTNING_CASES:
        check_trained(out, name, coordinators(name))
    info = json.loads((out / "s2-sgd-gpipe.json").read_text())
    assert info["replicas"] == 2 and info["world_size"] == 4
    assert info["socket"], "a pipeline of two processes of one machine links them by a socket of their own"
    assert "launched mode, 4 processes = 2 replica(s) x 2 pipeline rank(s)" in run.output
    assert sorted(p.name for p in out.glob("done-*")) == [f"done-rank{r}" for r in range(4)]
    # the 2 x 2 checkpoint (resumed under 1 x 4 by the torchrun launch): under local mode, and by a plain Trainer
    checkpoint = out / CHECKPOINT
    assert checkpoint.is_dir()  # a sharded folder: each process wrote its own stage
    single = consolidate(checkpoint, out / "consolidated.ckpt")  # what a plain Trainer reads
    expected = reference("s2-adam-1f1b", STEPS + 1, (shuffled, in_order))  # no distributed sampler in one process
    for strategy, path in ((PipeStrategy(stages=2, microbatches=2, transport="local"), checkpoint), ("auto", single)):
        L.seed_everything(0, verbose=False)
        model = Net("adam")
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS + 1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, DataLoader(make_data(STEPS), batch_size=GLOBAL_BATCH), ckpt_path=str(path))
        for key, value in model.model.state_dict().items():
            assert (value - expected[key]).abs().max().item() < 1e-5, f"{strategy}: {key}"


def test_torchrun_trains_1x4_and_2x2(lightning_launched: tuple[Path, Run], tmp_path: Path) -> None:
    """Also schedule="auto" on 2 x 2 (both replicas run the first coordinator's choice, the same exact step), zbv:
    each process holds two stages of a V, each replicated with DDP; and the Lightning launcher's 2 x 2 checkpoint
    resumed under 1 x 4 for one more step."""
    cases = ["s4-adam-gpipe", "s2-sgd-1f1b", "s2-sgd-auto", "s2-adam-zbv-v2-m4", "s4-adam-1f1b-resume"]
    checkpoint = lightning_launched[0] / CHECKPOINT
    args = ["--devices", "4", "--cases", ",".join(cases), "--resume", str(checkpoint), "--out", str(tmp_path)]
    run = torchrun(SCRIPT, args, timeout=400)
    assert_ok(run)
    for name in cases[:-1]:
        check_trained(tmp_path, name, coordinators(name))
    check_trained(tmp_path, "s4-adam-1f1b-resume", [0], steps=STEPS + 1)
    assert run.output.count("schedule='auto' chose") == 1  # logged once, by global rank 0


def test_two_processes_run_the_v_shaped_interleaved_and_breadth_first_schedules(tmp_path: Path) -> None:
    """One pipeline of 2 processes, 2 stages each: zbv and dualpipev in a V (stages 0 and 3 in rank 0),
    interleaved-zero-bubble and looped-bfs looped; microbatches 2p and 4p; SGD and Adam; a loss averaged over
    the labelled rows only (microbatches weighted by them, some with none); dropout under recomputation draws
    in the processes what the same pipeline draws in local mode; schedule="auto" built in the V (its stages stay
    in their processes: it chooses among the V's schedules and says so)."""
    cases = ["s2-sgd-zbv-v2-m4-tok", "s2-adam-dualpipev-v2-m8", "s2-adam-interleaved_zero_bubble-v2-m8-tok",
             "s2-sgd-looped_bfs-v2-m4", "s2-adam-auto-v2-m4"]  # fmt: skip
    dropout = "s2-sgd-dualpipev-v2-m4-drop"
    args = ["--devices", "2", "--cases", ",".join([*cases, dropout]), "--out", str(tmp_path)]
    run = forked_ranks(SCRIPT, args, nproc=2)
    assert_ok(run)
    for name in cases:
        check_trained(tmp_path, name, coordinators(name, processes=2))
    assert "(placement 'v') with 4 microbatches" in run.output, run.output[-6000:]
    assert "schedules placed 'loop' are predicted, not candidates: the stages own their parameters" in run.output
    local = local_run(dropout)
    check_trained(tmp_path, dropout, [0], expected=local)
    unsplit = reference(dropout)  # the oracle is not vacuous: the masks changed the training
    assert max((local[k] - unsplit[k]).abs().max().item() for k in unsplit) > 1e-3


def test_two_slurm_nodes_simulated_on_one_machine(tmp_path: Path) -> None:
    """num_nodes=2, devices=2 under SLURM's variables: a pipeline per node (2 x 2), then plain DDP (4 x 1)."""
    cases = ["s2-adam-1f1b", "s1-sgd-gpipe"]
    args = ["--devices", "2", "--num-nodes", "2", "--cases", ",".join(cases), "--out", str(tmp_path)]
    run = forked_ranks(SCRIPT, args, nproc=2, nodes=2, cluster="slurm")
    assert_ok(run)
    for name in cases:
        check_trained(tmp_path, name, coordinators(name))


@pytest.mark.timed
def test_a_sigkilled_rank_ends_every_process_with_an_error_naming_it(tmp_path: Path) -> None:
    """Global rank 3 (stage 0 of replica 1) dies mid-step; the whole run ends within 30 s. No launcher ends the
    others (`forked_ranks`' ``on_failure="wait"``): each process ends by itself, with the error."""
    args = ["--devices", "4", "--cases", "s2-sgd-1f1b", "--out", str(tmp_path), "--kill-rank", "3", "--kill-call", "3"]
    run = forked_ranks(SCRIPT, args, nproc=4, timeout=120, on_failure="wait")
    assert not run.ok
    killed = float((tmp_path / "killed-at").read_text())
    assert run.ended - killed < 30, run.output[-4000:]
    assert "lost global rank 3 (pipeline rank 0 of replica 1)" in run.output, run.output[-6000:]
    assert not list(tmp_path.glob("done-*"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: NCCL point to point between stages")
def test_two_gpus_train_a_pipeline_over_nccl(tmp_path: Path) -> None:
    """The same code path on CUDA: 1 x 2 over NCCL, then 2 x 1 (plain DDP on the stage module)."""
    cases = ["s2-sgd-1f1b", "s1-adam-gpipe"]
    args = ["--accelerator", "gpu", "--devices", "2", "--cases", ",".join(cases), "--out", str(tmp_path)]
    assert_ok(lightning_launch(SCRIPT, args))
    for name in cases:
        check_trained(tmp_path, name, coordinators(name, processes=2))
