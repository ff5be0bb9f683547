"""A training script for tensor parallel in a stage (3-D: replicas x pipeline x tensor), started by torchrun.

A small transformer (attention and MLP blocks) whose ``configure_model`` applies Lightning's documented tensor
parallel plan (``ColwiseParallel`` for the attention's q, k, v and the MLP's w1, w3; ``RowwiseParallel`` for
the attention's output and w2) over ``self.device_mesh["tensor_parallel"]``, and ``fully_shard`` over
``self.device_mesh["data_parallel"]`` where it has more than one rank: the same LightningModule runs under
Lightning's ``ModelParallelStrategy`` and under ``PipeStrategy(stages=S, tensor_parallel=T)``. Each case is one
``fit`` of 3 SGD steps; after it every process saves the whole values of the parameters it holds
(``<out>/<case>-rank<g>.pt``) for the test to compare.

    torchrun --nproc-per-node 4 tests/tensor_parallel_train.py --cases mps-d2-t2,pipe-s2-t2-gpipe --out /tmp/x
    torchrun --nproc-per-node 4 tests/tensor_parallel_train.py --cases "" --units --out /tmp/x  # the units alone
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_pipe import PipeStrategy  # noqa: E402

GLOBAL_BATCH, SEQUENCE, FEATURES, DIM, HEADS = 8, 4, 6, 16, 4
STEPS = 3
CLIP = 0.05  # well below the gradients' norm: every step clips


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        # no biases (as Llama): a key's bias has no gradient (softmax ignores it), and AdamW would turn its rounding
        # noise into steps of the learning rate's size
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # under tensor parallel q, k, v hold this rank's heads only: -1 counts them
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.norm1(x))
        return h + self.feed_forward(self.norm2(h))


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, DIM), Block(), Block(), Block(), Block(), nn.Linear(DIM, 1))


def tensor_parallel_plan() -> dict[str, object]:
    """Lightning's documented plan for an attention and an MLP block (no sequence parallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }  # fmt: skip


def parallelize_sequence_sharded(model: nn.Sequential, tensor: object) -> None:
    """A plan whose activations between blocks are DTensors sharded along the sequence (``Shard(1)``): what crosses
    between stages is each tensor rank's half of the sequence (local parts that differ by tensor rank)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        parallelize_module,
    )

    embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    parallelize_module(model[0], tensor, embed)  # type: ignore[arg-type]
    for block in model[1:-1]:
        sharded = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False,
        )  # fmt: skip
        parallelize_module(block, tensor, sharded)  # type: ignore[arg-type]
        parallelize_module(block, tensor, tensor_parallel_plan())  # type: ignore[arg-type]
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    parallelize_module(model[-1], tensor, gather)  # type: ignore[arg-type]


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    rows = STEPS * GLOBAL_BATCH
    x = torch.randn(rows, SEQUENCE, FEATURES, generator=g)
    return TensorDataset(x, torch.randn(rows, SEQUENCE, 1, generator=g))


#: ``-varlen``: each step's batch has its own sequence length (even: the sequence-sharded plan splits it over 2
#: tensor ranks)
LENGTHS = (8, 6, 10)


class VariableLengths(IterableDataset):
    """``-varlen``: `STEPS` whole batches of `GLOBAL_BATCH` rows, the sequence `LENGTHS[step]` tokens long (a
    replica reads every batch: the case runs one replica)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(2)
        for length in LENGTHS:
            x = torch.randn(GLOBAL_BATCH, length, FEATURES, generator=g)
            yield x, torch.randn(GLOBAL_BATCH, length, 1, generator=g)


def loader_of(options: list[str], batch_size: int) -> DataLoader:
    """A case's training data: `VariableLengths` for ``-varlen``, else `make_data` in batches of ``batch_size``."""
    if "varlen" in options:
        return DataLoader(VariableLengths(), batch_size=None)
    return DataLoader(make_data(), batch_size=batch_size)


class Net(L.LightningModule):
    """Written for ModelParallelStrategy: its configure_model parallelises the blocks over the device mesh."""

    def __init__(self, sequence_sharded: bool = False, optimizer: str = "sgd", shard_data: bool = True) -> None:
        super().__init__()
        self.model = make_model()
        self.sequence_sharded = sequence_sharded
        self.optimizer = optimizer
        self.shard_data = shard_data  # FSDP over the data-parallel dimension (PipeStrategy averages the stages itself)

    def configure_model(self) -> None:
        from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        if self.device_mesh is None or "tensor_parallel" not in (self.device_mesh.mesh_dim_names or ()):
            return  # a plain Trainer, or PipeStrategy without tensor parallel: the model as it is
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            return  # parallel already (validate after fit): Lightning asks configure_model to be idempotent
        tensor, data = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if self.sequence_sharded:
            parallelize_sequence_sharded(self.model, tensor)
        else:
            for block in self.model:
                if isinstance(block, Block):
                    parallelize_module(block, tensor, tensor_parallel_plan())
        if data.size() > 1 and self.shard_data:  # Lightning's TP x FSDP recipe: each block an FSDP unit, then the root
            for block in self.model:
                fully_shard(block, mesh=data)
            fully_shard(self.model, mesh=data)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.model(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.model(x), y))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def configure_optimizers(self):
        return make_optimizer(self.optimizer, self.parameters())


