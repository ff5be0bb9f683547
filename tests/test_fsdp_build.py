"""FSDP builds a stage shard by shard (``PipeStrategy(data_parallel="fsdp")``, launched 2 x 2 on 127.0.0.1, gloo).

The stage is sharded while it is still on meta; each process then makes real only its shard of each parameter:
from the seed (one module whole at a time, cut to the shard), from a sharded folder (only the shard is read)
or from a single file (one tensor whole at a time). `fsdp_build.py` runs the three builds among the launched
runs of tests/test_big_models.py (a launch of their own would cost 4 process starts), where
``test_fsdp_builds_each_stage_shard_by_shard`` compares them with local mode, which builds every stage whole in
one process. Here: what needs no launch.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from helpers import one_thread
from torch import nn

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import PipeError
from lightning_pipe.engine import fsdp_internals


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


def test_fsdp_without_a_second_replica_warns_and_trains_as_a_plain_trainer() -> None:
    """Local mode has one replica of each stage: data_parallel='fsdp' says it shards nothing, and trains as a plain
    Trainer does (the same model, data and SGD steps: parameters equal to 1e-5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    class Net(L.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(module: Net, strategy: PipeStrategy | None) -> None:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, **({"strategy": strategy} if strategy else {}),
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(12, 4, generator=g), torch.randn(12, 2, generator=g))
    piped, plain = Net(model), Net(copy.deepcopy(model))
    before = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match="no stage has a second replica to be sharded over, so nothing is sharded"):
        fit(piped, PipeStrategy(stages=2, microbatches=2, transport="local", data_parallel="fsdp"))
    with one_thread():
        fit(plain, None)
    assert not torch.equal(plain.model[0].weight, before)  # the oracle is not vacuous: 3 steps moved the weights
    for (name, got), want in zip(piped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=name)
