"""Every `PipeStrategy` argument in every mode: read (it takes effect), warned once, or refused; docs/usage.md agrees.

`TABLE` says, per argument and mode, what happens to a value other than the default. Local mode runs tiny Trainers
and looks at what ran (the pipeline's stages, devices, flags, the checkpoint file written, the stage values against
the file they came from). rpc and launched mode are checked without starting processes: the Trainer picks the mode
(`lightning_pipe.strategy.modes.mode_choice`), refusals raise when the strategy or the Trainer is made, warnings are
what the mode says at its start (`lightning_pipe.strategy.unread`), and a value it reads is where the part that reads it
in that mode finds it: the `Pipeline` the mode's builder makes (recorded instead of started), the step driver, the
checkpoints, the layout.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, loader, mlp
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_pipe import PipeStrategy
from lightning_pipe.base.errors import ConfigurationError
from lightning_pipe.partition import TracedPartitioner
from lightning_pipe.runtime.pytorch import PyTorchRuntime
from lightning_pipe.strategy import building, schedule_selection
from lightning_pipe.strategy.building import Destination
from lightning_pipe.weights import StageInit
from lightning_pipe.weights.keys import KeyMismatchError

MODES = ("local", "rpc", "launched")
READ, WARNS, REFUSED = "read", "warns", "refused"
ALL = dict.fromkeys(MODES, READ)
RPC_ONLY = {"local": REFUSED, "rpc": READ, "launched": REFUSED}

#: what each mode does with an argument given another value than its default (with what it needs)
TABLE: dict[str, dict[str, str]] = {
    "stages": ALL,
    "microbatches": ALL,
    "schedule": ALL,
    "partition": ALL,
    "module": ALL,
    "devices": {"local": READ, "rpc": READ, "launched": REFUSED},
    "checkpoint": ALL,
    "runtime": ALL,
    "timeout": ALL,
    "backend": ALL,
    "strict": ALL,
    "transport": ALL,
    "coordinator": RPC_ONLY,
    "token": RPC_ONLY,
    "compress": RPC_ONLY,
    "split_points": ALL,
    "accelerator": ALL,
    "checkpoint_io": {"local": READ, "rpc": WARNS, "launched": WARNS},
    "precision_plugin": ALL,
    "virtual_stages": ALL,
    "runner": ALL,
    "trace": ALL,
    "microbatch_weight": ALL,
    "data_parallel": {"local": WARNS, "rpc": WARNS, "launched": READ},
    "weights": ALL,
    "save_distributed_checkpoint": {"local": WARNS, "rpc": READ, "launched": READ},
    "memory_budget": ALL,
    "weights_only": ALL,
    "tensor_parallel": {"local": REFUSED, "rpc": REFUSED, "launched": READ},
    "async_checkpoint": {"local": READ, "rpc": WARNS, "launched": READ},
    "fault_tolerance": {"local": REFUSED, "rpc": REFUSED, "launched": READ},
}
#: a fault-tolerant run's settings (torchft is not imported: the tests stand in for it)
FAULT_TOLERANCE = {"replica_group": 1, "replica_groups": 2, "lighthouse": "http://127.0.0.1:29510"}
SIGNATURE = {n: p.default for n, p in inspect.signature(PipeStrategy.__init__).parameters.items() if n != "self"}
USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"


def modes_cell(row: dict[str, str]) -> str:
    """The docs' "modes" cell of a row of `TABLE`: ``all``, or ``read: ...; warns: ...; refused: ...``."""
    if all(row[m] == READ for m in MODES):
        return "all"
    parts = [(what, [m for m in MODES if row[m] == what]) for what in (READ, WARNS, REFUSED)]
    return "; ".join(f"{what}: {', '.join(modes)}" for what, modes in parts if modes)


def shown(default: Any) -> str:
    return f'`"{default}"`' if isinstance(default, str) else f"`{default!r}`"


def docs_rows() -> dict[str, list[str]]:
    """docs/usage.md's argument table: argument -> its cells (default, modes, meaning)."""
    section = USAGE.read_text().split("### Arguments\n", 1)[1]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        match = re.fullmatch(r"\| `(\w+)` \|(.*)\|", line)
        if match:
            assert match[1] not in rows, f"{match[1]} is listed twice"
            rows[match[1]] = [cell.strip() for cell in match[2].split(" | ")]
        elif rows and not line.startswith("|"):
            break
    return rows