def make_optimizer(name: str, parameters) -> torch.optim.Optimizer:
    """``sgd``, ``momentum`` (SGD with momentum buffers) or ``adamw`` (first and second moments)."""
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=0.01)
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9 if name == "momentum" else 0.0)


def optimizer_of(options: list[str]) -> str:
    """The optimizer a case's options name (``-adamw``, ``-momentum``; SGD otherwise)."""
    return "adamw" if "adamw" in options else "momentum" if "momentum" in options else "sgd"


def whole_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole value of every real tensor this process holds (DTensors gathered over their mesh, in key order:
    the processes of one mesh hold the same keys)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in module.state_dict().items():
        if isinstance(value, DTensor):
            if value.to_local().is_meta:
                continue
            value = value.full_tensor()
        elif value.is_meta:
            continue
        out[key] = value.detach().cpu().clone()
    return out


def sharded(module: nn.Module) -> list[str]:
    """The parameters this process holds a part of only (DTensors whose local part is smaller than the whole)."""
    from torch.distributed.tensor import DTensor

    return [
        key for key, p in module.named_parameters()
        if isinstance(p, DTensor) and not p.to_local().is_meta and p.to_local().numel() < p.numel()
    ]  # fmt: skip


def on_meta(module: nn.Module) -> list[str]:
    """The parameters this process holds no values of (the other stages')."""
    from torch.distributed.tensor import DTensor

    return [key for key, p in module.named_parameters() if (p.to_local() if isinstance(p, DTensor) else p).is_meta]


