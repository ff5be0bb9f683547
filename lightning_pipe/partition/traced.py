"""`TracedPartitioner`: splits any ``nn.Module`` (not only ``nn.Sequential``) through its traced graph.

The model is traced on one example call (`tracer.trace`), cut before the named ``split_points`` or
at leaf-module calls chosen by the same balancing methods as for ``nn.Sequential`` (``uniform``,
``params``, ``memory``, ``time`` or a list of leaf-call counts), and each part becomes a
`TracedShard`. The shards take and return flat tuples; `pack` turns a call's ``(args, kwargs)`` into
the first shard's inputs and `unpack` rebuilds the model's output (tensor, tuple, dict, dataclass)
from the last shard's outputs.

Tied weights (an embedding and an output head sharing one ``Parameter``) stay one object in every
shard that uses them; `tied` lists where (see `partition.tied`).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from lightning_pipe.base import tree
from lightning_pipe.base.errors import PartitionError
from lightning_pipe.engine.executors import BackwardModule, ForwardLossModule, ForwardModule, call_module
from lightning_pipe.partition import cut
from lightning_pipe.partition.balance import balance_by_cost, memory_costs, param_costs, time_costs
from lightning_pipe.partition.explain import check_close, warn_about
from lightning_pipe.partition.kv_cache import builds_kv_cache, without_kv_cache
from lightning_pipe.partition.partitioner import Partitioner, ShardedTask
from lightning_pipe.partition.tied_parameters import tied_parameters
from lightning_pipe.partition.tracer import (
    CallArgs,
    LeafSpec,
    Signature,
    Traced,
    class_forward,
    preserved,
    trace,
)


class TracedPartitioner(Partitioner):
    """Splits any module by tracing it on an example call (the ``sample`` given to `partition`).

    ``split_points`` names the submodules before which a new stage starts (``["blocks.2",
    "blocks.4"]`` gives three stages); without them ``method`` balances the leaf-module calls.
    ``leaf_modules`` (qualified names or classes) are kept whole: tracing does not enter them, and no
    stage boundary falls inside them. ``check=True`` runs the split model on the example and compares
    its output with the unsplit model's before any stage is started.

    A call that differs from the example in its arguments (keywords given or left out, other
    constants such as ``scale=0.5``) is traced as one more *variant* and cut at the same places; every
    stage keeps the code of each variant, and the variant's index travels with the microbatch.
    """

    max_variants = 8

    def __init__(
        self,
        method: str | Sequence[int] = "params",
        split_points: Sequence[str] | None = None,
        leaf_modules: Sequence[LeafSpec] = (),
        forward_cls: type = ForwardModule,
        backward_cls: type = BackwardModule,
        forward_loss_cls: type = ForwardLossModule,
        check: bool = True,
    ) -> None:
        super().__init__(method, forward_cls, backward_cls, forward_loss_cls)
        self.split_points = list(split_points) if split_points else None
        self.leaf_modules = list(leaf_modules)
        self.validate = check
        self.variants: list[dict[bool, Traced]] = []  # per way of calling the module: its traces by mode
        self.tied: list[list[tuple[int, str]]] = []
        self._module: nn.Module | None = None
        self._cacheless: nn.Module | None = None  # a HF model called with use_cache=False (see kv_cache)
        self._shards: list[cut.TracedShard] = []
        self._keys: list[cut.CutKey] = []  # where the stages start, found again in every variant's graphs

    @property
    def needs_sample(self) -> bool:
        return True

    @property
    def traced(self) -> dict[bool, Traced]:
        """The traces of the first call (training and eval mode)."""
        return self.variants[0] if self.variants else {}

    @property
    def signature(self) -> Signature | None:
        return self.variants[0][True].signature if self.variants else None

    def check(self, module: nn.Module, num_shards: int) -> None:
        if self.split_points is not None and len(self.split_points) != num_shards - 1:
            raise PartitionError(
                f"split_points={self.split_points} make {len(self.split_points) + 1} stages but stages={num_shards}; "
                f"give stages - 1 = {num_shards - 1} split points"
            )
        if isinstance(self.method, list) and len(self.method) != num_shards:
            raise PartitionError(
                f"partition={self.method} has {len(self.method)} entries but stages={num_shards}; "
                "give one leaf-call count per stage"
            )

    # tracing
    def trace(self, module: nn.Module, sample: Any) -> Traced:
        """Trace ``module`` on ``sample`` (a tensor, a tuple of positional arguments or a `CallArgs`)."""
        if sample is None:
            raise PartitionError(
                f"splitting a {type(module).__name__} (not an nn.Sequential) traces it on an example call; "
                "pass sample=CallArgs(args, kwargs) (or a tensor / tuple of positional arguments)"
            )
        self.variants = []
        self._cacheless = module if builds_kv_cache(module) else None
        call = CallArgs.of(sample)
        if self._call(call) is not call:
            warnings.warn(
                f"{type(module).__name__} is called with use_cache=False: its key/value cache serves generation, "
                "training does not read it, and it cannot be cut into stages (past_key_values is None)",
                stacklevel=2,
            )
        self.variants.append(self._trace(module, call))
        return self.variants[0][True]

    def _trace(self, module: nn.Module, call: CallArgs) -> dict[bool, Traced]:
        call = _on_module_device(self._call(call), module)
        points = self.split_points or ()
        traced = {mode: trace(module, call, self.leaf_modules, mode, points) for mode in (True, False)}
        for mode, t in traced.items():  # each trace numbers its constants from 0: make the names unique
            _rename_constants(t, f"_v{len(self.variants)}_{'train' if mode else 'eval'}")
        t = traced[True]
        warn_about(type(module).__name__, t.kept_whole, t.unrolled, t.data_dependent)
        return traced

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The first shard's inputs for the call ``module(*args, **kwargs)``: ``(variant, *tensors)``."""
        if not self.variants:
            raise PartitionError("the model is not traced yet; call partition() first")
        call = self._call(CallArgs(tuple(args), dict(kwargs)))
        for variant, traced in enumerate(self.variants):
            signature = traced[True].signature
            if signature.matches(call):
                return (variant, *signature.tensors(call))
        variant = self._add_variant(call)
        return (variant, *self.variants[variant][True].signature.tensors(call))

    def _call(self, call: CallArgs) -> CallArgs:
        """The call as the stages run it."""
        return call if self._cacheless is None else without_kv_cache(self._cacheless, call)

    def unpack(self, outputs: Any) -> Any:
        """The model's output rebuilt from the last shard's outputs ``(variant, *values)``."""
        variant, *flat = outputs
        return self.variants[variant][True].signature.unflatten_output(flat)

    # cutting
    def cuts(self, module: nn.Module, num_shards: int, sample: Any = None) -> list[int]:
        """Node positions in the first call's training graph where stages 1.. start."""
        self.check(module, num_shards)
        graph = self.traced[True].graph
        if self.split_points is not None:
            return self._split_positions(graph)
        counts = self.balance(module, num_shards, sample)
        calls = [i for i, n in enumerate(graph.nodes) if n.op == "call_module"]
        return [calls[c] for c in itertools.accumulate(counts[:-1])]

    def _split_positions(self, graph: fx.Graph) -> list[int]:
        assert self.split_points is not None
        positions = [cut.scope_start(graph, name) for name in self.split_points]
        if positions != sorted(set(positions)):
            raise PartitionError(
                f"split_points={self.split_points} are not in the order the forward calls them "
                f"(or name the same stage boundary twice); order them as called: {_order(graph, self.split_points)}"
            )
        if positions and positions[0] <= _first_call(graph):
            raise PartitionError(
                f"split point {self.split_points[0]!r} is the first layer the forward calls: stage 0 would be "
                "empty; split after it"
            )
        return positions

    def _positions(self, graph: fx.Graph) -> list[int]:
        """The stage boundaries in any variant's graph."""
        if self.split_points is not None:
            return self._split_positions(graph)
        return [cut.find_key(graph, key) for key in self._keys]

    def balance(self, module: nn.Module, num_shards: int, sample: Any = None) -> list[int]:
        """Leaf-module calls per shard."""
        self.check(module, num_shards)
        if not self.variants:
            self.trace(module, sample)
        graph = self.traced[True].graph
        names = cut.unit_names(graph)
        if num_shards == 1:
            return [len(names)]
        if num_shards > len(names):
            raise PartitionError(
                f"stages={num_shards} but the traced {type(module).__name__} calls only {len(names)} layers "
                f"({', '.join(names)}); pass stages <= {len(names)}, or trace into bigger layers by naming their "
                "children as split points"
            )
        if isinstance(self.method, list):
            if sum(self.method) != len(names) or any(n < 1 for n in self.method):
                raise PartitionError(
                    f"partition={self.method} must give each stage at least one layer and sum to the {len(names)} "
                    f"layers the traced forward calls ({', '.join(names)})"
                )
            return list(self.method)
        if self.method == "uniform":
            costs = [1.0] * len(names)
        else:
            units = self._units(module)
            flat = self._example_inputs()
            with preserved(module):
                if self.method == "params":
                    costs = param_costs(units)
                elif self.method == "memory":
                    costs = memory_costs(units, flat)
                else:
                    costs = time_costs(units, flat)
        return balance_by_cost(costs, num_shards)

    def partition(self, module: nn.Module, devices: Sequence[str], sample: Any = None) -> list[ShardedTask]:
        """Trace ``module`` on ``sample`` and cut it into ``len(devices)`` shards sharing its parameters."""
        num_shards = len(devices)
        self.check(module, num_shards)
        self.trace(module, sample)
        graph = self.traced[True].graph
        self._keys = [cut.key_of(graph, p) for p in self.cuts(module, num_shards, sample)]
        graphs = self._stage_graphs(self.traced)
        constants = _constants(self.traced)
        self._module = module
        self._shards = [
            cut.TracedShard(module, {mode: graphs[mode][k] for mode in graphs}, constants) for k in range(num_shards)
        ]
        if self.validate:
            self._compare(module, 0)
        self.tied = tied_parameters(self._shards)
        shards = []
        for index, (shard, device) in enumerate(zip(self._shards, devices, strict=True)):
            forward, backward, forward_loss = self.executors(index, num_shards)
            shards.append(ShardedTask(index, shard, str(device), forward, backward, forward_loss, shard.leaf_calls))
        return shards

    def _stage_graphs(self, traced: dict[bool, Traced]) -> dict[bool, list[fx.Graph]]:
        return {mode: cut.split(t.graph, self._positions(t.graph)) for mode, t in traced.items()}

    def _add_variant(self, call: CallArgs) -> int:
        """Trace another way of calling the module and give every shard its code (shards of this process)."""
        module = self._module
        if module is None:
            raise PartitionError("the model is not partitioned yet; call partition() first")
        if len(self.variants) >= self.max_variants:
            raise PartitionError(
                f"the pipelined module was called in {len(self.variants) + 1} different ways (other keyword "
                "arguments or other non-tensor values); each way is traced once, so non-tensor arguments that change "
                "every call (a step counter) cannot be pipelined: pass them as tensors"
            )
        traced = self._trace(module, call)
        graphs = self._stage_graphs(traced)
        variant = len(self.variants)
        self.variants.append(traced)
        for k, shard in enumerate(self._shards):
            shard.add_variant(variant, module, {mode: graphs[mode][k] for mode in graphs}, _constants(traced))
        if self.validate:
            self._compare(module, variant)
        return variant

    def variant_update(self, index: int, variant: int) -> tuple[dict[bool, str], dict[str, Any]]:
        """What a copy of shard ``index`` made before ``variant`` was traced (a stage in another process)
        needs to run it: the variant's code per mode and the constants that code reads."""
        shard = self._shards[index]
        constants = {t: v for t, v in _constants(self.variants[variant]).items() if _holds(shard, t)}
        return {mode: shard.code(mode, variant) for mode in (True, False)}, constants

    # helpers
    def _units(self, module: nn.Module) -> list[nn.Module]:
        graph = self.traced[True].graph
        return [
            cut.TracedShard(module, {True: g, False: g}, self.traced[True].constants)
            for g in cut.split(graph, cut.candidates(graph))
        ]

    def _example_inputs(self) -> tuple[Any, ...]:
        traced = self.traced[True]
        return (0, *traced.signature.tensors(traced.call))

    def _compare(self, module: nn.Module, variant: int) -> None:
        """Run the stages one after another on the example and compare with the unsplit model (a model built on
        meta has no values to compare: its stages are made real where they run)."""
        if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            return
        traced = self.variants[variant][True]
        for training in (False, True):
            with preserved(module), torch.no_grad():
                module.train(training)
                for shard in self._shards:
                    shard.train(training)
                with torch.random.fork_rng(devices=[]):
                    expected = class_forward(module)(*traced.call.args, **traced.call.kwargs)
                with torch.random.fork_rng(devices=[]):
                    x: Any = (variant, *traced.signature.tensors(traced.call))
                    for shard in self._shards:
                        x = call_module(shard, x)
                    got = self.unpack(x)
            check_close(type(module).__name__, expected, got, training)
        for shard in self._shards:
            shard.train(module.training)


