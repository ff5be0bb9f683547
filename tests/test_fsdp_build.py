"""FSDP builds a stage shard by shard (``PipeStrategy(data_parallel="fsdp")``, launched 2 x 2 on 127.0.0.1, gloo).

The stage is sharded while it is still on meta; each process then makes real only its shard of each parameter:
from the seed (one module whole at a time, cut to the shard), from a sharded folder (only the shard is read)
or from a single file (one tensor whole at a time). One launch (`fsdp_build.py`) runs the three builds; here
they are compared with local mode, which builds every stage whole in one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from launching import ROOT, lightning_launch
from torch import nn

from lightning_pipe import PipeStrategy
from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.engine import fsdp_internals
from lightning_pipe.errors import PipeError

SCRIPT = str(ROOT / "tests" / "fsdp_build.py")
sys.path.insert(0, str(ROOT / "examples"))
import fsdp_build  # noqa: E402 - the launched script, for its model, data and sizes
from big_model import Big, Record  # noqa: E402


def _reports(out: Path, case: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in range(4)]


def _state(path: Path, out: Path) -> dict[str, torch.Tensor]:
    one = consolidate(path, out) if path.is_dir() else path
    return dict(torch.load(one, weights_only=True)["state_dict"])


def _local(epochs: int, ckpt_path: Path | None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Local mode (every stage whole, threads of this process): the same model, data and seed as fsdp_build.py."""
    L.seed_everything(0, verbose=False)
    record = Record(None, 0)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, callbacks=[record], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=PipeStrategy(stages=2, microbatches=2, transport="local"),
    )  # fmt: skip
    with trainer.init_module(empty_init=True):
        model = Big(fsdp_build.WIDTH, fsdp_build.DEPTH, "meta", "adam")
    loader = torch.utils.data.DataLoader(fsdp_build.data(), batch_size=fsdp_build.ROWS)
    trainer.fit(model, loader, ckpt_path=str(ckpt_path) if ckpt_path is not None else None)
    return {f"model.{k}": v.detach().clone() for k, v in model.model.state_dict().items()}, record.losses


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_fsdp_builds_each_stage_shard_by_shard(tmp_path: Path) -> None:
    """Built from the seed, from a sharded folder and from a single file, every process holds exactly its shard
    of its stage (a DTensor per parameter, half of each, nothing else of the model real) and never held more
    than one module of it whole; the seeded model equals local mode's; both resumes train as local mode does."""
    run = lightning_launch(SCRIPT, ["--out", str(tmp_path)], timeout=600)
    assert run.ok, run.output[-6000:]
    width = fsdp_build.WIDTH
    module_bytes = (width * width + width) * 4  # one Linear's weight and bias: the largest module
    tensor_bytes = width * width * 4  # its weight: the largest tensor
    stage_bytes = fsdp_build.DEPTH // 2 * module_bytes
    for case in ("seeded", "folder", "file"):
        for rank, report in enumerate(_reports(tmp_path, case)):
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
    initial, _ = _local(0, None)
    seeded = _state(tmp_path / "seeded", tmp_path / "seeded-one.ckpt")
    assert _max_diff(seeded, initial) == 0.0
    # resumed from the sharded folder or the file: local mode's steps (the replicas' mean loss is the global one)
    trained, local_losses = _local(2, tmp_path / "seeded")
    for case in ("folder", "file"):
        replicas = [r["losses"] for r in _reports(tmp_path, case) if r["losses"]]
        assert len(replicas) == 2
        mean = [sum(step) / 2 for step in zip(*replicas, strict=True)]
        assert mean == pytest.approx(local_losses, rel=1e-5), f"{case}: {mean} != {local_losses}"
    assert _max_diff(_state(tmp_path / "folder", tmp_path / "folder-one.ckpt"), trained) < 1e-5


def test_fsdp_internals_fail_loudly_naming_torch_and_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `fsdp_internals` reads of FSDP2's private state is checked before it is read: a torch that moved it
    fails with the torch version and this file's name, not an AttributeError inside a step."""
    with pytest.raises(PipeError, match="not a module sharded with fully_shard"):
        fsdp_internals.check(nn.Linear(2, 2))
    from torch.distributed.fsdp import fully_shard

    class Moved:  # an FSDP state whose context torch renamed
        pass

    monkeypatch.setattr(fully_shard, "state", lambda module: Moved())
    with pytest.raises(fsdp_internals.FsdpInternalsChanged, match=r"torch .* changed the FSDP2 internals") as error:
        fsdp_internals.post_backward(nn.Linear(2, 2))
    assert "_state_ctx" in str(error.value) and "fsdp_internals.py" in str(error.value)


def test_fsdp_without_a_second_replica_warns_and_trains_whole_stages() -> None:
    """Local mode has one replica of each stage: data_parallel='fsdp' says it shards nothing, and trains."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=PipeStrategy(stages=2, microbatches=2, transport="local", data_parallel="fsdp"),
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(4, 4), torch.randn(4, 2))
    before = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match="no stage has a second replica to be sharded over, so nothing is sharded"):
        trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
    assert not torch.equal(model[0].weight, before)  # trained