def test_the_table_walks_every_argument_and_the_docs_agree() -> None:
    assert set(TABLE) == set(SIGNATURE)
    rows = docs_rows()
    assert set(rows) == set(SIGNATURE), "docs/usage.md's argument table lists exactly PipeStrategy's arguments"
    for name, (default, modes, _meaning) in rows.items():
        assert default.split(":")[0] == shown(SIGNATURE[name]), f"{name}: default {default!r} in the docs"
        assert modes == modes_cell(TABLE[name]), f"{name}: the docs say {modes!r}, the code {modes_cell(TABLE[name])!r}"


def test_pipe_configs_docstring_names_the_schedules_tensor_parallel_runs() -> None:
    from test_house_config import field_docs

    from lightning_pipe.strategy.pipe_config import PipeConfig
    from lightning_pipe.strategy.tensor_parallel import TENSOR_PARALLEL_SCHEDULES

    described = " ".join(field_docs(PipeConfig)["tensor_parallel"].split())
    for name in TENSOR_PARALLEL_SCHEDULES:
        assert f'``"{name}"``' in described, name
    assert '``"interleaved-1f1b"`` with ``virtual_stages=2``' in described


# local mode: tiny Trainers, what ran
class Seen(L.Callback):
    """What the pipeline of a fit was (after its first training batch), and its stage 0 weight before it."""

    def __init__(self) -> None:
        self.pipeline: Any = None
        self.first_weight: torch.Tensor | None = None
        self.trainer: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        pipeline = trainer.strategy.pipeline  # type: ignore[attr-defined]
        if self.first_weight is None and pipeline is not None and pipeline.built:  # a traced one: at its first call
            self.first_weight = pipeline.stage_state.state_dict()["0.weight"].clone()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.pipeline = self.pipeline or trainer.strategy.pipeline  # type: ignore[attr-defined]


class CountingRuntime(PyTorchRuntime):
    pass


class RecordingIO(TorchCheckpointIO):
    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saved.append(str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def trainer_of(strategy: PipeStrategy, **options: Any) -> L.Trainer:
    """A quiet Trainer; the Trainer's accelerator left to the strategy where it has one (Lightning takes one)."""
    quiet = {**QUIET, "accelerator": "auto"} if strategy._accelerator is not None else QUIET
    return L.Trainer(**quiet, strategy=strategy, **options)


def fit(strategy: PipeStrategy, steps: int = 2, model: L.LightningModule | None = None) -> Seen:
    seen = Seen()
    trainer = trainer_of(strategy, max_steps=steps, callbacks=[seen])
    trainer.fit(model or Classifier(), loader())
    seen.trainer = trainer
    return seen


def test_local_mode_reads_the_pipeline_arguments(tmp_path: Path) -> None:
    weighed: list[int] = []
    accelerator, io, precision = CPUAccelerator(), RecordingIO(), MixedPrecision("bf16-mixed", "cpu")
    runtime = CountingRuntime("cpu")
    strategy = PipeStrategy(
        stages=3, microbatches=2, schedule="gpipe", partition=[2, 2, 3], module="model", devices=["cpu"] * 3,
        checkpoint="always", runtime=runtime, timeout=30.0, backend="eager", strict=True, transport="local",
        runner="dataflow", trace=tmp_path / "trace.json", microbatch_weight=lambda b: weighed.append(1) or len(b[0]),
        accelerator=accelerator, checkpoint_io=io, precision_plugin=precision,
    )  # fmt: skip
    seen = fit(strategy)
    pipe, trainer = seen.pipeline, seen.trainer
    assert strategy.mode.name == "local" and len(pipe.shards) == 3 and pipe.devices == ["cpu"] * 3
    assert [len(list(s.module.children())) for s in pipe.shards] == [2, 2, 3]
    schedule = strategy.last_step.schedule
    assert (type(schedule).__name__, schedule.num_microbatches) == ("GPipe", 2)
    assert pipe.checkpoint == [True, True, True] and pipe.timeout == 30.0 and pipe.runner == "dataflow"
    assert all(r is runtime for r in pipe.runtimes) and pipe.backend.strict
    assert pipe.autocast is not None and pipe.autocast.dtype == torch.bfloat16
    assert len(weighed) == 2 * 2  # each microbatch weighed, each step
    assert (tmp_path / "trace.json").exists()
    assert strategy.accelerator is accelerator and strategy.precision_plugin is precision
    trainer.save_checkpoint(tmp_path / "last.ckpt")  # written through it under a temporary name, then published
    assert len(io.saved) == 1 and Path(io.saved[0]).parent == tmp_path and (tmp_path / "last.ckpt").is_file()


class TwoChildren(Classifier):
    def __init__(self) -> None:
        super().__init__(mlp())
        self.head = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.model(x)), y)


