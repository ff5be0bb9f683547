"""Every tensor of a model built on meta accounted for, whatever its dtype (docs/big-models.md, "Where your model's
state lives", line 2): judged by what initialisation wrote, not by the values it left; a tied tensor made once.

The model (tests/init_accounting.py) has a causal ``bool`` mask made in ``__init__`` (non-persistent, its layer's
``reset_parameters()`` sets only its weight), an ``int64`` buffer of positions, a ``uint8`` buffer set to zeros and
an embedding tied to the head in another stage. References: the model built eagerly (the buffers' values), a plain
Trainer from the same initial tensors (the losses), the checkpoint file and a plain Trainer resuming it (the tied
weight). Local mode here; launched mode (1 x 2) in one launch of 2 forked processes doing every case.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from init_accounting import Net, fit, make_model, strategy
from launching import ROOT, forked_ranks
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.weights import materialize
from lightning_pipe.weights.tied import first_holders
from lightning_pipe.weights.written import Writes

SCRIPT = str(ROOT / "tests" / "init_accounting.py")
TIED = ("model.0.tokens.weight", "model.2.weight")
BUFFERS = ("model.0.positions", "model.0.dropped", "model.1.mask")


def test_writes_are_counted_by_element_whatever_the_dtype_or_value() -> None:
    half, zeros = torch.empty(6, dtype=torch.int64), torch.empty(4, dtype=torch.uint8)
    mask, floats, out = torch.empty(3, 3, dtype=torch.bool), torch.empty(2, 2), torch.empty(5)
    assigned = nn.Parameter(torch.empty(3))
    with Writes([half, zeros, mask, floats, out, assigned]) as writes, torch.no_grad():
        half[::2].fill_(torch.iinfo(torch.int64).min)  # the value an old check took for "never written"
        zeros.zero_()
        mask.t()[0].copy_(torch.tensor([True, False, True]))  # one column, through a transposed view
        floats.view(torch.int32)[0].fill_(0)  # another dtype of the same size: the first row
        floats.view(-1).view(torch.uint8)[8:12].fill_(1)  # another size: the third element's 4 bytes
        floats.view(-1).view(torch.uint8)[12:14].fill_(1)  # half of the fourth's: not written in full
        torch.add(torch.ones(5), 1, out=out)
        assigned.data = torch.ones(3)  # other memory: what was assigned is the value
    assert writes.written(half) == 3 and writes.written(zeros) == 4 and writes.written(mask) == 3
    assert writes.written(floats) == 3 and writes.written(out) == 5 and writes.written(assigned) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain Trainer's checkpoint of the model after one step, without the head's bias (another head's); beside
    it the same with the optimizer's learning rate 0 (``lr0-no-bias.ckpt``: a step leaves the tensors read)."""
    out = tmp_path_factory.mktemp("plain")
    t, _, _ = fit("auto", 1, meta=False)
    t.save_checkpoint(out / "plain.ckpt")
    saved = torch.load(out / "plain.ckpt", weights_only=True)
    del saved["state_dict"]["model.2.bias"]
    torch.save(saved, out / "no-bias.ckpt")
    saved["optimizer_states"][0]["param_groups"][0]["lr"] = 0.0
    torch.save(saved, out / "lr0-no-bias.ckpt")
    return out / "no-bias.ckpt"


def file_tensor(path: Path, key: str) -> torch.Tensor:
    return torch.load(path, weights_only=True)["state_dict"][key]


