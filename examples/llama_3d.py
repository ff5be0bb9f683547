"""Train a small Llama-style model in 3-D: replicas x pipeline stages x tensor ranks, on CPU or GPUs.

    python examples/llama_3d.py --devices 8            # 2 replicas x 2 stages x 2 tensor ranks (gloo on CPU)
    python examples/llama_3d.py --devices 4            # 1 replica x 2 stages x 2 tensor ranks
    python examples/llama_3d.py --devices 8 --data-parallel ddp    # no fully_shard: each replica holds its stage whole
    python examples/llama_3d.py --devices 8 --stages 4 --tensor-parallel 2 --schedule gpipe
    python examples/llama_3d.py --devices 8 --strategy model-parallel   # Lightning's ModelParallelStrategy: 4 x 2
    python examples/llama_3d.py --strategy plain       # one process, the whole model (the reference)
    python examples/llama_3d.py --devices 8 --accelerator gpu --size small   # one GPU per process, over NCCL

The model (`Llama`, built from a `LlamaConfig`; plain torch, nothing downloaded) is an ``nn.Sequential`` of a token
embedding, decoder blocks (RMSNorm, grouped-query attention with rotary embeddings, RMSNorm, SwiGLU MLP) and a
final RMSNorm and output head. The LightningModule is written for Lightning's ``ModelParallelStrategy``, as
Lightning's own tensor parallel example is: its ``configure_model`` applies the tensor parallel plan to each block
over ``self.device_mesh["tensor_parallel"]`` (``ColwiseParallel`` for q, k, v, w1 and w3, ``RowwiseParallel`` for
o and w2; each rank counts its own heads), splits the embedding and the head over the vocabulary, and, where the
data-parallel dimension has more than one rank, shards each block and then the whole model with ``fully_shard`` over
``self.device_mesh["data_parallel"]`` (Lightning's TP x FSDP recipe). ``--tie-embeddings``: the head shares the
embedding's weight, which then stays whole (under PipeStrategy the first and the last stage each hold a copy, and
the copies get the sum of their gradients, so they take the unsplit model's step).
``PipeStrategy(stages=S, tensor_parallel=T)`` runs the same module unchanged: Lightning's launcher starts
``--devices`` processes (no torchrun needed), which form R = devices / (S x T) replicas of S stages of T tensor
ranks, tensor innermost. PipeStrategy records the module's ``fully_shard`` calls and applies them per stage: each
block a unit in the stage that holds it, the whole model's unit each stage's root; so a process holds about
1/(R x S x T) of the parameters, gradients and optimizer state. ``--data-parallel ddp`` or ``fsdp``: the module
calls no ``fully_shard`` (under PipeStrategy only) and ``PipeStrategy(data_parallel=...)`` keeps each stage's
tensor-parallel parts whole in every replica and averages their gradients (ddp), or shards them itself (fsdp).

The data are synthetic token rows from a seeded generator (each row counts up from a random start by a random
stride, modulo the vocabulary: learnable, so the loss goes down). Every process that runs Lightning's loop (a
coordinator: one per replica and tensor rank) prints ``step <i> loss <value>``; the loss is logged with
``sync_dist=True``, the mean over the coordinators, which is the global batch's loss.
``--report FOLDER`` writes each process's losses, peak memory and the bytes it holds of the model's parameters,
their gradients and the optimizer state after the last step (``benchmarks/memory.py`` and the tests read them).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_pipe import PipeStrategy


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-style decoder."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads / n_kv_heads query heads share a key and value head
    hidden_dim: int = 172  # SwiGLU's inner width
    max_seq_len: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


SIZES = {
    "tiny": LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=16),
    "small": LlamaConfig(vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, hidden_dim=1376,
                         max_seq_len=128),
}  # fmt: skip


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embeddings of ``x`` (batch, heads, sequence, head_dim): pairs of features rotated by an
    angle that grows with the position (computed here, no buffer: nothing to build or load per stage)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(x.shape[-2], device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings, no biases (as Llama)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        kv = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk, self.wv = nn.Linear(config.dim, kv, bias=False), nn.Linear(config.dim, kv, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.config.head_dim  # under tensor parallel q, k, v hold this rank's heads only: -1 counts them
        q, k, v = (w(x).view(b, s, -1, d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, self.config.rope_theta), rotary(k, self.config.rope_theta)
        group = q.shape[1] // k.shape[1]  # query heads per key/value head (the same on every tensor rank)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-norm decoder block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Sequential):
    """Embedding, ``n_layers`` blocks, the final norm and the output head: a sequence the pipeline cuts."""

    def __init__(self, config: LlamaConfig) -> None:
        embedding = nn.Embedding(config.vocab_size, config.dim)
        head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            head.weight = embedding.weight
        blocks = [Block(config) for _ in range(config.n_layers)]
        super().__init__(embedding, *blocks, nn.RMSNorm(config.dim, eps=config.norm_eps), head)
        for module in self.modules():  # Llama's initialisation: a small normal for every matrix
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)


def tensor_parallel_plan() -> dict[str, Any]:
    """A block's plan (Lightning's example's): q, k, v and w1, w3 split by output features (whole heads per rank),
    o and w2 by input features, their partial outputs summed; the block's input and output whole on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }  # fmt: skip


