"""Cutting a traced graph into consecutive stages, each an ``nn.Module`` over the values that cross.

A cut is a node position: nodes before it run in earlier stages. Every value made before a cut and
used after it *crosses* the cut, so a value that several later stages need (a mask, a residual,
position ids) is forwarded through the stages in between. Stage ``k`` takes the values crossing
cut ``k - 1`` as positional arguments (stage 0 takes the graph inputs) and returns the values
crossing cut ``k`` as a tuple (the last stage returns the graph outputs). Parameters and buffers are
never sent: each stage reads (``get_attr``) the ones it uses, so a weight used by two stages (a tied
embedding and head) is the same ``Parameter`` in both.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.graph_module import _format_import_block, _forward_from_src
from torch.package import sys_importer

from lightning_pipe.base.errors import PartitionError
from lightning_pipe.rng.detect import random_calls

CutKey = tuple[str, str, int]  # (op, target, occurrence) of the first node of a stage


def candidates(graph: fx.Graph) -> list[int]:
    """Positions where a stage may start: each leaf-module call after the first."""
    nodes = list(graph.nodes)
    calls = [i for i, n in enumerate(nodes) if n.op == "call_module"]
    return calls[1:]


def unit_names(graph: fx.Graph) -> list[str]:
    """The leaf-module calls in graph order: the layers that balancing distributes."""
    return [str(n.target) for n in graph.nodes if n.op == "call_module"]


def key_of(graph: fx.Graph, position: int) -> CutKey:
    """A name for a cut that also finds it in the eval-mode graph of the same model."""
    nodes = list(graph.nodes)
    node = nodes[position]
    seen = sum(1 for n in nodes[:position] if n.op == node.op and n.target == node.target)
    return (node.op, str(node.target), seen)


def find_key(graph: fx.Graph, key: CutKey) -> int:
    op, target, occurrence = key
    seen = 0
    for i, node in enumerate(graph.nodes):
        if node.op == op and str(node.target) == target:
            if seen == occurrence:
                return i
            seen += 1
    raise PartitionError(
        f"the stage boundary before {target!r} exists in training mode but not in eval mode (the forward calls "
        "other modules when not training); give split_points at modules that both modes call"
    )


def scope_start(graph: fx.Graph, name: str) -> int:
    """Position of the first node that belongs to the submodule ``name`` (split before it)."""
    for i, node in enumerate(graph.nodes):
        if node.op == "call_module" and (node.target == name or str(node.target).startswith(name + ".")):
            return i
        stack = node.meta.get("nn_module_stack", {})
        if any(path == name for path, _ in stack.values()):
            return i
    raise PartitionError(f"split point {name!r} is not called by the traced forward")


def scope_key(graph: fx.Graph, name: str) -> CutKey:
    return key_of(graph, scope_start(graph, name))


def split(graph: fx.Graph, cuts: Sequence[int]) -> list[fx.Graph]:
    """Cut ``graph`` before each position in ``cuts`` (increasing); one graph per stage."""
    nodes = list(graph.nodes)
    cuts = list(cuts)
    if cuts != sorted(set(cuts)) or (cuts and (cuts[0] <= 0 or cuts[-1] >= len(nodes) - 1)):
        raise PartitionError(f"stage boundaries {cuts} are not increasing positions inside the graph")
    num_stages = len(cuts) + 1
    output = nodes[-1]
    stage = {node: bisect.bisect_right(cuts, i) for i, node in enumerate(nodes)}
    for node in nodes:
        if node.op == "placeholder":
            stage[node] = 0
    stage[output] = num_stages - 1
    # the last stage that reads each value (get_attr nodes are read where used, never sent)
    last_use = {node: max((stage[u] for u in node.users), default=stage[node]) for node in nodes}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    graphs = []
    for k in range(num_stages):
        if k == 0:
            inputs = placeholders
        else:
            inputs = [n for n in nodes if _sent(n) and stage[n] < k <= last_use[n]]
        if k == num_stages - 1:
            outputs: Any = output.args[0]
        else:
            outputs = tuple(n for n in nodes if _sent(n) and stage[n] <= k < last_use[n])
        body = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr") and stage[n] == k]
        if not body and k > 0:
            raise PartitionError(f"stage {k} would be empty; use fewer stages or other split points")
        graphs.append(_stage_graph(inputs, body, outputs))
    return graphs


def _sent(node: fx.Node) -> bool:
    return node.op not in ("get_attr", "output")


def _stage_graph(inputs: Sequence[fx.Node], body: Sequence[fx.Node], outputs: Any) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise AssertionError(f"value {node.name} is neither an input nor made in this stage")
            env[node] = graph.node_copy(node)
        return env[node]

    for node in body:
        env[node] = graph.node_copy(node, lookup)
    graph.output(fx.map_arg(outputs, lookup))
    return graph


class TracedShard(nn.Module):
    """One stage of a traced model: the original submodules, parameters and buffers its part of the
    graph uses (under their original names, so ``state_dict`` keys match the unsplit model), and the
    generated code of that part for each call variant (one per way the model is called), in a
    training and an eval version.

    ``forward(variant, *values)`` runs the variant's code and returns ``(variant, *values)``: the
    variant index travels through the pipeline with the data.
    """

    def __init__(self, root: nn.Module, graphs: dict[bool, fx.Graph], constants: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._sources: dict[tuple[int, bool], str] = {}
        self.add_variant(0, root, graphs, constants)
        self.inputs = [n.name for n in graphs[True].nodes if n.op == "placeholder"]
        self.leaf_calls = [str(n.target) for n in graphs[True].nodes if n.op == "call_module"]

    def add_variant(
        self, variant: int, root: nn.Module, graphs: dict[bool, fx.Graph], constants: dict[str, torch.Tensor]
    ) -> None:
        """Adopt what the variant's graphs use from ``root`` and compile their code."""
        targets = {str(n.target) for g in graphs.values() for n in g.nodes if n.op in ("call_module", "get_attr")}
        for target in sorted(targets, key=lambda t: t.count(".")):
            self._adopt(root, target, constants)
        self.install(variant, {mode: _source(graph) for mode, graph in graphs.items()})
        # what the stage's code can draw, for its random generators (lightning_pipe.rng.detect)
        called = {str(n.target) for g in graphs.values() for n in g.nodes if n.op == "call_module"}
        self.called_modules = sorted(set(getattr(self, "called_modules", ())) | called)
        drawn = getattr(self, "random_calls", [])
        self.random_calls = None if drawn is None else sorted(set(drawn) | set(random_calls(graphs.values())))

    def install_with_constants(self, variant: int, sources: dict[bool, str], constants: dict[str, Any]) -> None:
        """A variant traced in another process: its code and the constants it reads (a stage of transport="rpc")."""
        for target in sorted(constants, key=lambda t: t.count(".")):
            self._adopt(self, target, constants)
        self.install(variant, sources)
        self.random_calls = None  # code without its graph: what it draws shows when it runs

    def install(self, variant: int, sources: dict[bool, str]) -> None:
        """Add a variant's generated code (the attributes it reads must be there already)."""
        for mode, src in sources.items():
            self._sources[(variant, mode)] = src
        self._compile()
        self.code_version = getattr(self, "code_version", 0) + 1

    def forward(self, variant: int, *inputs: Any) -> tuple[Any, ...]:
        code = self._forward.get((variant, self.training))
        if code is None:
            raise PartitionError(
                f"this stage has no code for call variant {variant}: the pipelined module was called in a new way "
                "after its stages were built in another process; call it the same way every time (or trace each "
                "way first)"
            )
        return (variant, *code(self, *inputs))

    def code(self, training: bool = True, variant: int = 0) -> str:
        """The generated forward of this stage (for reading and debugging)."""
        return self._sources[(variant, training)]

    def _compile(self) -> None:
        self._forward: dict[tuple[int, bool], Callable[..., Any]] = {
            key: _forward_from_src(src, {}) for key, src in self._sources.items()
        }

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_forward", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._compile()

    def _adopt(self, root: nn.Module, target: str, constants: dict[str, torch.Tensor]) -> None:
        """Make ``self.<target>`` the object ``root.<target>`` (creating empty parent modules as needed)."""
        atoms = target.split(".")
        owner: nn.Module = self
        for atom in atoms[:-1]:
            child = owner._modules.get(atom)
            if child is None:
                child = _Path()
                owner.add_module(atom, child)
            elif not isinstance(child, _Path):
                return  # an adopted original module already holds the rest of the path
            owner = child
        name = atoms[-1]
        value = constants[target] if target in constants else _fetch(root, target)
        if isinstance(owner._modules.get(name), _Path) and isinstance(value, nn.Module):
            owner._modules[name] = value  # the whole module now: it holds what the path stood for
            return
        if name in owner._modules or name in owner._parameters or name in owner._buffers:
            return
        parent = root.get_submodule(".".join(atoms[:-1])) if len(atoms) > 1 else root
        if isinstance(value, nn.Module):
            owner.add_module(name, value)
        elif isinstance(value, nn.Parameter):
            owner.register_parameter(name, value)
        elif isinstance(value, torch.Tensor):
            persistent = name in parent._buffers and name not in parent._non_persistent_buffers_set
            owner.register_buffer(name, value, persistent=persistent)
        else:
            setattr(owner, name, value)


class _Path(nn.Module):
    """An empty module standing for a parent on the path to an adopted submodule or tensor."""


def _source(graph: fx.Graph) -> str:
    code = graph.python_code(root_module="self")
    return _format_import_block(code.globals, sys_importer) + "\n" + code.src


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj
