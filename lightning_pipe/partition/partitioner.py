"""The `Partitioner`: model -> shards (`ShardedTask`), each paired with its executor modules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_pipe.base.errors import PartitionError
from lightning_pipe.engine.executors import BackwardModule, ForwardLossModule, ForwardModule
from lightning_pipe.partition.balance import balance_by_cost, memory_costs, param_costs, time_costs

METHODS = ("uniform", "params", "memory", "time")


@dataclass
class ShardedTask:
    """One shard of the model: its index, module, device, and the executor modules that run it."""

    index: int
    module: nn.Module
    device: str
    forward: Any
    backward: Any
    forward_loss: Any | None = None
    layers: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        names = f"{self.layers[0]}..{self.layers[-1]}" if self.layers else "?"
        return f"ShardedTask(index={self.index}, layers={names}, device={self.device!r})"


class Partitioner:
    """Splits an ``nn.Sequential`` into contiguous shards.

    ``method`` is ``"uniform"`` (layer count), ``"params"`` (parameter count), ``"memory"``
    (parameters and activations on a sample batch), ``"time"`` (profiled forward and backward on a
    sample batch) or an explicit list of layer counts. Subclass and override `executors` (or pass
    the classes) to pair shards with your own executor modules.
    """

    def __init__(
        self,
        method: str | Sequence[int] = "params",
        forward_cls: type = ForwardModule,
        backward_cls: type = BackwardModule,
        forward_loss_cls: type = ForwardLossModule,
    ) -> None:
        if isinstance(method, str):
            if method not in METHODS:
                raise PartitionError(
                    f"unknown partition method {method!r}; available: {', '.join(METHODS)}, "
                    "a list of layer counts such as [3, 5], or a Partitioner instance"
                )
        else:
            method = [int(n) for n in method]
        self.method = method
        self.forward_cls = forward_cls
        self.backward_cls = backward_cls
        self.forward_loss_cls = forward_loss_cls

    @property
    def needs_sample(self) -> bool:
        """Whether balancing runs the model on a sample batch."""
        return self.method in ("memory", "time")

    def check(self, module: nn.Module, num_shards: int) -> None:
        """Fail early (before any work) if ``module`` cannot be cut into ``num_shards`` shards."""
        layers = self._layers(module)
        if num_shards > len(layers):
            raise PartitionError(
                f"stages={num_shards} but the pipelined module has only {len(layers)} layers; "
                f"pass stages <= {len(layers)} or split the model into more layers"
            )
        if isinstance(self.method, list):
            balance = self.method
            if len(balance) != num_shards:
                raise PartitionError(
                    f"partition={balance} has {len(balance)} entries but stages={num_shards}; "
                    f"give one layer count per stage"
                )
            if any(n < 1 for n in balance):
                raise PartitionError(f"partition={balance}: every stage needs at least one layer")
            if sum(balance) != len(layers):
                raise PartitionError(
                    f"partition={balance} sums to {sum(balance)} but the model has {len(layers)} layers; "
                    f"pass a balance that sums to {len(layers)} or partition='params'"
                )

    def balance(self, module: nn.Module, num_shards: int, sample: Any = None) -> list[int]:
        """Layer counts per shard."""
        self.check(module, num_shards)
        layers = self._layers(module)
        if isinstance(self.method, list):
            return list(self.method)
        if self.method == "uniform":
            costs = [1.0] * len(layers)
        elif self.method == "params":
            costs = param_costs(layers)
        else:
            if sample is None:
                raise PartitionError(f"partition={self.method!r} needs a sample batch to measure the layers")
            costs = memory_costs(layers, sample) if self.method == "memory" else time_costs(layers, sample)
        return balance_by_cost(costs, num_shards)

    def partition(self, module: nn.Module, devices: Sequence[str], sample: Any = None) -> list[ShardedTask]:
        """Cut ``module`` into ``len(devices)`` shards; the shards share the module's layers."""
        balance = self.balance(module, len(devices), sample)
        named = list(module.named_children())
        shards, start = [], 0
        for index, (count, device) in enumerate(zip(balance, devices, strict=True)):
            part = named[start : start + count]
            start += count
            shard = nn.Sequential()
            for name, layer in part:
                shard.add_module(name, layer)
            forward, backward, forward_loss = self.executors(index, len(devices))
            shards.append(ShardedTask(index, shard, str(device), forward, backward, forward_loss, [n for n, _ in part]))
        return shards

    def executors(self, index: int, num_shards: int) -> tuple[Any, Any, Any | None]:
        """The executor modules of shard ``index``; the last shard also gets the forward-loss module."""
        last = self.forward_loss_cls(index) if index == num_shards - 1 else None
        return self.forward_cls(index), self.backward_cls(index), last

    @staticmethod
    def _layers(module: nn.Module) -> list[nn.Module]:
        if not isinstance(module, nn.Sequential):
            raise PartitionError(
                f"the pipelined module is a {type(module).__name__}, not an nn.Sequential; "
                "wrap its layers in nn.Sequential or choose another module with PipeStrategy(module=...)"
            )
        return list(module.children())