def test_local_mode_reads_module_split_points_virtual_stages_and_schedule_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TwoChildren()
    seen = fit(PipeStrategy(stages=2, module="head", partition="uniform"), model=model)
    assert seen.pipeline.module is model.head  # not the child with the most parameters

    seen = fit(PipeStrategy(split_points=["4"]))
    assert len(seen.pipeline.shards) == 2 and isinstance(seen.pipeline.partitioner, TracedPartitioner)
    first = {n for n, _ in seen.pipeline.shards[0].module.named_parameters()}
    assert any("2" in n for n in first) and not any("4" in n or "6" in n for n in first)  # cut before layer 4

    with pytest.warns(UserWarning, match=r"save_distributed_checkpoint=True\) in local mode"):
        interleaved = {"stages": 4, "virtual_stages": 2, "schedule": "interleaved-1f1b"}
        seen = fit(PipeStrategy(**interleaved, save_distributed_checkpoint=True))
    assert seen.pipeline.worker_of_stage == [0, 1, 0, 1]

    logged: list[str] = []
    monkeypatch.setattr(schedule_selection, "rank_zero_info", logged.append)
    strategy = PipeStrategy(stages=2, schedule="auto", memory_budget=2**20, data_parallel="fsdp")
    with pytest.warns(UserWarning, match="nothing is sharded"):
        seen = fit(strategy)
    seen.trainer.validate(seen.trainer.lightning_module, loader())  # a second setup: said once per strategy
    options = seen.pipeline.choices.schedule.options
    assert options.budget == 2**20 and not options.split_backward
    said = [text for text in logged if "left out" in text]
    assert len(said) == 1 and "zero-bubble" in said[0] and "data_parallel='ddp'" in said[0]


def test_local_mode_refuses_what_it_cannot_run() -> None:
    for option in ({"coordinator": "127.0.0.1:1"}, {"token": "s"}, {"compress": "bf16"}):
        with pytest.raises(ConfigurationError, match="need.? transport='rpc'"):
            PipeStrategy(stages=2, **option)
    with pytest.raises(ConfigurationError, match=r"tensor_parallel=2\) runs in launched mode.*1 process"):
        L.Trainer(**QUIET, strategy=PipeStrategy(stages=2, tensor_parallel=2))
    with pytest.raises(ConfigurationError, match="weights_only=False.*no weights="):
        PipeStrategy(stages=2, weights_only=False)
    with pytest.raises(ConfigurationError, match="split points decide where each stage starts"):
        PipeStrategy(split_points=["4"], partition=[3, 4])
    with pytest.raises(ConfigurationError, match="memory_budget"):
        PipeStrategy(stages=2, memory_budget=2**20)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr("lightning_pipe.strategy.fault_tolerance.torchft", lambda: None)  # as if installed
        with pytest.raises(ConfigurationError, match=r"fault_tolerance=\.\.\.\) runs in launched mode"):
            L.Trainer(**QUIET, strategy=PipeStrategy(stages=2, fault_tolerance=FAULT_TOLERANCE))


def test_weights_are_read_and_a_checkpoint_wins_over_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``weights=`` (opened as ``weights_only`` says) gives the stages the file's values; with ``ckpt_path=`` the
    checkpoint's values win, built eagerly and on meta alike, and a warning says so."""
    pretrained = mlp(seed=5)
    torch.save(pretrained.state_dict(), tmp_path / "weights.pt")
    opened: list[Any] = []
    from lightning_pipe.strategy import checkpoints

    original = checkpoints.open_source
    monkeypatch.setattr(checkpoints, "open_source", lambda path, only: opened.append(only) or original(path, only))
    seen = fit(PipeStrategy(stages=2, weights=tmp_path / "weights.pt", weights_only=True), steps=1)
    assert opened == [True] and torch.equal(seen.first_weight, pretrained[0].weight.detach())

    plain = L.Trainer(**QUIET, max_steps=1)
    plain.fit(Classifier(mlp(seed=7)), loader())
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    resumed = torch.load(tmp_path / "plain.ckpt", weights_only=True)["state_dict"]["model.0.weight"]
    for meta in (False, True):
        strategy = PipeStrategy(stages=2, weights=tmp_path / "weights.pt")
        trainer = L.Trainer(**QUIET, max_steps=2, strategy=strategy)
        with trainer.init_module(empty_init=meta):
            model = Classifier(mlp(seed=9))
        seen = Seen()
        trainer.callbacks.append(seen)  # type: ignore[attr-defined]
        with pytest.warns(UserWarning, match="resumes from the checkpoint.*weights are not read"):
            trainer.fit(model, loader(), ckpt_path=tmp_path / "plain.ckpt")
        assert torch.equal(seen.first_weight, resumed), f"built {'on meta' if meta else 'eagerly'}"
        assert strategy.state.checkpoints.weights is not None  # a later fit without ckpt_path reads them again


