"""The 3-D example, ``examples/llama_3d.py``: a Llama-style model trained as replicas x stages x tensor ranks.

``examples/llama_3d.py --devices 8`` (8 processes: 2 replicas x 2 stages x 2 tensor ranks over gloo, started as
torchrun starts them, forked after one import: `launching.forked_ranks`, as are the other runs here: their subject is
the run, not the launcher, which tests/test_launched.py covers), at the tiny size for 2 AdamW steps:
the module's ``configure_model`` is Lightning's TP x FSDP recipe (``fully_shard`` of each block, then of the whole
model), which PipeStrategy applies per stage; every coordinator's loss is the plain model's on the global batch (one
process, in this test's process) to 1e-5, and each process holds 1/(R x S x T) of the parameters, their gradients
and the optimizer state. The same module under Lightning's ``ModelParallelStrategy`` gives the same losses; on CUDA
(NCCL, one GPU a process) the run is the CUDA test below.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launching import ROOT, forked_ranks, lightning_launch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

EXAMPLE = str(ROOT / "examples" / "llama_3d.py")
STEPS = ["--max-steps", "2"]


def reports(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]


def plain_losses(*args: str) -> list[float]:
    """The example's plain run (one process, the whole model, the same global batches), in this process."""
    from llama_3d import main

    return main(["--strategy", "plain", *STEPS, *args])["losses"]  # type: ignore[no-any-return]


def check_coordinators(got: list[dict[str, Any]], coordinators: list[int], expected: list[float]) -> None:
    """The processes that run Lightning's loop are ``coordinators``; each printed the global batch's loss of every
    step (logged with ``sync_dist``), finite and equal to ``expected`` to 1e-5."""
    assert [r["rank"] for r in got if r["losses"]] == coordinators
    for report in got:
        if report["losses"]:
            assert all(math.isfinite(v) for v in report["losses"]), report
            assert len(report["losses"]) == len(expected), report
            diff = max(abs(a - b) for a, b in zip(report["losses"], expected, strict=True))
            assert diff < 1e-5, f"rank {report['rank']}: {report['losses']} != {expected}"


@pytest.mark.slow
def test_a_head_tied_to_the_embedding_across_processes_trains_as_the_plain_model(tmp_path: Path) -> None:
    """``--tie-embeddings --devices 2 --tensor-parallel 1``: the embedding (stage 0) and the head (stage 1) are one
    parameter of the module, held by two processes; the copies get the sum of their gradients, so the losses of 3
    AdamW steps are the plain tied model's (the second and third check the updates)."""
    from dataclasses import replace

    from llama_3d import SIZES, Llama

    model = Llama(replace(SIZES["tiny"], tie_embeddings=True))
    assert model[0].weight is model[-1].weight
    steps = ["--max-steps", "3", "--tie-embeddings"]
    args = ["--devices", "2", "--tensor-parallel", "1", *steps, "--report", str(tmp_path)]
    run = forked_ranks(EXAMPLE, args, nproc=2, timeout=600)
    assert run.ok, run.output[-6000:]
    from llama_3d import main

    check_coordinators(reports(tmp_path), [0], main(["--strategy", "plain", *steps])["losses"])


@pytest.mark.slow
def test_lightnings_tp_x_fsdp_recipe_trains_unchanged_2x2x2_as_the_plain_model(tmp_path: Path) -> None:
    """8 processes = 2 replicas x 2 stages x 2 tensor ranks, 1f1b, the module sharding itself with ``fully_shard``
    over ``self.device_mesh["data_parallel"]`` (each block, then the whole model) under the default
    ``data_parallel="ddp"``: PipeStrategy applies each block's unit in the stage holding it and the whole model's
    as each stage's root, over its 2 replicas (DDP and ``data_parallel="fsdp"`` per stage at 2 x 2 x 2 are
    tests/test_tensor_parallel.py's): the coordinators (the first two ranks of each replica, one per tensor rank) log
    the plain model's losses over 2 AdamW steps; after them a process holds an eighth, 1/(R x S x T), of the
    parameters, of their gradients and of the optimizer state (AdamW's two moments, and its step counters)."""
    args = ["--devices", "8", *STEPS, "--report", str(tmp_path)]
    run = forked_ranks(EXAMPLE, args, nproc=8, timeout=600)
    assert run.ok, run.output[-6000:]
    assert "launched mode, 8 processes = 2 replica(s) x 2 pipeline rank(s) x 2 tensor rank(s)" in run.output
    assert "configure_model sharded the model with fully_shard: PipeStrategy shards each stage over its 2" in run.output
    got = reports(tmp_path)
    assert [r["rank"] for r in got] == list(range(8))
    expected = plain_losses()
    assert expected[1] < expected[0]  # it learns, and the second step checks the first update too
    check_coordinators(got, [0, 1, 4, 5], expected)
    for rank in (0, 1, 4, 5):
        assert f"rank {rank} step 2 loss {expected[1]:.4f}" in run.output  # printed as the module docstring says
    for report in got:  # 0.125 each, a little more where a shard is padded to divide evenly
        whole = report["parameter_bytes"]
        parameters, gradients = report["held_parameter_bytes"] / whole, report["held_gradient_bytes"] / whole
        optimizer = report["held_optimizer_bytes"] / (2 * whole)
        assert all(0.12 < share < 0.135 for share in (parameters, gradients, optimizer)), report


@pytest.mark.slow
def test_model_parallel_strategy_runs_the_same_module_with_the_same_losses(tmp_path: Path) -> None:
    """``--strategy model-parallel --devices 4``: Lightning's ModelParallelStrategy(data_parallel_size=2,
    tensor_parallel_size=2), the module sharding itself with fully_shard over the data dimension, as it does under
    PipeStrategy; every rank runs the loop and logs the plain model's losses."""
    args = ["--devices", "4", "--strategy", "model-parallel", *STEPS, "--report", str(tmp_path)]
    run = forked_ranks(EXAMPLE, args, nproc=4, timeout=600)
    assert run.ok, run.output[-6000:]
    check_coordinators(reports(tmp_path), [0, 1, 2, 3], plain_losses())


@pytest.mark.cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 4,
    reason=f"needs 4 CUDA GPUs (NCCL between processes needs one GPU each; found {torch.cuda.device_count()})",
)
def test_the_example_on_gpus_over_nccl(tmp_path: Path) -> None:
    """2 x 2 x 2 on 8 GPUs (1 x 2 x 2 on 4 to 7): each process on its own GPU, over NCCL; the losses are the plain
    model's on one GPU (to 1e-4: other reduction orders on the GPU)."""
    devices = 8 if torch.cuda.device_count() >= 8 else 4
    args = ["--accelerator", "gpu", "--devices", str(devices), *STEPS, "--report", str(tmp_path)]
    run = lightning_launch(EXAMPLE, args, timeout=600)
    assert run.ok, run.output[-6000:]
    replicas = devices // 4
    assert f"launched mode, {devices} processes = {replicas} replica(s) x 2 pipeline rank(s) x 2 tensor rank(s)" in (
        run.output
    )
    expected = plain_losses("--accelerator", "gpu")
    got = reports(tmp_path)
    assert [r["rank"] for r in got if r["losses"]] == [r * 4 + t for r in range(replicas) for t in range(2)]
    for report in got:
        if report["losses"]:
            assert len(report["losses"]) == len(expected), report
            for a, b in zip(report["losses"], expected, strict=True):
                assert math.isfinite(a) and abs(a - b) < 1e-4 * abs(b), (report, expected)
        assert report.get("cuda_peak_mib", 0) > 0, report  # its stage ran on its GPU
