"""Where a stage's tensors come from: meta models made real per stage, sources read by key, sharded checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launching import base_env, free_port, run_all
from torch import nn

from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.checkpoint.consolidate import consolidate
from lightning_pipe.checkpoint.reader import open_checkpoint
from lightning_pipe.checkpoint.single_file import pending_like, save_in_parts
from lightning_pipe.engine.stage_shards import blocks
from lightning_pipe.weights import (
    Prefixed,
    adopt,
    aliases_of,
    free_to_meta,
    materialize,
    on_meta,
    open_source,
)

HERE = Path(__file__).resolve().parent


def meta_mlp() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.BatchNorm1d(8))


def cut(model: nn.Sequential, bounds: list[int]) -> list[nn.Sequential]:
    named = list(model.named_children())
    shards = []
    for start, stop in zip([0, *bounds], [*bounds, len(named)], strict=True):
        shard = nn.Sequential()
        for name, layer in named[start:stop]:
            shard.add_module(name, layer)
        shards.append(shard)
    return shards


def test_the_same_seed_initialises_the_same_model_however_it_is_cut() -> None:
    whole = meta_mlp()
    materialize(whole, "cpu", seed=7)
    for bounds in ([2], [1, 3], [4]):
        model = meta_mlp()
        for shard in reversed(cut(model, bounds)):  # the order stages are made in does not matter either
            materialize(shard, "cpu", seed=7)
        assert not on_meta(model)
        for (name, a), b in zip(whole.state_dict().items(), model.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
    other = meta_mlp()
    materialize(other, "cpu", seed=8)
    assert not torch.equal(other[0].weight, whole[0].weight)


def test_a_stage_reads_its_tensors_from_a_lightning_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trained = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.BatchNorm1d(8))
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in trained.state_dict().items()}, "epoch": 1}, path)
    model = meta_mlp()
    last = cut(model, [3])[1]
    done = materialize(last, "cpu", Prefixed(open_source(path), "model."))
    assert sorted(done.loaded) == sorted(last.state_dict()) and not done.initialized
    assert on_meta(model[0]) and torch.equal(model[3].weight, trained[3].weight)
    assert torch.equal(model[4].running_mean, trained[4].running_mean)


def test_a_missing_tensor_without_reset_parameters_names_the_module_and_the_fix() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = nn.Sequential(Scale())
    with pytest.raises(ConfigurationError, match=r"0\.gain of Scale .* reset_parameters"):
        materialize(model, "cpu")


def test_free_to_meta_keeps_a_stage_and_adopt_binds_a_sent_stage_to_this_process() -> None:
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    sent = cut(meta_mlp(), [1])[0]  # what another process cut and sent: layer "0" of another model
    stage = nn.Sequential()
    stage.add_module("1", nn.Linear(4, 4, device="meta"))
    adopt(stage, local)
    assert stage[0] is local[1]
    before = {id(p) for p in [*local[0].parameters(), *local[2].parameters()]}
    replaced = free_to_meta(local, list(stage.parameters()))
    assert set(replaced) == before and all(t.is_meta for t in replaced.values())
    assert local[0].weight.is_meta and local[2].weight.is_meta and not local[1].weight.is_meta
    assert sent[0].weight.is_meta


def test_hf_weights_in_sharded_safetensors_load_per_stage_with_tied_names(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    pretrained = transformers.GPT2LMHeadModel(config)
    pretrained.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    aliases = aliases_of(model)
    assert aliases["lm_head.weight"] == ["transformer.wte.weight"]  # saved once, under the embedding's name
    source = open_source(tmp_path / "hf")
    head = nn.Module()
    head.add_module("lm_head", model.lm_head)  # a last stage holding only the output head
    done = materialize(head, "cpu", source, aliases=aliases, init_owner=model)
    assert done.loaded == ["lm_head.weight"] and model.transformer.h[0].attn.c_attn.weight.is_meta
    assert torch.equal(model.lm_head.weight, pretrained.lm_head.weight)
    materialize(model, "cpu", source, aliases=aliases, init_owner=model)
    for (name, a), b in zip(pretrained.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with torch.device("meta"):
        fresh = transformers.GPT2LMHeadModel(config)
    done = materialize(fresh, "cpu", None, seed=1, init_owner=fresh)  # HF's own initialisation, seeded
    assert abs(float(fresh.transformer.h[0].attn.c_attn.weight.detach().std()) - config.initializer_range) < 0.005


def test_a_single_file_written_part_by_part_loads_as_torch_saved(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state, saved = model.state_dict(), optimizer.state_dict()
    checkpoint = {
        "epoch": 2,
        "state_dict": {f"model.{k}": pending_like(int(k[0]), k, v) for k, v in state.items()},
        "optimizer_states": [
            {
                "state": {
                    i: {n: pending_like(2, (i, n), t) if t.dim() else t for n, t in s.items()}
                    for i, s in saved["state"].items()
                },  # fmt: skip
                "param_groups": saved["param_groups"],
            }
        ],
    }
    fetched: list[int] = []

    def part(index: int, values: dict) -> tuple[int, object]:
        return index, lambda: (fetched.append(index), values)[1]

    path = tmp_path / "parts.ckpt"
    save_in_parts(checkpoint, path, [
        part(0, {k: v for k, v in state.items() if k.startswith("0")}),
        part(1, {k: v for k, v in state.items() if k.startswith("1")}),
        part(2, {(i, n): t for i, s in saved["state"].items() for n, t in s.items()}),
    ])  # fmt: skip
    assert fetched == [0, 1, 2]
    loaded = torch.load(path, weights_only=True)
    assert loaded["epoch"] == 2
    plain = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    plain.load_state_dict({k[len("model.") :]: v for k, v in loaded["state_dict"].items()}, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(), strict=True))
    again = torch.optim.Adam(plain.parameters())
    again.load_state_dict(loaded["optimizer_states"][0])
    assert torch.equal(again.state_dict()["state"][3]["exp_avg_sq"], saved["state"][3]["exp_avg_sq"])


def test_repeated_blocks_are_the_fsdp_units() -> None:
    stage = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert blocks(stage) == [stage[0], stage[2]]
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    with torch.device("meta"):
        gpt = transformers.GPT2LMHeadModel(config)
    assert blocks(gpt) == list(gpt.transformer.h)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """One launch of `weights_procs.py` (an FSDP step, then its sharded checkpoint) for the two tests below:
    its folder and each rank's results."""
    out = tmp_path_factory.mktemp("fsdp")
    env = base_env() | {"MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    # its 2 processes forked after one import (tests/forked_processes.py), each writing its output to a log
    processes = [[str(out / f"rank{r}.log"), str(r), "2", str(out)] for r in range(2)]
    spec = {"script": str(HERE / "weights_procs.py"), "timeout": 110, "processes": processes, "all_succeed": True}
    (out / "processes.json").write_text(json.dumps(spec))
    run = run_all([([sys.executable, str(HERE / "forked_processes.py"), str(out / "processes.json")], env)], 120)
    logs = "".join(f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text()[-2000:]}" for r in range(2))
    assert run.ok, run.output[-2000:] + logs
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_fsdp_reduces_a_pipelined_steps_gradients_once(two_processes: tuple[Path, list[dict]]) -> None:
    _, results = two_processes
    from weights_procs import data, model

    x, y = data(2)
    reference = model()
    ((reference(x) - y) ** 2).mean().backward()
    for name, p in reference.named_parameters():
        for result in results:
            assert torch.allclose(result["grads"][name], p.grad, atol=1e-6), name


@pytest.mark.slow
def test_a_sharded_checkpoint_is_read_by_key_and_consolidates_to_one_file(
    two_processes: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    folder, results = two_processes
    result = results[0]
    reader = open_checkpoint(folder / "ckpt")
    model = reader.model("model.")
    assert sorted(model.keys()) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert torch.equal(model.get("2.weight"), result["params"]["model.2.weight"])
    state = reader.optimizer_state(0, "model.4.weight")
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    assert torch.equal(state["exp_avg"], result["exp_avg"]["model.4.weight"])
    assert reader.lightning_state() == {"epoch": 3, "global_step": 7}
    out = consolidate(folder / "ckpt", tmp_path / "one.ckpt")
    single = torch.load(out, weights_only=True)
    from weights_procs import model as fresh

    plain = fresh()
    plain.load_state_dict({k[len("model.") :]: v for k, v in single["state_dict"].items()}, strict=True)
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    optimizer.load_state_dict(single["optimizer_states"][0])
    assert single["epoch"] == 3
    again = open_checkpoint(out, layouts=[reader.layout(0)])  # the file reads back by key like the folder
    assert torch.equal(again.optimizer_state(0, "model.4.weight")["exp_avg"], state["exp_avg"])


def test_a_sharded_folder_keeps_optimizer_groups_as_model_parallel_strategy_and_names_are_checked(
    tmp_path: Path,
) -> None:
    """The folder's optimizer groups are Lightning's ModelParallelStrategy's keys (``param_groups.<g>.<name>``, the
    parameters' keys under ``params``); an earlier folder (groups as one value, ``layout`` apart) still reads; a
    folder whose state names other parameters than the optimizer's fails naming them (strict loading), and is
    left to the key report when ``strict_loading=False``."""
    import warnings

    from lightning_pipe.checkpoint.resume import Resume
    from lightning_pipe.checkpoint.sharded import OptimizerPart, save_sharded

    groups = [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.01, "momentum": 0.0}]
    layout = [["model.0.weight"], ["model.0.bias"]]
    state = {"model.0.weight": {"momentum_buffer": torch.ones(2, 2)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP in one process without a process group
        save_sharded(tmp_path / "new", {"model.0.weight": torch.zeros(2, 2)}, [OptimizerPart(state, groups, layout)])
    reader = open_checkpoint(tmp_path / "new")
    assert {"optimizer_0.param_groups.0.params", "optimizer_0.param_groups.1.lr"} <= set(reader.folder.metadata)
    assert reader.layout(0) == layout and reader.optimizer_groups(0) == groups and reader.group_sizes(0) == [1, 1]
    assert torch.equal(reader.optimizer_state(0, "model.0.weight")["momentum_buffer"], torch.ones(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        old = {"state_dict": {"model.0.weight": torch.zeros(2, 2)},
               "optimizer_0": {"state": state, "param_groups": tuple(groups), "layout": layout}}  # fmt: skip
        dcp.save(old, checkpoint_id=tmp_path / "old")
    earlier = open_checkpoint(tmp_path / "old")
    assert earlier.layout(0) == layout and earlier.optimizer_groups(0) == groups
    resume = Resume(tmp_path / "new")
    resume.check_groups([layout])
    other = [["model.0.weight"], ["model.renamed.bias"]]
    with pytest.raises(ValueError, match=r"saved for parameters the optimizer does not have \(model.0.bias\) and "
                       r"not for some it has \(model.renamed.bias\)"):  # fmt: skip
        resume.check_groups([other])
    resume.check_groups([other], strict=False)
    resume.close()
