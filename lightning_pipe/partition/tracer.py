"""Tracing any ``nn.Module`` into an fx graph of leaf-module calls, driven by one example call.

`trace` runs the forward once with `ConcreteProxy` values, each recording its operation in a ``torch.fx`` graph
and carrying the real value computed on the example, so Python control flow follows the example. Big layers
stay *leaf* calls: where the graph can be cut into stages. The graph is traced in training and in eval mode
(docs/internals.md).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.utils import _pytree as pytree
from typing_extensions import override

from lightning_pipe.partition.concrete import Concrete, ConcreteProxy, concrete, is_static
from lightning_pipe.partition.explain import (
    SideChannel,
    TraceError,
    UnsentValue,
    UntraceableError,
    explained,
    user_frame_of,
)
from lightning_pipe.partition.signature import CallArgs, Signature, class_forward
from lightning_pipe.partition.stand_ins import stand_in, stand_in_values

__all__ = ["CallArgs", "ConcreteTracer", "LeafSpec", "Signature", "TraceError", "Traced", "class_forward", "trace"]

# torch functions that take sizes or scalars (not tensors) and so do not dispatch on a proxy argument;
# they are wrapped while tracing so that ``torch.ones(t, t)`` with a traced ``t`` is recorded
FACTORIES: tuple[Callable[..., Any], ...] = (
    torch.arange, torch.ones, torch.zeros, torch.full, torch.empty, torch.eye, torch.rand, torch.randn,
    torch.randint, torch.tensor, torch.as_tensor, torch.finfo, torch.iinfo,
)  # fmt: skip
LeafSpec = str | type[nn.Module]


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


# the tracer
class ConcreteTracer(fx.Tracer):
    """``fx.Tracer`` whose proxies carry the values of one example call (see the module docstring)."""

    def __init__(self, leaves: Callable[[nn.Module, str], bool]) -> None:
        super().__init__(autowrap_modules=(math,), autowrap_functions=FACTORIES)
        # buffers are traced values too: ``self.position_ids[:, :seq_len]`` then records the slice instead of
        # computing it once, and ``buffer.expand(batch, seq_len)`` with traced sizes dispatches to the tracer
        self.proxy_buffer_attributes = True
        self._autowrap_search.append(torch)
        self._leaves = leaves
        self._values: dict[str, Any] = {}
        self._computed: dict[int, weakref.ref[torch.Tensor]] = {}  # the real tensors behind the proxies
        self.data_dependent: list[str] = []  # where control flow read a value computed from tensor contents
        self.unrolled: list[str] = []  # where code took len() of a tensor or looped over its rows

    @override
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self._leaves(m, module_qualified_name)

    @override
    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A module that is not a submodule of the root (``loss_fct = CrossEntropyLoss()`` inside a forward, as
        HF models do with ``labels=``) has no name a stage could call it by: its forward is traced inline, so
        the graph records the functions it calls (``F.cross_entropy``) and the stage code needs no object."""
        if not self.installed(m):
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def installed(self, m: nn.Module) -> bool:
        """Whether ``m`` is a submodule of the module being traced."""
        try:
            self.path_of_module(m)
        except NameError:
            return False
        return True

    def specialise(self, proxy: Concrete) -> Any:
        """A traced value decides Python control flow: the graph keeps the example's branch."""
        if not proxy.static:
            where = user_frame_of(inspect.currentframe())
            if where and where not in self.data_dependent:
                self.data_dependent.append(where)
        return proxy.value

    def note_unrolled(self) -> None:
        """``len(x)`` or ``for row in x``: the graph keeps the example's first dimension."""
        where = user_frame_of(inspect.currentframe())
        if where and where not in self.unrolled:
            self.unrolled.append(where)

    @override
    def create_proxy(  # type: ignore[override]
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
        proxy_factory_fn: Callable[[fx.Node], fx.Proxy] | None = None,
    ) -> fx.Proxy:
        if kind == "call_module":
            self._check_arguments(target, args, kwargs)
        value = self._evaluate(kind, target, args, kwargs, name)
        for tensor in pytree.tree_leaves(value):
            if isinstance(tensor, torch.Tensor):
                self._computed[id(tensor)] = weakref.ref(tensor)
        static = is_static(kind, target, args, kwargs)
        return super().create_proxy(
            kind, target, args, kwargs, name, type_expr, lambda node: ConcreteProxy(node, self, value, static)
        )

    def _check_arguments(self, layer: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Fail before running ``layer`` if an argument is an object that cannot be a value of the graph."""
        for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
            if isinstance(leaf, (fx.Proxy, torch.Tensor)):
                continue
            try:
                self.create_arg(leaf)
            except NotImplementedError:  # fx's create_arg: "argument of type ..."
                # the caller's code hands the layer that object: tracing stopped in the caller, not in the layer
                self.module_stack.popitem(last=True)
                top: Any = path[1]  # a MappingKey for keyword arguments, a SequenceKey for positional ones
                where = f"{top.key}" if isinstance(top, pytree.MappingKey) else f"positional argument {top.idx}"
                raise UnsentValue(layer, where + pytree.keystr(path[2:]), leaf) from None

    @override
    def create_arg(self, a: Any) -> Any:
        """fx's conversion of a value into a graph argument, refusing a trace value that lost its proxy."""
        arg = super().create_arg(a)
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and str(arg.target).startswith("_tensor_constant"):
            known = self._computed.get(id(a))
            if known is not None and known() is a:  # a value of the trace without its proxy: it would stay fixed
                raise SideChannel()
        return arg

    def _evaluate(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str | None) -> Any:
        if kind == "placeholder":
            return self._values[name or target]
        args, kwargs = concrete(args), concrete(kwargs)
        with _maybe_revert_all_patches():
            if kind == "call_function":
                return target(*args, **kwargs)
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            if kind == "call_module":
                module = self.root.get_submodule(target)
                with stand_in_values(module, (args, kwargs)):  # a model built on meta: zeros while it runs
                    return module(*args, **kwargs)
            if kind == "get_attr":
                return stand_in(_fetch(self.root, target), self._values)
        raise AssertionError(f"unexpected node kind {kind!r}")

    def trace_call(self, root: nn.Module, call: CallArgs) -> tuple[fx.Graph, Signature]:
        """Trace ``root(*call.args, **call.kwargs)``; the graph takes and returns flat tuples."""
        signature = Signature.of(root, call)
        self._values = {name: value for name, value in zip(signature.input_names, signature.tensors(call), strict=True)}
        tracer = self

        def create_args_for_root(root_fn: Any, is_module: bool, concrete_args: Any = None) -> tuple[Any, list[Any]]:
            placeholders = [tracer.create_proxy("placeholder", n, (), {}) for n in signature.input_names]

            def flat_forward(*flat: Any) -> tuple[Any, ...]:
                args, kwargs = signature.rebuild(flat)
                return signature.flatten_output(_expand(tracer, root_fn(root, *args, **kwargs)))

            return flat_forward, placeholders

        self.create_args_for_root = create_args_for_root  # type: ignore[method-assign]
        with _traced_buffers(self):
            return self.trace(root), signature


@contextlib.contextmanager
def _traced_buffers(tracer: ConcreteTracer) -> Iterator[None]:
    """Let a module made during the forward take a traced value as a buffer.

    ``nn.CrossEntropyLoss(weight=self.class_weights)`` in a forward registers a parameter or buffer of
    the model, which the tracer hands out as a traced value; ``register_buffer`` accepts only tensors.
    The module is traced inline (`ConcreteTracer.call_module`), so its forward reads the traced value
    back and the graph records where it came from. fx patches ``nn.Module`` the same way while it traces.
    The model's own modules keep refusing: a traced value must not outlive the trace in them.
    """
    original = nn.Module.register_buffer

    def register_buffer(module: nn.Module, name: str, tensor: Any, persistent: bool = True) -> None:
        if isinstance(tensor, Concrete) and not tracer.installed(module):
            module._buffers[name] = tensor  # type: ignore[assignment]
            return
        original(module, name, tensor, persistent)

    nn.Module.register_buffer = register_buffer  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_buffer = original  # type: ignore[method-assign]


def _expand(tracer: ConcreteTracer, output: Any) -> Any:
    """Replace proxies whose value is a container by containers of item proxies."""

    def expand(x: Any) -> Any:
        if isinstance(x, Concrete) and isinstance(x.value, (tuple, list)) and not isinstance(x.value, torch.Size):
            return type(x.value)(expand(x[i]) for i in range(len(x.value)))  # type: ignore[index]
        if isinstance(x, Concrete) and isinstance(x.value, dict):
            return {k: expand(x[k]) for k in x.value}  # type: ignore[index]
        return x

    return pytree.tree_map(expand, output)


# leaves: the layers the graph is cut between
def default_leaves(
    root: nn.Module, extra: Sequence[LeafSpec] = (), inside: Sequence[str] = ()
) -> Callable[[nn.Module, str], bool]:
    """Elements of ``nn.ModuleList``/``nn.Sequential`` containers, ``torch.nn`` layers that hold no such
    containers (``nn.Transformer`` is traced into, ``nn.MultiheadAttention`` is not), and ``extra``
    (qualified names or classes); never a module that contains one of the names in ``inside`` (a split
    point inside a block makes the tracer enter the block)."""
    in_list = {id(child) for m in root.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) for child in m}
    names = {x for x in extra if isinstance(x, str)}
    types = tuple(x for x in extra if isinstance(x, type))

    def is_leaf(m: nn.Module, name: str) -> bool:
        if m is root:
            return False
        if name in names or (types and isinstance(m, types)):
            return True
        if any(point.startswith(name + ".") for point in inside):
            return False
        if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            return False
        if id(m) in in_list:
            return True
        if m.__module__.startswith(("torch.nn", "torch.ao.nn")):
            return not any(isinstance(c, (nn.ModuleList, nn.Sequential)) for c in m.modules() if c is not m)
        return False

    return is_leaf


