"""Compiled stages with a split backward: inductor compiles a stage's forward and its ``I`` and ``W`` graphs.

`compile_split` is the Dynamo backend of a training stage: inductor's `compile_fx` as usual, except that the
backward graph AOTAutograd partitions out of the joint graph is split again (`split_graph`) into two compiled
graphs, beside the whole backward compiled as inductor compiles it. The stage's autograd node then runs a
`SplitBackward`: the whole backward when called plainly (a ``B`` action: one compiled backward's cost), only ``I``
within `defer_weights` (an ``I`` action), leaving a `DeferredWeight` that `run_deferred` (``W``) computes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx, nn
from torch.autograd.graph import GradientEdge, Node

from lightning_pipe.backends.split_graph import SplitGraphs, split_backward_graph

COMPILED_NODE = "CompiledFunctionBackward"  # AOTAutograd's autograd node: one per compiled graph
_deferring = threading.local()  # set by `defer_weights`'s hook right before a compiled node's backward runs
GraphCounts = dict[str, int]  # "forward", "backward_input", "backward_weight", "backward" -> graphs compiled


@dataclass(eq=False)
class DeferredWeight:
    """One compiled node's weight gradients, computed by its ``W`` graph when `run_deferred` calls it."""

    node: Node  # the compiled node: its next edges lead to the parameters
    positions: list[int]  # the node's next edges (its tensor inputs) that W's gradients go to, in order
    compute: Callable[[], list[torch.Tensor | None]]
    nbytes: int  # the boundary values kept for W


def unsplittable(gm: fx.GraphModule) -> str | None:
    """Why this Dynamo graph's backward is not split into ``I`` and ``W`` (None: it is)."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and "autograd_function_apply" in str(getattr(target, "_name", target)):
            return (
                "it calls a custom torch.autograd.Function: its backward is the user's code, one piece that "
                "may rely on running whole (ctx state, side effects)"
            )
    return None


def compile_split(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict[str, Any], counts: GraphCounts
) -> Callable[..., Any]:
    """Inductor's compile of ``gm`` with its backward split into ``I`` and ``W`` (Dynamo backend signature).

    The split sits in inductor's ``inner_compile`` hook, which receives the forward and the backward graphs
    after AOTAutograd traced the joint graph and partitioned it (with inductor's own partitioner, so the
    forward saves what it would save anyway). Nothing relies on ``retain_graph`` over a compiled node, which
    AOTAutograd refuses once a backward donates its saved buffers (pytorch issue 161904). Donated buffers are
    off (``I`` must not overwrite what ``W`` reads) and so is AOTAutograd's cache, which would hand back an
    unsplit backward compiled earlier (the crash a warm cache gave); inductor's graph cache serves all three.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    is_weight = [isinstance(x, nn.Parameter) for x in example_inputs]
    # the autograd node's next edges are its tensor inputs only (a dynamic size is an input too, a SymInt)
    tensors = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        if not kwargs.get("is_backward"):
            _count(counts, "forward")
            return compile_fx_inner(graph, inputs, **kwargs)
        split = split_backward_graph(graph, is_weight)
        if not split.input_outputs or not split.weight_outputs:  # nothing to split (a first stage: no input grads)
            _count(counts, "backward")
            return compile_fx_inner(graph, inputs, **kwargs)
        halves = {**kwargs, "static_input_idxs": []}  # the halves' inputs are not the backward's
        input_code = compile_fx_inner(split.input_graph, [inputs[i] for i in split.input_placeholders], **halves)
        _count(counts, "backward_input")
        weight_inputs = [inputs[i] for i in split.weight_placeholders] + [n.meta["val"] for n in split.boundary]
        weight_code = compile_fx_inner(split.weight_graph, weight_inputs, **halves)
        _count(counts, "backward_weight")
        # last: inductor's passes rewrite the graph it compiles, and the halves were cut from it as traced
        whole_code = compile_fx_inner(graph, inputs, **kwargs)
        _count(counts, "backward")
        edges = {position: edge for edge, position in enumerate(tensors)}
        codes = (input_code, weight_code, whole_code)
        made = _as_output_code()(split, *codes, [edges[i] for i in split.weight_outputs], len(tensors))
        return cast(SplitBackward, made)

    # donated buffers: an unsplit backward may overwrite saved tensors that W still reads
    with functorch_config.patch(donated_buffer=False, enable_autograd_cache=False):
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches or None)
    return cast(Callable[..., Any], compiled)  # a Dynamo backend's result: the compiled forward


