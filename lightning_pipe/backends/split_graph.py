"""Partition a compiled backward graph into an input-gradient graph (``I``) and a weight-gradient graph (``W``).

``I`` is every node the input gradients need, and also returns the values of its own that ``W`` reads;
``W`` is every other node the weight gradients need. No node runs in both, so ``I`` plus ``W`` do one
backward's work (the method and why: docs/backends.md, "Split backward of compiled stages").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx


@dataclass
class SplitGraphs:
    """The two halves and how their inputs and outputs map onto the backward graph's."""

    input_graph: fx.GraphModule  # returns (*input gradients, *boundary values)
    weight_graph: fx.GraphModule  # reads (*weight_placeholders, *boundary values), returns the weight gradients
    input_placeholders: list[int]  # positions among the backward's placeholders that I reads
    weight_placeholders: list[int]  # positions among the backward's placeholders that W reads
    input_outputs: list[int]  # positions among the backward's outputs that I computes
    weight_outputs: list[int]  # positions among the backward's outputs that W computes
    outputs: int  # the backward's output count (one per forward input)
    boundary: list[fx.Node]  # I's nodes that W reads (``meta["val"]``: their fake values)


def split_backward_graph(gm: fx.GraphModule, is_weight: Sequence[bool]) -> SplitGraphs:
    """Partition ``gm`` (outputs one gradient per forward input; ``is_weight[i]``: input i is a parameter).

    AOTAutograd's backward graph reads the tensors the forward saved and the output gradients (tangents) and
    returns one gradient per forward input. ``I`` takes the nodes the input gradients need; of those, the
    ones a weight gradient reads (typically the gradient of a layer's pre-activation, which the weight
    gradient multiplies by the layer's saved input) are the *boundary*, returned by ``I`` as extra outputs.
    ``W`` takes the remaining nodes the weight gradients need and reads the boundary instead of recomputing
    it. It is torch.distributed.pipelining's eager split (`stage_backward_input`/`stage_backward_weight`,
    which cut the autograd graph at the same boundary and keep it with ``retain_graph``) done on the compiled
    graph, where nothing can be retained: the halves become two graphs that inductor compiles separately.
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    outs = list(nodes[-1].args[0])
    if len(outs) != len(is_weight):
        raise ValueError(f"the backward returns {len(outs)} gradients for {len(is_weight)} forward inputs")
    input_outputs = [i for i, o in enumerate(outs) if isinstance(o, fx.Node) and not is_weight[i]]
    weight_outputs = [i for i, o in enumerate(outs) if isinstance(o, fx.Node) and is_weight[i]]
    in_set = _ancestors([outs[i] for i in input_outputs])
    w_set = _ancestors([outs[i] for i in weight_outputs])
    w_only = [n for n in nodes if n in w_set and n not in in_set and n.op != "placeholder"]
    w_only_set = set(w_only)
    w_results = {outs[i] for i in weight_outputs}
    read_by_w = [
        n
        for n in nodes
        if n.op != "output"
        and n not in w_only_set
        and n in w_set
        and (n in w_results or any(u in w_only_set for u in n.users))
    ]
    from_backward = [n for n in read_by_w if n.op == "placeholder"]
    boundary = [n for n in read_by_w if n.op != "placeholder"]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n in in_set:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[outs[i]] for i in input_outputs) + tuple(env[n] for n in boundary))
    weight = fx.Graph()
    wenv: dict[fx.Node, fx.Node] = {}
    for n in from_backward:
        wenv[n] = weight.node_copy(n, wenv.__getitem__)
    for n in boundary:
        wenv[n] = weight.placeholder(f"from_input_{n.name}")
        wenv[n].meta.update(n.meta)
    for n in w_only:
        wenv[n] = weight.node_copy(n, wenv.__getitem__)
    weight.output(tuple(wenv[outs[i]] for i in weight_outputs))
    position = {n: k for k, n in enumerate(placeholders)}
    halves = fx.GraphModule(gm, graph), fx.GraphModule(gm, weight)
    for half in halves:
        half.graph.output_node().meta["user_visible_output_idxs"] = []
    return SplitGraphs(
        halves[0],
        halves[1],
        [position[n] for n in placeholders if n in in_set],
        [position[n] for n in from_backward],
        input_outputs,
        weight_outputs,
        len(outs),
        boundary,
    )


def _ancestors(outputs: list[fx.Node]) -> set[fx.Node]:
    """``outputs`` and every node they read, transitively."""
    seen: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen
