"""Split backward (zero-bubble): a stage's input gradient now (``I``), its weight gradient later (``W``).

``backward_input`` walks the stage's autograd graph once: it finds, for every parameter, the nodes
where the parameter's gradient path leaves the input-to-output path (the *boundary* nodes), hooks
them, and computes the input gradients with the graph retained. The hooks capture the gradient
arriving at each boundary node. ``backward_weight`` then starts autograd at those nodes
(`GradientEdge`) and runs only the weight part of the graph, one group of parameters at a time, so
``I`` plus ``W`` cost about one ordinary backward. When no stage input needs a gradient (the first
stage) there is no input part: ``I`` does nothing and ``W`` runs the whole backward. A graph holding
compiled nodes is split by the compiled graphs themselves (`backends.split_compile`); one that cannot
split computes every gradient in ``I``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from lightning_pipe.backends.split_compile import DeferredWeight, compiled_nodes, defer_weights, run_deferred

Grads = list[torch.Tensor | None]


@dataclass(eq=False)
class _Group:
    """Parameters whose gradient paths leave the input path at the same boundary nodes."""

    params: list[torch.Tensor]
    nodes: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightGradient:
    """What ``I`` leaves for ``W``: the captured boundary gradients, or the whole backward to run."""

    groups: list[_Group] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)  # whole backward in W (first stage)
    output_grads: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    deferred: list[DeferredWeight] = field(default_factory=list)  # compiled W graphs still to run

    def nbytes(self) -> int:
        """Bytes of the gradients kept for ``W`` (the captured ones, the output gradients, compiled boundaries)."""
        tensors = [g for group in self.groups for grads in group.grads.values() for g in grads if g is not None]
        kept = sum(t.numel() * t.element_size() for t in [*tensors, *self.output_grads])
        return kept + sum(d.nbytes for d in self.deferred)


def backward_input(
    outputs: Sequence[torch.Tensor | object],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor | object],
    params: Iterable[torch.Tensor],
) -> tuple[Grads, WeightGradient]:
    """Gradients of the stage inputs (None where none flows) and the pending weight gradient."""
    pairs = [
        (out, g)
        for out, g in zip(outputs, grads, strict=True)
        if isinstance(out, torch.Tensor) and out.requires_grad and g is not None
    ]
    trainable = [p for p in params if p.requires_grad]
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not pairs:
        return [None] * len(inputs), WeightGradient()
    outs, out_grads = [p[0] for p in pairs], [p[1] for p in pairs]
    if not wanted:
        return [None] * len(inputs), WeightGradient(outputs=outs, output_grads=out_grads, params=trainable)
    compiled = compiled_nodes(_grad_node(t) for t in outs)
    if compiled:
        return _compiled_input(outs, out_grads, inputs, wanted, trainable, compiled)
    groups, handles = _hook_boundaries(outs, out_grads, wanted, trainable)
    try:
        computed = torch.autograd.grad(outs, wanted, out_grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    by_id = {id(t): g for t, g in zip(wanted, computed, strict=True)}
    input_grads: Grads = [by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in inputs]
    return input_grads, WeightGradient(groups=groups)


def backward_weight(work: WeightGradient) -> None:
    """Accumulate the parameter gradients left pending by `backward_input` into ``p.grad``."""
    if work.deferred:
        run_deferred(work.deferred)
    if work.outputs:
        torch.autograd.backward(work.outputs, work.output_grads, inputs=work.params)
        return
    for group in work.groups:
        edges, seeds = [], []
        for node in group.nodes:
            for i, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        if not edges:
            continue
        # a boundary node downstream of another one would also receive the upstream node's
        # contribution: pin each node's incoming gradient to the captured value
        handles = [n.register_prehook(_pin(group.grads[n])) for n in group.nodes if n in group.grads]
        try:
            # autograd accumulates into p.grad under the parameter's own lock: a parameter that another stage
            # thread of this process also holds (a tied weight) may be accumulated there at the same time
            torch.autograd.backward(edges, seeds, retain_graph=True, inputs=group.params)
        finally:
            for handle in handles:
                handle.remove()


def _compiled_input(
    outs: list[torch.Tensor],
    out_grads: list[torch.Tensor],
    inputs: Sequence[torch.Tensor | object],
    wanted: list[torch.Tensor],
    params: list[torch.Tensor],
    compiled: list[Node],
) -> tuple[Grads, WeightGradient]:
    """``I`` over a graph with compiled nodes: one backward, the split compiled nodes leaving their ``W``.

    A compiled node's backward cannot run twice on one graph (``retain_graph`` over it is refused), so
    there is no boundary walk here: what is split is split inside the compiled graphs; eager parameters of
    the stage, and compiled graphs that are not split, get their gradients now.
    """
    with defer_weights(compiled) as deferred:
        torch.autograd.backward(outs, out_grads, inputs=[*wanted, *params])
    got = {id(t): t.grad for t in wanted}
    for t in wanted:
        t.grad = None
    input_grads: Grads = [got.get(id(t)) if isinstance(t, torch.Tensor) else None for t in inputs]
    return input_grads, WeightGradient(deferred=deferred)


def _hook_boundaries(
    outs: list[torch.Tensor], out_grads: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]
) -> tuple[list[_Group], list[torch.utils.hooks.RemovableHandle]]:
    """Group the parameters by boundary nodes and hook those nodes to capture their gradients."""
    roots = [_grad_node(t) for t in outs]
    consumers = _consumers(roots)
    on_input_path = _closure([_grad_node(t) for t in inputs], consumers)
    boundary_of: dict[Node, set[Node]] = {}
    for p in params:
        boundary_of[_grad_node(p)] = _boundary(_grad_node(p), consumers, on_input_path, set(roots))
    groups = _group(params, boundary_of)
    seeded = _root_grads(outs, out_grads, on_input_path)
    handles = []
    for group in groups:
        for node in group.nodes:
            if node in seeded:
                group.grads[node] = seeded[node]
            else:
                handles.append(node.register_prehook(_capture(group.grads, node)))
    return groups, handles


def _grad_node(t: torch.Tensor) -> Node:
    """The tensor's grad_fn, or its gradient accumulator for a leaf (created through a view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    node = t.view_as(t).grad_fn
    assert node is not None, "tensor does not require grad"
    accumulator = node.next_functions[0][0]
    assert accumulator is not None
    return accumulator


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``roots``: node -> nodes that feed it a gradient."""
    consumers: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _closure(starts: list[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """Nodes reachable from ``starts`` along reverse edges: everything whose output depends on them."""
    seen, queue = set(starts), deque(starts)
    while queue:
        for parent in consumers.get(queue.popleft(), []):
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen


def _boundary(start: Node, consumers: dict[Node, list[Node]], input_path: set[Node], roots: set[Node]) -> set[Node]:
    """Walk up from a parameter until the input path (or an output that does not depend on the inputs)."""
    found, seen, queue = set(), {start}, deque([start])
    while queue:
        node = queue.popleft()
        for parent in consumers.get(node, []):
            if parent in seen:
                continue
            seen.add(parent)
            if parent in input_path:
                found.add(parent)
            else:
                queue.append(parent)
        if node in roots:
            found.add(node)
    return found


def _group(params: list[torch.Tensor], boundary_of: dict[Node, set[Node]]) -> list[_Group]:
    """Merge parameters that share a boundary node into one group (one autograd call each)."""
    groups: list[_Group] = []
    group_of: dict[Node, _Group] = {}
    for p in params:
        nodes = boundary_of[_grad_node(p)]
        if not nodes:
            continue  # no gradient reaches this parameter
        merged = {id(group_of[n]): group_of[n] for n in nodes if n in group_of}
        target = _Group([p], sorted(nodes, key=id))
        for other in merged.values():
            target.params = other.params + target.params
            target.nodes = list({**dict.fromkeys(other.nodes), **dict.fromkeys(target.nodes)})
            groups.remove(other)
        groups.append(target)
        for n in target.nodes:
            group_of[n] = target
    return groups


def _root_grads(
    outs: list[torch.Tensor], out_grads: list[torch.Tensor], input_path: set[Node]
) -> dict[Node, tuple[torch.Tensor | None, ...]]:
    """Gradients arriving at output nodes that the inputs do not reach (no hook fires there)."""
    slots: dict[Node, dict[int, torch.Tensor]] = defaultdict(dict)
    for out, g in zip(outs, out_grads, strict=True):
        node = _grad_node(out)
        if node not in input_path:
            index = out.output_nr if out.grad_fn is not None else 0
            slots[node][index] = g + slots[node][index] if index in slots[node] else g
    return {node: tuple(got.get(i) for i in range(max(got) + 1)) for node, got in slots.items()}


def _capture(store: dict[Node, tuple[torch.Tensor | None, ...]], node: Node):  # type: ignore[no-untyped-def]
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        store[node] = tuple(grad_outputs)

    return hook


def _pin(grads: tuple[torch.Tensor | None, ...]):  # type: ignore[no-untyped-def]
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return grads

    return hook