@pytest.mark.parametrize(
    "broken, key, said",
    [("mask", "1.mask", "1.mask (bool buffer, none of its 36 elements written)"),
     ("positions", "0.positions", "0.positions (int64 buffer, 3 of its 6 elements written)")],
)  # fmt: skip
def test_local_a_tensor_initialisation_leaves_unwritten_raises_naming_it(broken: str, key: str, said: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        fit(strategy(), 1, broken)
    assert said in str(raised.value) and "reset_parameters() set every element" in str(raised.value)


class Masked(nn.Module):
    """A causal mask made in ``__init__`` and no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(3, 3, dtype=torch.bool)), persistent=False)


def test_a_mask_of_a_module_without_reset_parameters_raises_naming_it() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Masked())
    with pytest.raises(ConfigurationError, match=r"1\.mask of Masked \(1\) have no values .* a reset_parameters"):
        materialize(model, "cpu")


def test_local_every_tensor_initialised_trains_as_a_plain_trainer() -> None:
    _, _, piped = fit(strategy(), 3)
    eager = dict(Net().named_buffers())
    for key in BUFFERS:  # the uint8 buffer set to zeros is initialised; every buffer as the eager model holds it
        assert torch.equal(piped.tensors[key], eager[key]), key
    assert piped.tied and torch.equal(piped.tensors[TIED[0]], piped.tensors[TIED[1]])
    _, _, plain = fit("auto", 3, meta=False, start=piped.tensors)
    assert piped.losses == pytest.approx(plain.losses, rel=1e-6)


def test_local_a_tied_weight_keeps_the_checkpoint_value(checkpoint: Path) -> None:
    _, _, piped = fit(strategy(), 2, ckpt=str(checkpoint), strict=False)  # the head's bias is initialised
    _, _, plain = fit("auto", 2, meta=False, ckpt=str(checkpoint), strict=False)
    saved = file_tensor(checkpoint, TIED[0])
    assert piped.tied
    for key in TIED:
        assert torch.equal(piped.tensors[key], saved) and torch.equal(plain.tensors[key], saved), key


def test_a_tied_tensor_is_initialised_once_as_its_first_holder_does_in_any_cut() -> None:
    with torch.device("meta"):
        whole, untied = make_model(), make_model()
    untied[2].weight = nn.Parameter(torch.empty(untied[2].weight.shape, device="meta"))
    materialize(whole, "cpu", seed=3)
    materialize(untied, "cpu", seed=3)
    assert whole[0].tokens.weight is whole[2].weight  # one tensor still
    assert torch.equal(whole[0].tokens.weight, untied[0].tokens.weight)  # the embedding's own initialisation
    with torch.device("meta"):
        model = make_model()
    firsts = first_holders(model)
    last = nn.Sequential()
    last.add_module("2", model[2])  # a stage holding the head but not the embedding, made first
    materialize(last, "cpu", seed=3, firsts=firsts)
    first = nn.Sequential()
    first.add_module("0", model[0])
    materialize(first, "cpu", seed=3, firsts=firsts)  # another process's: made apart
    assert model[0].tokens.weight is not model[2].weight
    assert torch.equal(model[2].weight, whole[2].weight) and torch.equal(model[0].tokens.weight, whole[2].weight)
    assert torch.equal(model[2].bias, whole[2].bias)  # the head's initialisation wrote its bias only, in any cut


@pytest.mark.slow
def test_launched_every_tensor_accounted_for(checkpoint: Path, tmp_path: Path) -> None:
    """1 x 2, one launch of 2 forked processes doing every case (each process: its stage's tensors)."""
    lr0 = checkpoint.with_name(f"lr0-{checkpoint.name}")
    run = forked_ranks(SCRIPT, ["--out", str(tmp_path), "--ckpt", str(lr0)], nproc=2, timeout=300)
    assert run.ok, run.output[-3000:]

    def result(case: str, rank: int) -> dict[str, Any]:
        return json.loads((tmp_path / f"{case}-rank{rank}.json").read_text())

    def tensors(case: str, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(tmp_path / f"{case}-rank{rank}.pt", weights_only=True)

    for case, said in (("mask", "1.mask (bool buffer, none of its 36"), ("positions", "0.positions (int64 buffer, 3")):
        for rank in (0, 1):  # every process fails, naming the tensor
            error = result(case, rank).get("error", "")
            assert "ConfigurationError" in error and said in error, (case, rank, error)
    eager = dict(Net().named_buffers())
    good = [tensors("good", rank) for rank in (0, 1)]
    for key in BUFFERS:  # each in the process of its stage, as the eager model holds it
        assert [torch.equal(held[key], eager[key]) for held in good if key in held] == [True], key
    embedding, head = (next(held[key] for held in good if key in held) for key in TIED)
    assert sum(TIED[0] in held for held in good) == sum(TIED[1] in held for held in good) == 1
    assert torch.equal(embedding, head)  # a copy in each process, one value: as the embedding initialised it
    _, _, local = fit(strategy(), 1, lr=0.0)
    assert torch.equal(embedding, local.tensors[TIED[0]])  # the same seed, the same model as in local mode
    saved = file_tensor(checkpoint, TIED[0])
    resumed = [tensors("tied", rank) for rank in (0, 1)]
    for key in TIED:  # each process read its copy, and the head's initialisation of its bias left it
        assert [torch.equal(held[key], saved) for held in resumed if key in held] == [True], key