class LlamaModule(L.LightningModule):
    """Next-token prediction, written for ModelParallelStrategy; nothing here knows about pipelines."""

    def __init__(self, config: LlamaConfig, lr: float = 3e-3, shard_data: bool = True) -> None:
        super().__init__()
        self.config, self.lr = config, lr
        self.shard_data = shard_data  # False: the strategy spreads the model over the data dimension (--data-parallel)
        self.model = Llama(config)

    def configure_model(self) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh is None or "tensor_parallel" not in (self.device_mesh.mesh_dim_names or ()):
            return  # a plain Trainer, or PipeStrategy without tensor parallel (--tensor-parallel 1): the model as it is
        tensor = self.device_mesh["tensor_parallel"]
        if self.config.n_kv_heads % tensor.size():
            raise ValueError(f"n_kv_heads={self.config.n_kv_heads} must be a multiple of the {tensor.size()} ranks")
        for block in self.model:
            if isinstance(block, Block):
                parallelize_module(block, tensor, tensor_parallel_plan())
        if not self.config.tie_embeddings:  # the embedding's rows and the head's outputs split over the vocabulary
            parallelize_module(self.model[0], tensor, RowwiseParallel(input_layouts=Replicate()))
            parallelize_module(self.model[-1], tensor, ColwiseParallel(output_layouts=Replicate()))
        data = self.device_mesh["data_parallel"]
        if data.size() > 1 and self.shard_data:  # Lightning's TP x FSDP recipe: each block a unit, then the root
            from torch.distributed.fsdp import fully_shard

            for block in self.model:
                if isinstance(block, Block):
                    fully_shard(block, mesh=data)
            fully_shard(self.model, mesh=data)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)  # the mean over the coordinators: the global batch's loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class Tokens(Dataset[torch.Tensor]):
    """``rows`` synthetic rows of ``length`` tokens: from a random start by a random stride, modulo ``vocab``."""

    def __init__(self, rows: int, length: int, vocab: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 8, (rows, 1), generator=g)
        self.rows = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