# running a trace without side effects on the model
@contextlib.contextmanager
def preserved(module: nn.Module) -> Iterator[None]:
    """Restore buffers, training flags, random state and module attributes after tracing.

    Tracing runs the model once: BatchNorm statistics, dropout's random numbers and attributes that a
    forward caches (``self.mask = ...``, which would keep a proxy) must look untouched afterwards; so must
    the module's own dictionaries (hooks that a forward installs, as HF models do for ``output_hidden_states``).
    """
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    attributes = [(m, dict(m.__dict__)) for m in module.modules()]
    contents = [(d, dict(d)) for m in module.modules() for d in m.__dict__.values() if isinstance(d, dict)]
    modes = [(m, m.training) for m in module.modules()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            for m, saved_dict in attributes:
                for key in [k for k in m.__dict__ if k not in saved_dict]:
                    del m.__dict__[key]
                m.__dict__.update(saved_dict)
            for d, saved_items in contents:
                d.clear()
                d.update(saved_items)
            for m, mode in modes:
                m.training = mode


@dataclass
class Traced:
    """A traced forward: its graph, the tracer's constants, and the call signature."""

    graph: fx.Graph
    constants: dict[str, Any]  # qualified name -> tensor stored by the tracer (``_tensor_constant0``)
    signature: Signature
    call: CallArgs  # the example it was traced on
    data_dependent: list[str] = field(default_factory=list)  # lines whose control flow read tensor contents
    unrolled: list[str] = field(default_factory=list)  # lines that took len() of a tensor or iterated it
    kept_whole: list[tuple[str, str]] = field(default_factory=list)  # (module, why) made leaves automatically


_RETRIES = 16


def trace(
    module: nn.Module,
    call: CallArgs,
    leaf_modules: Sequence[LeafSpec] = (),
    training: bool = True,
    split_points: Sequence[str] = (),
) -> Traced:
    """Trace ``module(*call.args, **call.kwargs)`` in training (or eval) mode; leaves the module unchanged.

    A submodule that cannot be traced into is kept whole (a leaf) and tracing starts again; code in
    the top-level forward that cannot be traced raises `TraceError`, naming the line and what to do.
    """
    leaves, kept = list(leaf_modules), []
    for _ in range(_RETRIES):
        try:
            traced = _trace_once(module, call, leaves, training, split_points)
        except UntraceableError as failure:
            inner = [p for p in split_points if failure.inside and p.startswith(failure.inside + ".")]
            if not failure.inside or failure.inside in leaves or inner:
                raise TraceError(failure.explain(module, inner)) from failure.__cause__
            leaves.append(failure.inside)
            kept.append((failure.inside, failure.reason))
            continue
        traced.kept_whole = kept
        return traced
    raise TraceError(f"gave up tracing {type(module).__name__} after keeping {len(kept)} submodules whole: {kept}")


def _trace_once(
    module: nn.Module, call: CallArgs, leaves: Sequence[LeafSpec], training: bool, split_points: Sequence[str]
) -> Traced:
    tracer = ConcreteTracer(default_leaves(module, leaves, split_points))
    with preserved(module), explained(module, tracer):
        module.train(training)
        with torch.set_grad_enabled(training):
            graph, signature = tracer.trace_call(module, call)
        constants = {
            n.target: _fetch(module, n.target)
            for n in graph.nodes
            if n.op == "get_attr" and isinstance(n.target, str) and n.target.startswith("_tensor_constant")
        }
    graph.eliminate_dead_code(_is_impure)
    for node in graph.nodes:  # else the generated code calls fx.wrap("torch.ones") when it is loaded
        node.meta.pop("is_wrapped", None)
    return Traced(graph, constants, signature, call, tracer.data_dependent, tracer.unrolled)


def _is_impure(node: fx.Node) -> bool:
    """Kept even when unused: leaf calls (they may update state), in-place ops, side-effecting functions."""
    if node.op in ("placeholder", "output", "call_module"):
        return True
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") or node.target is operator.setitem or node.is_impure()
    return False