def _rename_constants(traced: Traced, prefix: str) -> None:
    for node in traced.graph.nodes:
        if node.op == "get_attr" and node.target in traced.constants:
            node.target = prefix + node.target
    traced.constants = {prefix + name: value for name, value in traced.constants.items()}


def _holds(module: nn.Module, target: str) -> bool:
    obj: Any = module
    for atom in target.split("."):
        if not hasattr(obj, atom):
            return False
        obj = getattr(obj, atom)
    return True


def _constants(traced: dict[bool, Traced]) -> dict[str, Any]:
    return {**traced[False].constants, **traced[True].constants}


def _on_module_device(call: CallArgs, module: nn.Module) -> CallArgs:
    """The example where the module is: the strategy hands over batches on the last stage's device while the
    module waits on the cpu for its stages to place it. A module built on meta is traced where the example is
    (its layers get values there while they run: `stand_in_values`)."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    if first is None or first.is_meta:
        return call
    args, kwargs = tree.map_tensors(lambda t: t.to(first.device), (call.args, call.kwargs))
    return CallArgs(tuple(args), dict(kwargs))


def _first_call(graph: fx.Graph) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n.op == "call_module")


def _order(graph: fx.Graph, names: Sequence[str]) -> list[str]:
    return sorted(names, key=lambda name: cut.scope_start(graph, name))
