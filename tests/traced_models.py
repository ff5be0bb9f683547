"""Models that are not nn.Sequential, for the traced-splitting tests (tiny, CPU, seeded)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block with a causal, optionally padded, attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1)) + bias  # bias: (b or 1, 1, t, t)
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-style decoder: tied embedding and head, a causal-mask buffer, optional padding mask."""

    def __init__(self, vocab: int = 37, dim: int = 16, heads: int = 2, layers: int = 4, context: int = 16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.register_buffer("causal", torch.tril(torch.ones(context, context, dtype=torch.bool)), persistent=False)

    def forward(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        bias = torch.zeros(t, t, device=idx.device).masked_fill(~self.causal[:t, :t], float("-inf"))[None, None]
        if mask is not None:  # (b, t) with 1 for tokens, 0 for padding
            bias = bias + (1.0 - mask[:, None, None, :].float()) * -1e4
        for block in self.blocks:
            x = block(x, bias)
        return self.head(self.ln_f(x))


class ConvBlock(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class SkipCNN(nn.Module):
    """A small U-Net-like CNN: its skip connections cross the stage boundaries."""

    def __init__(self, channels: int = 4, classes: int = 3) -> None:
        super().__init__()
        c = channels
        self.down1, self.down2 = ConvBlock(3, c), ConvBlock(c, 2 * c)
        self.mid = ConvBlock(2 * c, 2 * c)
        self.up2, self.up1 = ConvBlock(4 * c, c), ConvBlock(2 * c, c)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.down1(x)
        x2 = self.down2(F.max_pool2d(x1, 2))
        x3 = self.mid(F.max_pool2d(x2, 2))
        u2 = self.up2(torch.cat([F.interpolate(x3, scale_factor=2.0), x2], dim=1))
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), x1], dim=1))
        return self.head(u1).mean(dim=(2, 3))


class KeywordNet(nn.Module):
    """Keyword-only arguments (one of them a constant), a dict output, and a value reused by the last layer."""

    def __init__(self, inputs: int = 6, width: int = 12, classes: int = 3) -> None:
        super().__init__()
        self.encode = nn.Linear(inputs, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.classify = nn.Linear(width, classes)
        self.reconstruct = nn.Linear(width, inputs)

    def forward(self, x: torch.Tensor, *, weight: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        h = torch.tanh(self.encode(x)) * weight[:, None]
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return {"logits": self.classify(h) * scale, "recon": self.reconstruct(h) + x, "scale": scale}


def gpt_batch(rows: int = 8, t: int = 12, vocab: int = 37, seed: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (rows, t), generator=g)
    mask = torch.ones(rows, t)
    mask[::2, -3:] = 0  # pad the end of every other row
    targets = torch.randint(0, vocab, (rows, t), generator=g)
    return idx, mask, targets


class LossInForward(nn.Module):
    """Builds its loss module inside forward, as HF models do when given ``labels=``: with class weights the
    model holds (a buffer), with a weight tensor made in forward (a constant of the trace), or with a
    positive-class weight computed from the buffer."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.register_buffer("class_weights", torch.linspace(0.5, 2.0, width))
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, labels: torch.Tensor, loss: str = "weighted") -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        logits = x / self.temperature
        if loss == "weighted":
            value = nn.CrossEntropyLoss(weight=self.class_weights)(logits, labels)
        elif loss == "constant":
            weight = torch.tensor([1.0, 2.0, 1.0, 1.0, 0.5, 1.0])
            value = nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)(logits, labels)
        elif loss == "multi_label":
            targets = F.one_hot(labels, logits.size(-1)).float()
            value = nn.BCEWithLogitsLoss(pos_weight=self.class_weights * 2)(logits, targets)
        else:
            value = nn.MSELoss()(logits.sum(-1), labels.float())
        return {"loss": value, "logits": logits}
