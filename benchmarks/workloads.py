"""The benchmark's models and data: an MLP and a small GPT-style decoder, both as ``nn.Sequential``.

Every process builds the same model from the same seed and the same batches, so all contenders
start from identical parameters and see identical data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SEED = 1234
DATA_SEED = 4321
NUM_BATCHES = 4  # distinct batches, cycled through the steps


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    layers: int  # children of the nn.Sequential

    def balance(self, stages: int) -> list[int]:
        """Layers per stage; both libraries split the model at the same points."""
        return BALANCES[(self.name, stages)] if (self.name, stages) in BALANCES else _even(self.layers, stages)


def _even(layers: int, stages: int) -> list[int]:
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


# gpt: [embedding, 8 blocks, head]; the embedding is cheap and the head costs about half a block
BALANCES = {("gpt", 2): [5, 5], ("gpt", 4): [3, 2, 2, 3]}

MLP = Workload("mlp", batch=256, layers=8)
GPT = Workload("gpt", batch=32, layers=10)
TINY = Workload("tiny", batch=64, layers=8)  # almost no compute: step time is the libraries' own overhead
WORKLOADS = {"mlp": MLP, "gpt": GPT, "tiny": TINY}

# gpt sizes
D_MODEL, SEQ, HEADS, VOCAB = 256, 128, 4, 1024


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions[: idx.shape[1]]  # (B, T, D)


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a 4x MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)  # (B, H, T, d/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D_MODEL)
        self.out = nn.Linear(D_MODEL, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))  # (B, T, V)


def build_model(workload: str) -> nn.Sequential:
    """The unsplit model, initialised from `SEED`."""
    torch.manual_seed(SEED)
    if workload == "mlp":
        return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(MLP.layers)])
    if workload == "tiny":
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(TINY.layers)])
    if workload == "gpt":
        return nn.Sequential(Embedding(), *[Block() for _ in range(GPT.layers - 2)], Head())
    raise ValueError(f"unknown workload {workload!r}; available: {', '.join(WORKLOADS)}")


def make_batches(workload: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`NUM_BATCHES` (input, target) pairs from `DATA_SEED`."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    batch = WORKLOADS[workload].batch
    if workload in ("mlp", "tiny"):
        width = 1024 if workload == "mlp" else 16
        return [
            (torch.randn(batch, width, generator=generator), torch.randn(batch, width, generator=generator))
            for _ in range(NUM_BATCHES)
        ]
    tokens = [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator) for _ in range(NUM_BATCHES)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def loss_fn(workload: str):  # noqa: ANN201 - a module-level function, picklable for spawned processes
    return lm_loss if workload == "gpt" else mse_loss


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def stage_module(model: nn.Sequential, balance: list[int], stage: int) -> nn.Sequential:
    """The children of ``model`` that stage ``stage`` holds, keeping their names (so state_dict keys match)."""
    start = sum(balance[:stage])
    named = list(model.named_children())[start : start + balance[stage]]
    part = nn.Sequential()
    for name, child in named:
        part.add_module(name, child)
    return part
