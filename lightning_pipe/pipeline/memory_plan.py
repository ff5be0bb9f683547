"""The static memory plan: how many activations each stage holds at its peak, and how many bytes.

``plan(model, sample, stages=4, schedule="1f1b")`` cuts the model like the pipeline would, runs
each stage once on one microbatch of ``sample`` to measure what it stashes (inputs, outputs and
the tensors autograd saves; only the input under activation checkpointing), then walks every
worker's action list: a forward adds its stage's stash, ``I`` adds the gradients kept for ``W``
(and, under checkpointing, the recomputed graph), ``B`` or ``W`` frees the microbatch. The peaks
are what `StageWorker` measures during a real step (``Pipeline.stash_peaks()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pipe.base import tree
from lightning_pipe.base.microbatch import split
from lightning_pipe.base.units import size_text
from lightning_pipe.engine.executors import Activation, call_module
from lightning_pipe.engine.runners import worker_lists, worker_of_stages
from lightning_pipe.engine.split_backward import backward_input
from lightning_pipe.engine.stash import stash_bytes
from lightning_pipe.partition import Partitioner, ShardedTask
from lightning_pipe.partition.selection import resolve_partitioner
from lightning_pipe.pipeline.recompute import checkpoint_flags
from lightning_pipe.schedule import Action, Kind, placement_of, resolve_schedule
from lightning_pipe.schedule.stash_walk import walk


@dataclass
class StageFootprint:
    """One stage: its parameters and what one microbatch keeps alive on it."""

    stage: int
    rank: int
    layers: list[str]
    param_bytes: int
    activation_bytes: int  # from the forward until the backward (B) or the weight gradient (W)
    split_bytes: int = 0  # more, from the input gradient (I) until W
    peak_held: int = 0  # this stage's microbatches held when its rank peaks


@dataclass
class MemoryPlan:
    """Predicted per-stage stash and per-rank peaks of one training step."""

    schedule: str
    microbatches: int
    stages: list[StageFootprint]
    rank_peak_bytes: list[int] = field(default_factory=list)
    rank_peak_activations: list[int] = field(default_factory=list)

    def table(self) -> str:
        head = (
            f"{'stage':>5} {'rank':>4}  {'layers':<16} {'params':>10} {'act/mb':>10} {'+I..W':>10} {'held':>4} "
            f"{'at peak':>10}"
        )
        lines = [f"memory plan: schedule={self.schedule}, microbatches={self.microbatches}", head]
        for st in self.stages:
            names = f"{st.layers[0]}..{st.layers[-1]}" if len(st.layers) > 1 else "".join(st.layers)
            held = st.peak_held * st.activation_bytes  # lower bound: some of them may be past their I
            lines.append(
                f"{st.stage:>5} {st.rank:>4}  {names:<16} {size_text(st.param_bytes):>10} "
                f"{size_text(st.activation_bytes):>10} {size_text(st.split_bytes):>10} {st.peak_held:>4} "
                f"{size_text(held):>10}"
            )
        for rank, (nbytes, count) in enumerate(zip(self.rank_peak_bytes, self.rank_peak_activations, strict=True)):
            lines.append(f"rank {rank}: peak {size_text(nbytes)} of stashed activations ({count} microbatches)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def plan(
    module: nn.Module,
    sample: Any,
    stages: int,
    microbatches: int = 4,
    schedule: Any = "1f1b",
    virtual_stages: int = 1,
    partition: str | Sequence[int] | Partitioner = "params",
    checkpoint: str | Sequence[bool] = "auto",
    runner: str = "parallel",
    verbose: bool = False,
) -> MemoryPlan:
    """Predict every rank's peak stash for one step on ``sample`` (a whole batch); prints the table if verbose."""
    # "auto" is planned without recomputation: what it chooses where memory allows (always on cpu)
    flags = [bool(f) for f in (checkpoint_flags(checkpoint, stages) if isinstance(checkpoint, str) else checkpoint)]
    factory = resolve_schedule(schedule)
    worker_of = worker_of_stages(runner, stages, virtual_stages, placement_of(factory))
    pieces = split(sample, microbatches)
    shards = resolve_partitioner(partition).partition(module, ["cpu"] * stages, sample)
    built = factory(stages // virtual_stages, microbatches, virtual_stages)
    lists = worker_lists(built.actions(), stages, worker_of)
    split_backward = any(a.kind is Kind.BACKWARD_INPUT for actions in lists for a in actions)
    memory = _measure(shards, pieces[0], flags, split_backward)
    for st in memory:
        st.rank = worker_of[st.stage]
    result = MemoryPlan(getattr(built, "name", str(schedule)), microbatches, memory)
    for actions in lists:
        peak, count, held = _walk(actions, memory)
        result.rank_peak_bytes.append(peak)
        result.rank_peak_activations.append(count)
        for s, n in held.items():
            memory[s].peak_held = n
    if verbose:
        print(result.table())
    return result


def _walk(actions: list[Action], memory: list[StageFootprint]) -> tuple[int, int, dict[int, int]]:
    """Follow one worker's list: peak bytes, microbatches held then, and per stage how many."""
    stash = {st.stage: st.activation_bytes for st in memory}
    return walk(actions, stash, {st.stage: st.split_bytes for st in memory})


def _measure(
    shards: list[ShardedTask], piece: Any, checkpoint: list[bool], split_backward: bool
) -> list[StageFootprint]:
    """Run each stage once on ``piece`` as a worker would; parameters and buffers are left as they were."""
    buffers = [(b, b.detach().clone()) for shard in shards for b in shard.module.buffers()]
    result = []
    try:
        with torch.random.fork_rng(devices=[]):
            inputs, mask = tree.detach(piece), tree.grad_mask(piece)
            for shard in shards:
                params = list(shard.module.parameters())
                leaves = tree.as_leaves(inputs, mask)
                with torch.enable_grad():
                    outputs = call_module(shard.module, leaves)
                full = stash_bytes(Activation(leaves, outputs), params)
                stashed = stash_bytes(Activation(leaves), params) if checkpoint[shard.index] else full
                extra = full - stashed if split_backward else 0
                if split_backward:
                    flat = tree.flatten(outputs)[0]
                    grads = [_ones_if_grad(t) for t in flat]
                    _, work = backward_input(flat, grads, tree.flatten(leaves)[0], params)
                    extra += work.nbytes()
                param_bytes = sum(p.numel() * p.element_size() for p in params)
                result.append(StageFootprint(shard.index, 0, list(shard.layers), param_bytes, stashed, extra))
                inputs = tree.detach(outputs)
                if checkpoint[shard.index]:  # as the worker: a checkpointed stage's forward ran without grad
                    mask = [isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree.flatten(outputs)[0]]
                else:
                    mask = tree.grad_mask(outputs)
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return result


def _ones_if_grad(t: Any) -> torch.Tensor | None:
    return torch.ones_like(t) if isinstance(t, torch.Tensor) and t.requires_grad else None