def held(module: nn.Module) -> dict[str, list[int]]:
    """Per parameter this process holds values of: [its local numel, the numel of its tensor-parallel part] (the
    whole numel over the tensor ranks it is sharded over; with FSDP on top, each replica holds a share of that)."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for key, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.is_meta:
            continue
        part = p.numel()
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            for dim, placement in enumerate(p.placements):
                if names[dim] == "tensor_parallel" and not isinstance(placement, Replicate):
                    part //= p.device_mesh.size(dim)
        out[key] = [local.numel(), part]
    return out


PRECISIONS = {"bf16": "bf16-mixed", "bf16true": "bf16-true"}  # a case's option -> the Trainer's precision


def precision_of(options: list[str]) -> str:
    """The Trainer's precision for a case's options (``-bf16``: bf16-mixed, ``-bf16true``: bf16-true; else fp32)."""
    return next((PRECISIONS[o] for o in options if o in PRECISIONS), "32-true")


def schedule_of(case: str) -> str:
    """The schedule a ``pipe-s<S>-t<T>-<schedule>[-<option>...]`` case names right after its numbers: the longest
    registered name that the rest of the case starts with (``pipe-s2-t2-zero-bubble-clip``: ``zero-bubble``)."""
    from lightning_pipe.schedule import available_schedules

    rest = case.split("-", 3)[3]
    return max((name for name in available_schedules() if f"{rest}-".startswith(f"{name}-")), key=len)


def strategy_of(case: str, processes: int, out: Path | None = None) -> tuple[object, int]:
    """``mps-d2-t2``: ModelParallelStrategy(2, 2); ``pipe-s2-t2-gpipe``: PipeStrategy(stages=2, tensor_parallel=2),
    the schedule named after the numbers (`schedule_of`), ``-v2``: two stages per process (``virtual_stages=2``);
    with the number of replicas (each reads GLOBAL_BATCH / replicas rows a step). ``-seq``: the sequence-sharded
    plan (`parallelize_sequence_sharded`); ``-adamw``: AdamW instead of SGD; ``-clip``: gradients clipped to a norm of
    `CLIP` over the whole model; ``-ddp``: the module applies no FSDP (the stages' gradients averaged over the
    replicas); ``-fsdp``: neither does the module, PipeStrategy(data_parallel="fsdp") shards each stage
    over its replicas on top of tensor parallel; ``-bf16`` / ``-bf16true``: the Trainer's precision (`precision_of`);
    ``-save``: a checkpoint after the fit; ``-resume``: one more step from ``--resume`` (or, for
    ``<case>@<saving case>``, from that case's checkpoint); ``-momentum``: SGD with momentum; ``-eval``: validate,
    test and predict after the fit; ``-again``: validate and predict with the fitted module after the fit, then
    (with ``-save``) with new modules from the checkpoint (`again`); ``-varlen``: each step's sequence length its own
    (`VariableLengths`); ``-trace``: ``PipeStrategy(trace=<out>/<case>-trace.json)``, the timeline of steps 1-2."""
    parts = case.split("-")
    numbers = {p[0]: int(p[1:]) for p in parts[1:] if p[1:].isdigit()}
    if parts[0] == "mps":
        return ModelParallelStrategy(data_parallel_size=numbers["d"], tensor_parallel_size=numbers["t"]), numbers["d"]
    stages, tensor = numbers["s"], numbers["t"]
    data_parallel = "fsdp" if "fsdp" in parts else "ddp"
    trace = out / f"{case}-trace.json" if "trace" in parts and out is not None else None
    strategy = PipeStrategy(stages=stages, tensor_parallel=tensor, schedule=schedule_of(case), microbatches=2,
                            partition="uniform", timeout=60, data_parallel=data_parallel,
                            virtual_stages=numbers.get("v", 1),
                            trace=trace)  # fmt: skip
    return strategy, processes // (stages // numbers.get("v", 1) * tensor)


def evaluate(trainer: L.Trainer, model: Net, path: Path) -> None:
    """``-eval``: after the fit, ``trainer.validate``, ``test`` and ``predict`` on the training data in order (one
    batch of `GLOBAL_BATCH` rows each); what each returns in this process, saved."""
    data = DataLoader(make_data(), batch_size=GLOBAL_BATCH)
    results = {
        "validate": trainer.validate(model, data, verbose=False),
        "test": trainer.test(model, data, verbose=False),
        "predict": trainer.predict(model, data),
    }
    torch.save(results, path)


def again(trainer: L.Trainer, model: Net, fresh: Callable[[], Net], checkpoint: Path | None, out: Path) -> None:
    """``-again`` (its stages sharded with FSDP): ``trainer.validate`` and ``predict`` of the fitted module itself
    (its stages, sharded by the fit, run again as they are), on the training data in order (a replica's share of
    it), saved as ``<out>.pt``; with ``-save`` also of a new module (``fresh()``) with the saved ``checkpoint``, saved
    as ``<out>-new.pt``."""
    data = DataLoader(make_data(), batch_size=GLOBAL_BATCH)
    runs = [(model, None, out.with_suffix(".pt"))]
    if checkpoint is not None:
        runs.append((fresh(), checkpoint, out.parent / f"{out.name}-new.pt"))
    for module, path, saved in runs:
        results = {
            "validate": trainer.validate(module, data, ckpt_path=path, verbose=False),
            "predict": trainer.predict(module, data, ckpt_path=path),  # test runs as validate does
        }
        torch.save(results, saved)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--cases", default="pipe-s2-t2-1f1b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", default=None, help="the checkpoint that cases marked 'resume' continue")
    parser.add_argument("--checkpoints", default=None, help="where cases named <case>@<saving case> find its save")
    parser.add_argument("--units", action="store_true", help="after the cases: tests/tensor_parallel_units.py")
    args = parser.parse_args()
    out = Path(args.out)
    for name in filter(None, args.cases.split(",")):
        case, _, source = name.partition("@")  # resume@<case>: from the checkpoint that case saved (--checkpoints)
        strategy, replicas = strategy_of(case, args.devices, out)
        L.seed_everything(0, verbose=False)
        options = case.split("-")
        own_fsdp = not {"ddp", "fsdp"} & set(options)  # the module shards itself (Lightning's TP x FSDP recipe)
        model = Net("seq" in options, optimizer_of(options), shard_data=own_fsdp)
        trainer = L.Trainer(
            accelerator="cpu", devices=args.devices, strategy=strategy, logger=False, precision=precision_of(options),
            max_steps=STEPS + 1 if "resume" in options else STEPS,
            gradient_clip_val=CLIP if "clip" in options else None,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        resume = args.resume if "resume" in options else None
        if source:  # saved earlier in this launch, else by another launch (--checkpoints)
            saved = out / f"{source}.ckpt"
            resume = str(saved if saved.exists() or args.checkpoints is None else Path(args.checkpoints) / saved.name)
        trainer.fit(model, loader_of(options, GLOBAL_BATCH // replicas), ckpt_path=resume)
        if "save" in options:
            trainer.save_checkpoint(out / f"{case}.ckpt")  # a sharded folder: every process writes its part
        rank = dist.get_rank()
        torch.save(whole_values(model.model), out / f"{name}-rank{rank}.pt")
        if "eval" in options:
            evaluate(trainer, model, out / f"{name}-eval-rank{rank}.pt")
        if "again" in options:
            fresh = functools.partial(Net, "seq" in options, optimizer_of(options), shard_data=own_fsdp)
            saved = out / f"{case}.ckpt" if "save" in options else None
            again(trainer, model, fresh, saved, out / f"{name}-again-rank{rank}")
        if isinstance(strategy, PipeStrategy) and strategy.layout is not None:
            layout = strategy.layout
            where = {"replica": layout.replica, "stage": layout.pipeline_rank, "tensor": layout.tensor_rank,
                     "coordinates": layout.coordinates, "mesh": list(model.device_mesh.mesh_dim_names),
                     "sharded": sharded(model.model), "meta": on_meta(model.model)}  # fmt: skip
            where["held"] = held(model.model)
            (out / f"{name}-rank{rank}.json").write_text(json.dumps(where))
    if args.units:
        import tensor_parallel_units

        tensor_parallel_units.run(out)
    (out / f"done-rank{dist.get_rank()}").touch()


if __name__ == "__main__":
    faulthandler.enable()
    main()