def test_stage_init_is_strict_by_default(tmp_path: Path) -> None:
    """A `Pipeline` given ``StageInit(path=...)`` directly loads as Lightning's ``strict_loading`` does by default."""
    from lightning_pipe import Pipeline

    state = mlp().state_dict()
    del state["2.bias"]
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(KeyMismatchError, match=r"2\.bias"):
        with Pipeline(mlp(), stages=2, init=StageInit(path=str(tmp_path / "partial.pt")), timeout=30):
            pass  # the stages are built when it starts


# rpc and launched mode: the decision, without processes
class Recorded:
    """Stands for the `Pipeline` a mode's builder makes: what it was given."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.runtimes: list[Any] = []

    def start(self) -> Recorded:
        return self


def made(mode: str, **arguments: Any) -> tuple[PipeStrategy, L.Trainer]:
    """A strategy in ``mode`` (rpc: ``transport="rpc"``; launched: a Trainer of 4 processes), its Trainer built."""
    if mode == "rpc":
        arguments.setdefault("transport", "rpc")
    strategy = PipeStrategy(**{"stages": 2, **arguments})
    trainer = trainer_of(strategy, devices=4 if mode == "launched" else 1)
    assert strategy.mode.name == mode
    return strategy, trainer


def pipeline_given(strategy: PipeStrategy, model: L.LightningModule, monkeypatch: pytest.MonkeyPatch) -> dict:
    """What the mode's builder gives the `Pipeline` (the same call builds it in every mode; the transport differs)."""
    monkeypatch.setattr(building, "Pipeline", Recorded)
    devices = strategy.resolve_devices()
    placement = Destination(devices, torch.device("cpu"), None, lambda: "the mode's", lambda pipeline: None)
    strategy.builder.setup(model, placement)
    pipeline = strategy.builder.build(None)
    strategy.builder.pipeline = None
    given = dict(pipeline.kwargs)  # type: ignore[attr-defined]
    settings = given.pop("settings")  # the shared arguments, one object (`PipelineSettings`)
    return {**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}, **given, "model": model}


BF16 = MixedPrecision("bf16-mixed", "cpu")
#: per argument: a value other than the default, and where the mode's parts have it (``given``: the Pipeline's kwargs)
READ_BY: dict[str, tuple[Any, Any]] = {
    "stages": (4, lambda s, given: given["stages"] == 4),
    "microbatches": (8, lambda s, given: s.steps.microbatches == 8),
    "schedule": ("gpipe", lambda s, given: given["schedule"] == "gpipe"),
    "partition": ("uniform", lambda s, given: given["partition"].method == "uniform"),
    "module": ("head", lambda s, given: s.builder.pipelined is given["model"].head),
    "devices": (["cpu", "cpu"], lambda s, given: given["devices"] == ["cpu", "cpu"]),
    "checkpoint": ("always", lambda s, given: given["checkpoint"] == "always"),
    "runtime": (CountingRuntime("cpu"), lambda s, given: isinstance(given["runtime"], CountingRuntime)),
    "timeout": (30.0, lambda s, given: given["timeout"] == 30.0),
    "backend": ("eager", lambda s, given: given["backend"] == "eager"),
    "strict": (True, lambda s, given: given["strict"] is True),
    "transport": (None, lambda s, given: True),  # the mode itself (`made`)
    "coordinator": ("127.0.0.1:1", lambda s, given: given["coordinator"] == "127.0.0.1:1"),
    "token": ("s3cret", lambda s, given: given["token"] == "s3cret"),
    "compress": ("bf16", lambda s, given: given["compress"] == "bf16"),
    "split_points": (["4"], lambda s, given: given["partition"].split_points == ["4"]),
    "accelerator": (CPUAccelerator(), lambda s, given: isinstance(s.accelerator, CPUAccelerator)),
    "precision_plugin": (BF16, lambda s, given: s.precision_plugin is BF16),
    "virtual_stages": (2, lambda s, given: given["virtual_stages"] == 2),
    "runner": ("dataflow", lambda s, given: given["runner"] == "dataflow"),
    "trace": ("trace.json", lambda s, given: str(s.pipe_trace.path) == "trace.json"),
    "microbatch_weight": (len, lambda s, given: s.steps.microbatch_weight is len),
    "memory_budget": (2**20, lambda s, given: s.builder.selection.schedule.budget == 2**20),
    "save_distributed_checkpoint": (False, lambda s, given: s.config.save_distributed_checkpoint is False),
    "async_checkpoint": (True, lambda s, given: type(s.mode.writes).__name__ == "BackgroundWrites"),
}
NEEDS = {"virtual_stages": {"stages": 4, "schedule": "interleaved-1f1b"}, "memory_budget": {"schedule": "auto"},
         "split_points": {"stages": None}}  # fmt: skip


