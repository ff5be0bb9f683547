"""The CUDA test set (``python -m pytest -m cuda``): the CPU tests' code paths with stages on ``cuda:0``.

Each test compares with a plain Trainer on the same GPU (or with the same run otherwise configured) and
checks that the stages did run on the GPU. Without a GPU every test here is skipped, with the reason;
launched mode over NCCL needs two GPUs (two processes cannot share one under NCCL).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, checked_mlp, dataset, gpt2_config, loader, max_param_diff, mlp
from torch import nn
from torch.utils.data import TensorDataset

from lightning_pipe import PipeStrategy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

GPU: dict[str, Any] = dict(QUIET, accelerator="cuda", devices=1)
ON_GPU = ["cuda:0", "cuda:0"]  # two stages, threads of this process, on the one GPU


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    """Full fp32 matmuls: TF32 rounds the piped and the plain run differently (microbatches are other shapes)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


class Devices(L.Callback):
    """The devices and dtypes of the pipelined module's outputs (a forward hook on each layer)."""

    def __init__(self, module: nn.Module) -> None:
        self.seen: set[tuple[str, torch.dtype]] = set()
        for layer in module.modules():
            if isinstance(layer, (nn.Linear, nn.Embedding)):
                layer.register_forward_hook(self._record)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 1:  # a traced model is built in its first step: the partitioner's check ran the
            self.seen.clear()  # unsplit model on its example where the model waits for its stages (the cpu)

    def _record(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.seen.add((output.device.type, output.dtype))

    @property
    def devices(self) -> set[str]:
        return {device for device, _ in self.seen}


def fit(module: L.LightningModule, strategy: Any = None, data: Any = None, **trainer: Any) -> L.Trainer:
    args = dict(GPU, max_steps=3) | trainer
    if strategy is not None:
        args["strategy"] = strategy
    t = L.Trainer(**args)
    t.fit(module, data if data is not None else loader(dataset(rows=96), batch_size=16))
    return t


def pipe(**options: Any) -> PipeStrategy:
    return PipeStrategy(**{"stages": 2, "microbatches": 4, "partition": "uniform", "devices": ON_GPU, **options})


def test_mlp_stages_on_one_gpu_equal_a_plain_trainer() -> None:
    piped, plain = Classifier(mlp()), Classifier(mlp())
    probe = Devices(piped.model)
    fit(piped, pipe())
    fit(plain)
    assert probe.devices == {"cuda"}
    assert max_param_diff(piped, plain) < 1e-5


class GPT2(L.LightningModule):
    """HuggingFace GPT-2 built from a config (tied embedding and head), traced and cut before block 2."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        transformers.logging.set_verbosity_error()
        self.model = transformers.GPT2LMHeadModel(gpt2_config(transformers, dropout=dropout))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tokens() -> Any:
    ids = torch.randint(0, 48, (24, 10), generator=torch.Generator().manual_seed(0))
    return loader(TensorDataset(ids), 8)


def gpt2_pipe(**options: Any) -> PipeStrategy:
    return PipeStrategy(microbatches=4, split_points=["transformer.h.2"], devices=ON_GPU, **options)


def test_huggingface_gpt2_stages_on_one_gpu_equal_a_plain_trainer() -> None:
    L.seed_everything(0)
    piped = GPT2()
    plain = copy.deepcopy(piped)
    probe = Devices(piped.model)
    fit(piped, gpt2_pipe(), tokens(), callbacks=[probe])
    fit(plain, None, tokens())
    assert probe.devices == {"cuda"}  # from the second step on
    assert max_param_diff(piped, plain) < 1e-5


def test_dropout_is_replayed_under_recomputation() -> None:
    """GPT-2 with dropout 0.1: ``checkpoint="always"`` recomputes each forward with the masks it drew, so the
    run equals ``"never"`` (1e-5: CUDA's embedding backward sums with atomics, in any order); the plain run
    draws other masks."""

    def run(strategy: Any) -> torch.Tensor:
        L.seed_everything(0)
        module = GPT2(dropout=0.1)
        fit(module, strategy, tokens())
        return torch.cat([p.detach().flatten() for p in module.parameters()])

    never = run(gpt2_pipe(checkpoint="never"))
    always = run(gpt2_pipe(checkpoint="always"))
    assert (always - never).abs().max().item() < 1e-5
    assert (run(None) - never).abs().max().item() > 1e-4  # the dropout is on


@pytest.mark.parametrize("precision,dtype", [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_mixed_precision_equals_a_plain_trainer(precision: str, dtype: torch.dtype) -> None:
    """The stages run under autocast (their layers' outputs are ``dtype``); 16-mixed steps through Lightning's
    GradScaler on both runs, with the same scale. Rounding differs with the microbatch shapes: 1e-3."""
    torch.manual_seed(0)
    piped, plain = Classifier(mlp()), Classifier(mlp())
    start = copy.deepcopy(piped)
    probes = Devices(piped.model), Devices(plain.model)
    t_piped = fit(piped, pipe(), precision=precision)
    t_plain = fit(plain, precision=precision)
    assert probes[0].seen == probes[1].seen == {("cuda", dtype)}
    if precision == "16-mixed":
        scales = [t.precision_plugin.scaler.get_scale() for t in (t_piped, t_plain)]  # type: ignore[attr-defined]
        assert scales[0] == scales[1]
    assert max_param_diff(piped, plain) < 1e-3
    assert max_param_diff(piped, start) > 1e-2  # it trained


def test_inductor_backend_with_strict_equals_a_plain_trainer() -> None:
    """``backend="inductor", strict=True``: both stages compiled (no fallback to eager), gradients as eager's."""
    piped, plain = Classifier(mlp()), Classifier(mlp())
    trainer = fit(piped, pipe(backend="inductor", strict=True, checkpoint="never", timeout=240))
    fit(plain)
    trace = trainer.strategy.execution_trace()  # type: ignore[attr-defined]
    assert trace[0].backend("train") == trace[1].backend("train") == "inductor"
    assert trace[0].runs["train"]["inductor"] == 3 * 4  # 3 steps x 4 microbatches
    assert max_param_diff(piped, plain) < 1e-5


def test_recompute_auto_reads_the_gpus_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoint="auto"`` decides before the second step from ``torch.cuda.mem_get_info``: both stages report
    the one GPU's free memory (not "no limit", as on cpu); a small model recomputes nothing and stays exact."""
    logged: list[str] = []
    monkeypatch.setattr("lightning_pipe.strategy.training.rank_zero_info", logged.append)
    plans: list[Any] = []

    class Plan(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            auto = trainer.strategy.pipeline.choices.checkpoint  # type: ignore[attr-defined]
            if auto is not None and auto.plan is not None:
                plans.append(auto.plan)

    piped, plain = Classifier(mlp()), Classifier(mlp())
    strategy = pipe()
    assert strategy.checkpoint == "auto"
    fit(piped, strategy, callbacks=[Plan()])
    fit(plain)
    free, total = torch.cuda.mem_get_info(0)
    decided = plans[-1]
    assert decided.flags == [False, False]
    assert len(decided.devices) == 1 and next(iter(decided.devices)).endswith("/cuda:0")  # one device, shared
    for stage in decided.stages:
        assert stage.free is not None and 0 < stage.free <= total
        assert abs(stage.free - free) < 0.1 * total  # what the GPU has free (its cache counted as free)
    assert len(logged) == 1 and "cuda:0" in logged[0] and "no limit" not in logged[0]
    assert max_param_diff(piped, plain) < 1e-5


def test_rpc_stages_on_the_gpu_equal_a_plain_trainer() -> None:
    """``transport="rpc"``: stage 0 in a worker process, the last stage in this process, both on cuda:0; each
    stage checks that its input is on the GPU (`RunsOn`: a silent CPU fallback fails the step)."""
    (model, partition), (reference, _) = checked_mlp("cuda"), checked_mlp("cuda")
    piped, plain = Classifier(model), Classifier(reference)
    fit(piped, pipe(transport="rpc", timeout=120, partition=partition))
    fit(plain)
    assert max_param_diff(piped, plain) < 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: NCCL point to point between stages")
def test_launched_mode_over_nccl_equals_the_unsplit_model(tmp_path: Path) -> None:
    """Lightning's launcher starts 2 processes, one stage on each GPU (1 x 2, 1F1B and GPipe) and the
    activations cross over NCCL; the trained model equals the unsplit one on the global batch."""
    from launching import lightning_launch
    from test_launched import SCRIPT, assert_ok, check_trained, coordinators

    cases = ["s2-adam-1f1b", "s2-sgd-gpipe"]
    args = ["--accelerator", "gpu", "--devices", "2", "--cases", ",".join(cases), "--out", str(tmp_path)]
    run = lightning_launch(SCRIPT, args)
    assert_ok(run)
    assert "launched mode, 2 processes = 1 replica(s) x 2 pipeline rank(s)" in run.output
    for name in cases:
        check_trained(tmp_path, name, coordinators(name, processes=2))


EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")


def test_digits_example_trains_on_the_gpu() -> None:
    """``python examples/digits.py`` on a GPU machine: both stages on the GPU (accelerator "auto")."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (lightning_pipe[examples])")
    sys.path.insert(0, EXAMPLES)
    try:
        from digits import train
    finally:
        sys.path.remove(EXAMPLES)
    torch.cuda.reset_peak_memory_stats(0)
    accuracy = train(pipe=True, epochs=8)
    assert torch.cuda.max_memory_allocated(0) > 0  # it ran there
    assert accuracy > 0.9


def test_causal_lm_example_on_the_gpu_takes_the_unsplit_step() -> None:
    pytest.importorskip("transformers", reason="the causal LM example needs transformers (lightning_pipe[examples])")
    sys.path.insert(0, EXAMPLES)
    try:
        from causal_lm import train
    finally:
        sys.path.remove(EXAMPLES)
    torch.cuda.reset_peak_memory_stats(0)
    result = train(steps=30)
    assert torch.cuda.max_memory_allocated(0) > 0
    check = result["check"]
    assert check["microbatch_weight"][1] < 1e-5  # gradients of the unsplit step
    assert check["rows"][1] > 1e-3
    assert result["losses"][-1] < result["losses"][0]