def compile_whole(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict[str, Any], counts: GraphCounts
) -> Callable[..., Any]:
    """Inductor's own compile of ``gm`` (an unsplit backward, or no backward at all), counting its graphs."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        _count(counts, "backward" if kwargs.get("is_backward") else "forward")
        return compile_fx_inner(graph, inputs, **kwargs)

    compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches or None)
    return cast(Callable[..., Any], compiled)


@functools.cache
def _as_output_code() -> type:
    """`SplitBackward` as inductor's ``OutputCode``, made on the first split: importing inductor at import time
    would cost every stage worker process its start (and pull in ``torch.distributed.tensor``)."""
    from torch._inductor.output_code import OutputCode

    return type("SplitBackward", (SplitBackward, OutputCode), {})


class SplitBackward:
    """A compiled backward as three compiled graphs: the whole backward for a plain call, or ``I`` now and ``W``
    deferred (boxed calling convention); made as inductor's ``OutputCode`` (`_as_output_code`).

    A plain call (a ``B`` action) runs the whole graph, not ``I`` then ``W``: inductor fuses across the boundary
    there (a layer's bias gradient with its pre-activation gradient) and nothing is handed between two graphs.
    """

    def __init__(
        self,
        split: SplitGraphs,
        input_code: Callable[..., Any],
        weight_code: Callable[..., Any],
        whole_code: Callable[..., Any],
        weight_edges: list[int],
        num_edges: int,
    ) -> None:
        self.split, self.input_code, self.weight_code, self.whole_code = split, input_code, weight_code, whole_code
        self.weight_edges = weight_edges  # for each weight gradient W returns, the node's next edge it goes to
        self.num_edges = num_edges
        self._boxed_call = True  # on the instance: AOTAutograd's wrappers copy the instance's __dict__

    def __call__(self, args: list[Any]) -> list[torch.Tensor | None]:
        split = self.split
        deferring: tuple[Node, list[DeferredWeight]] | None = getattr(_deferring, "target", None)
        _deferring.target = None
        if deferring is not None and len(deferring[0].next_functions) != self.num_edges:
            deferring = None  # the node's inputs are not the graph's (a wrapper of AOTAutograd's): W now, in I
        if deferring is None:  # a B action (or I of a node whose W cannot be handed on): one compiled backward
            return list(self.whole_code(args))
        input_args = [args[i] for i in split.input_placeholders]
        weight_args = [args[i] for i in split.weight_placeholders]
        args.clear()  # boxed: the saved tensors live on only where a half reads them
        got = list(self.input_code(input_args))
        n = len(split.input_outputs)
        boundary = got[n:]
        grads: list[torch.Tensor | None] = [None] * split.outputs
        for i, g in zip(split.input_outputs, got[:n], strict=True):
            grads[i] = g

        def compute() -> list[torch.Tensor | None]:
            with torch.no_grad():  # deferred, it runs outside autograd's backward (which runs it without grad)
                return list(self.weight_code([*weight_args, *boundary]))

        node, store = deferring
        size = sum(t.numel() * t.element_size() for t in boundary if isinstance(t, torch.Tensor))
        store.append(DeferredWeight(node, self.weight_edges, compute, size))
        return grads

    def post_compile(self, *args: Any, **kwargs: Any) -> None:
        """Each graph was post-compiled by `compile_fx_inner`."""

    def prepare_for_serialization(self) -> None:
        raise NotImplementedError("a split backward is not cached by AOTAutograd (its cache is off while it compiles)")

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        """Each graph keeps its own."""


def compiled_nodes(roots: Iterable[Node]) -> list[Node]:
    """The compiled autograd nodes (one per compiled graph) in the graph below ``roots``."""
    found, seen, stack = [], set(), [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == COMPILED_NODE:
            found.append(node)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found


@contextlib.contextmanager
def defer_weights(nodes: Iterable[Node]) -> Iterator[list[DeferredWeight]]:
    """Within: a split backward of ``nodes`` computes its input gradients only and leaves its ``W`` in the list.

    A prehook marks the node about to run on the thread that runs it (autograd's device thread on CUDA);
    a compiled node whose backward is not split ignores the mark and computes every gradient.
    """
    store: list[DeferredWeight] = []
    handles = []
    for node in nodes:
        handles.append(node.register_prehook(_mark(node, store)))
        handles.append(node.register_hook(_unmark))  # a node whose backward is not split leaves the mark
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def run_deferred(deferred: Iterable[DeferredWeight]) -> None:
    """``W``: compute each deferred weight gradient and hand it to its parameter's autograd edge."""
    for item in deferred:
        edges, grads = [], []
        for position, grad in zip(item.positions, item.compute(), strict=True):
            child, slot = item.node.next_functions[position]
            if child is not None and grad is not None:
                edges.append(GradientEdge(child, slot))
                grads.append(grad)
        if edges:
            torch.autograd.backward(edges, grads)


def _mark(node: Node, store: list[DeferredWeight]):  # type: ignore[no-untyped-def]
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        _deferring.target = (node, store)

    return hook


def _unmark(grad_inputs: Any, grad_outputs: Any) -> None:
    _deferring.target = None


def _count(counts: GraphCounts, kind: str) -> None:
    counts[kind] = counts.get(kind, 0) + 1