class PrintLoss(L.Callback):
    """Each step's loss (the mean over the coordinators), printed by every process that runs Lightning's loop."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        loss = float(trainer.callback_metrics["train_loss"])
        self.losses.append(loss)
        sys.stdout.write(f"rank {process_rank()} step {trainer.global_step} loss {loss:.8f}\n")  # one write a line
        sys.stdout.flush()


def process_rank() -> int:
    """This process's global rank in the launched world (0 in one process)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def strategy_of(args: argparse.Namespace) -> tuple[Any, int]:
    """The strategy the command line asks for, and its number of data-parallel replicas."""
    if args.strategy == "plain":
        return "auto", 1
    if args.strategy == "model-parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        replicas = args.devices // args.tensor_parallel
        return ModelParallelStrategy(data_parallel_size=replicas, tensor_parallel_size=args.tensor_parallel), replicas
    strategy = PipeStrategy(
        stages=args.stages,
        tensor_parallel=args.tensor_parallel,
        schedule=args.schedule,
        microbatches=args.microbatches,
        partition="uniform",
        data_parallel="ddp" if args.data_parallel == "module" else args.data_parallel,
    )
    return strategy, max(1, args.devices // (args.stages * args.tensor_parallel))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train as the command line (or ``argv``) says; returns this process's report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the model: tiny (tests) or small")
    parser.add_argument("--tie-embeddings", action="store_true",
                        help="the head shares the embedding's weight (--strategy model-parallel or plain)")  # fmt: skip
    parser.add_argument("--devices", type=int, default=8, help="processes (Lightning's launcher starts them)")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo), or gpu: one GPU per process (NCCL)")
    strategies = ["pipe", "model-parallel", "plain"]
    described = "PipeStrategy; Lightning's ModelParallelStrategy on the same module; one process, the whole model"
    parser.add_argument("--strategy", choices=strategies, default="pipe", help=described)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages S")
    parser.add_argument("--tensor-parallel", type=int, default=2, help="tensor ranks per stage T")
    parser.add_argument("--data-parallel", choices=["module", "ddp", "fsdp"], default="module",
                        help="over a stage's replicas: module: the module's own fully_shard calls; ddp: none, each "
                        "replica holds its stage whole and averages the gradients; fsdp: none, PipeStrategy shards "
                        "each stage with FSDP2 (PipeStrategy(data_parallel=...))")  # fmt: skip
    parser.add_argument("--schedule", default="1f1b", help="1f1b or gpipe (the schedules tensor parallel runs)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="rows of the global batch (split over the replicas)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--build", choices=["eager", "meta"], default="eager",
                        help="eager: every process builds the whole model first; meta: on the meta device")  # fmt: skip
    parser.add_argument("--report", default=None, help="write losses, peak memory and bytes held (one file a process)")
    args = parser.parse_args(argv)

    config = replace(SIZES[args.size], tie_embeddings=args.tie_embeddings)
    strategy, replicas = strategy_of(args)
    shard_data = args.data_parallel == "module" or args.strategy != "pipe"  # ModelParallelStrategy: the module's FSDP
    data = Tokens(args.batch * args.max_steps, config.max_seq_len + 1, config.vocab_size)
    printer = PrintLoss()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1 if args.strategy == "plain" else args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=[printer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    L.seed_everything(0, verbose=False)  # every process builds the same model: the plan splits equal values
    if args.build == "meta":  # no values: each process makes its own shards real (reset_parameters, seeded)
        with trainer.init_module(empty_init=True):
            model = LlamaModule(config, args.lr, shard_data)
    else:
        model = LlamaModule(config, args.lr, shard_data)
    # Lightning shuffles training data with its distributed sampler (seed 0); one plain process reads the same order
    sampler: Any = DistributedSampler(data, num_replicas=1, rank=0, seed=0) if args.strategy == "plain" else None
    trainer.fit(model, DataLoader(data, batch_size=args.batch // replicas, sampler=sampler))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = {"rank": process_rank(), "losses": printer.losses, "peak_mib": peak_mib(),
              "cpu_seconds": usage.ru_utime + usage.ru_stime, **held(model.model)}  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        (Path(args.report) / f"rank{report['rank']}.json").write_text(json.dumps(report))
    return report


def held(model: nn.Module) -> dict[str, int]:
    """The bytes of the model's parameters: the whole model's, and the part this process holds (the local parts of
    its real tensors; another stage's stay on meta here); the bytes of the gradients it holds after the last step,
    and of the optimizer state (`optimizer_bytes`)."""
    whole = mine = gradients = 0
    for p in model.parameters():  # a tied weight once
        whole += p.numel() * p.element_size()
        mine += local_bytes(p)
        gradients += 0 if p.grad is None else local_bytes(p.grad)
    return {"parameter_bytes": whole, "held_parameter_bytes": mine, "held_gradient_bytes": gradients,
            "held_optimizer_bytes": optimizer_bytes()}  # fmt: skip


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes of this process's part of ``tensor``: a DTensor's local part, nothing for a tensor on meta."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return 0 if local.is_meta else local.numel() * local.element_size()


def optimizer_bytes() -> int:
    """The bytes of the state of every optimizer alive in this process (the stage's own, and Lightning's on a
    coordinator), their local parts, each tensor once: found by the garbage collector, as the stage's optimizer is
    PipeStrategy's and not the LightningModule's."""
    import gc

    seen: set[int] = set()
    total = 0
    for optimizer in (o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)):  # type(): no warnings
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    total += local_bytes(value)
    return total


def peak_mib() -> float:
    """This process's peak resident memory (Linux), in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return math.nan


if __name__ == "__main__":
    main()