@pytest.mark.parametrize("mode", ["rpc", "launched"])
def test_rpc_and_launched_mode_read_refuse_or_warn(mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, row in TABLE.items():
        outcome = row[mode]
        if name in ("weights", "weights_only", "data_parallel", "tensor_parallel", "checkpoint_io", "fault_tolerance"):
            continue  # below: they need a file, a layout, or the mode's start
        value, reads = READ_BY[name]
        options = {**NEEDS.get(name, {}), name: value}
        if mode == "rpc" and name == "transport":
            options[name] = "rpc"
        if outcome == REFUSED:
            with pytest.raises(ConfigurationError, match=re.escape(name)):
                made(mode, **options)
            continue
        strategy, _ = made(mode, **options)
        given = pipeline_given(strategy, TwoChildren(), monkeypatch)
        assert reads(strategy, given) == (outcome == READ), f"{mode} mode: {name}={value!r} read: {outcome}"
        said = [text for text in strategy.mode.unread(strategy.checkpoint_io) if text is not None]
        assert (outcome == WARNS) == bool(said), f"{mode} mode: {name}={value!r}: {said}"
    # what a file, a layout or the mode's start decides
    torch.save(mlp().state_dict(), tmp_path / "weights.pt")
    strategy, _ = made(mode, weights=tmp_path / "weights.pt", weights_only=True)
    assert (strategy.state.checkpoints.weights, strategy.state.checkpoints.weights_only) == (
        str(tmp_path / "weights.pt"),
        True,
    )
    said = [text for text in made(mode)[0].mode.unread(RecordingIO()) if text is not None]
    assert len(said) == 1 and f"{mode} mode with checkpoint_io=RecordingIO" in str(said[0])
    monkeypatch.setattr("lightning_pipe.strategy.fault_tolerance.torchft", lambda: None)  # as if installed
    if mode == "rpc":
        with pytest.raises(ConfigurationError, match="fault_tolerance"):
            made(mode, fault_tolerance=FAULT_TOLERANCE)
    else:  # 4 processes, 4 stages: one replica group of a fault-tolerant run, reading its shard of the data
        tolerant, _ = made(mode, stages=4, fault_tolerance=FAULT_TOLERANCE)
        assert type(tolerant.mode.replicas).__name__ == "TorchftGroups"
        assert tolerant.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    fsdp, _ = made(mode, data_parallel="fsdp")
    if mode == "rpc":
        assert "nothing is sharded" in str(fsdp.mode.fsdp_warning())
        with pytest.raises(ConfigurationError, match="tensor_parallel=2, transport='rpc'"):
            made(mode, tensor_parallel=2)
    else:  # 4 processes, 2 stages: 2 replicas to shard each stage over
        assert fsdp.mode.fsdp_warning() is None and fsdp.stage.data_parallel == "fsdp"
        tensor, _ = made(mode, tensor_parallel=2)
        assert tensor.layout is not None and (tensor.layout.tensor_parallel, tensor.layout.replicas) == (2, 1)
        auto, _ = made(mode, schedule="auto", data_parallel="fsdp")
        selection = auto.builder.selection
        assert selection.left_out == "data_parallel='fsdp'" and not selection.schedule.split_backward
