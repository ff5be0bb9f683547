"""Tracing any ``nn.Module`` into an fx graph of leaf-module calls, driven by one example call.

`trace` runs the model's forward once with `ConcreteProxy` values: each proxy records its operation
in a ``torch.fx`` graph *and* carries the real value computed on the example. Python control flow
(``if mask is None``, ``len(x)``, loops over ``x.shape``) therefore follows the example instead of
failing as in plain symbolic tracing, while shapes and tensor arithmetic stay symbolic. Big layers
(elements of ``nn.ModuleList``/``nn.Sequential``, ``torch.nn`` layers without such lists) stay
*leaf* calls: they are where the graph can be cut into stages.

The graph is specialised to the example's control flow and non-tensor arguments. It is traced twice,
in training mode (grad enabled) and in eval mode (``no_grad``), so code that branches on
``self.training`` behaves as in the unsplit model in validation too.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import fx, nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.utils import _pytree as pytree

from lightning_pipe.errors import PartitionError

# torch functions that take sizes or scalars (not tensors) and so do not dispatch on a proxy argument;
# they are wrapped while tracing so that ``torch.ones(t, t)`` with a traced ``t`` is recorded
FACTORIES: tuple[Callable[..., Any], ...] = (
    torch.arange, torch.ones, torch.zeros, torch.full, torch.empty, torch.eye, torch.rand, torch.randn,
    torch.randint, torch.tensor, torch.as_tensor, torch.finfo, torch.iinfo,
)  # fmt: skip
LeafSpec = str | type[nn.Module]


class TraceError(PartitionError):
    """The model could not be traced; the message names the line and what to do."""


@dataclass
class CallArgs:
    """One call of the pipelined module: positional and keyword arguments."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, sample: Any) -> CallArgs:
        """A sample batch as a call: a tuple is positional arguments, anything else one argument."""
        if isinstance(sample, CallArgs):
            return sample
        if isinstance(sample, tuple) and not hasattr(sample, "_fields"):
            return cls(tuple(sample), {})
        return cls((sample,), {})


_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# proxies carrying concrete values
class _Concrete:
    """Value-based behaviour shared by `ConcreteProxy` and `ConcreteAttribute`."""

    value: Any
    tracer: Any  # the ConcreteTracer that made it
    static: bool  # derived only from shapes, dtypes and devices, not from tensor contents

    def __getattr__(self, name: str) -> ConcreteAttribute:
        if name in ("value", "tracer", "node", "root", "attr", "_node", "static") or name.startswith("__"):
            raise AttributeError(name)
        value = getattr(self.value, name)  # raises AttributeError as the real object would
        return ConcreteAttribute(self, name, value)  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return bool(self.tracer.specialise(self))

    def __len__(self) -> int:
        if isinstance(self.value, torch.Tensor):
            self.tracer.note_unrolled()
        return len(self.value)

    def __index__(self) -> int:
        return operator.index(self.tracer.specialise(self))

    def __int__(self) -> int:
        return int(self.tracer.specialise(self))

    def __float__(self) -> float:
        return float(self.tracer.specialise(self))

    def __contains__(self, item: Any) -> bool:
        return bool(_concrete(item) in self.tracer.specialise(self))

    def __iter__(self) -> Iterator[Any]:
        value = self.value
        if isinstance(value, dict):
            return iter(list(value.keys()))
        if isinstance(value, torch.Tensor):
            self.tracer.note_unrolled()
        return iter([self[i] for i in range(len(value))])  # type: ignore[index]

    def __setitem__(self, key: Any, item: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, item), {})

    def keys(self) -> Any:
        return self.value.keys()


class ConcreteProxy(_Concrete, fx.Proxy):
    """An fx proxy that also holds the value computed on the example call."""

    def __init__(self, node: fx.Node, tracer: ConcreteTracer, value: Any, static: bool = False) -> None:
        fx.Proxy.__init__(self, node, tracer)
        self.value = value
        self.static = static

    def __repr__(self) -> str:
        return f"ConcreteProxy({self.node.name})"


class ConcreteAttribute(_Concrete, fx.proxy.Attribute):
    """``proxy.name``: recorded lazily (most attributes are method calls), with its value."""

    def __init__(self, root: ConcreteProxy, attr: str, value: Any) -> None:
        fx.proxy.Attribute.__init__(self, root, attr)
        self.value = value
        self.static = root.static or attr in _SHAPE_ATTRIBUTES


# tensor metadata: Python code may branch on it freely, it does not depend on what the tensor holds
_SHAPE_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "ndim", "layout", "size", "dim", "numel", "nelement", "stride", "element_size",
    "itemsize", "nbytes", "names", "requires_grad", "is_cuda", "is_cpu", "is_nested", "is_sparse", "is_quantized",
    "is_meta", "is_mps", "is_complex", "is_floating_point", "is_contiguous", "is_leaf", "get_device",
})  # fmt: skip


def _concrete(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.value if isinstance(x, _Concrete) else x, tree)


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
        self._autowrap_search.append(torch)
        self._leaves = leaves
        self._values: dict[str, Any] = {}
        self.data_dependent: list[str] = []  # where control flow read a value computed from tensor contents
        self.unrolled: list[str] = []  # where code took len() of a tensor or looped over its rows

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self._leaves(m, module_qualified_name)

    def specialise(self, proxy: _Concrete) -> Any:
        """A traced value decides Python control flow: the graph keeps the example's branch."""
        if not proxy.static:
            where = _user_frame_of(inspect.currentframe())
            if where and where not in self.data_dependent:
                self.data_dependent.append(where)
        return proxy.value

    def note_unrolled(self) -> None:
        """``len(x)`` or ``for row in x``: the graph keeps the example's first dimension."""
        where = _user_frame_of(inspect.currentframe())
        if where and where not in self.unrolled:
            self.unrolled.append(where)

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
        value = self._evaluate(kind, target, args, kwargs, name)
        static = _is_static(kind, target, args, kwargs)
        return super().create_proxy(
            kind, target, args, kwargs, name, type_expr, lambda node: ConcreteProxy(node, self, value, static)
        )

    def _evaluate(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str | None) -> Any:
        if kind == "placeholder":
            return self._values[name or target]
        args, kwargs = _concrete(args), _concrete(kwargs)
        with _maybe_revert_all_patches():
            if kind == "call_function":
                return target(*args, **kwargs)
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            if kind == "call_module":
                return self.root.get_submodule(target)(*args, **kwargs)
            if kind == "get_attr":
                return _fetch(self.root, target)
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
                return signature.flatten_output(tracer, root_fn(root, *args, **kwargs))

            return flat_forward, placeholders

        self.create_args_for_root = create_args_for_root  # type: ignore[method-assign]
        return self.trace(root), signature


def _is_static(kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a new value depends only on shapes, dtypes and devices (not on what tensors hold)."""
    if kind in ("placeholder", "get_attr", "call_module"):
        return False
    if kind == "call_function" and target is getattr:
        return args[1] in _SHAPE_ATTRIBUTES or _all_static(args[0])
    if kind == "call_method" and target in _SHAPE_ATTRIBUTES:
        return True
    return _all_static((args, kwargs))


def _all_static(tree: Any) -> bool:
    return all(x.static for x in pytree.tree_leaves(tree) if isinstance(x, _Concrete))


# the call signature: which inputs are tensors (graph inputs) and which are constants of the trace
@dataclass
class Signature:
    """How a call's arguments map to the flat graph inputs, and the graph outputs to the result."""

    parameters: inspect.Signature
    in_spec: Any
    in_leaves: list[Any]  # constants, or _TENSOR where a graph input goes
    input_names: list[str]
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)  # constants, or _TENSOR where a graph output goes

    @classmethod
    def of(cls, module: nn.Module, call: CallArgs) -> Signature:
        parameters = inspect.signature(class_forward(module))
        arguments = _bind(parameters, call, module)
        leaves, spec = pytree.tree_flatten(arguments)
        paths = [_path_name(path) for path, _ in pytree.tree_flatten_with_path(arguments)[0]]
        names: list[str] = []
        in_leaves: list[Any] = []
        for path, leaf in zip(paths, leaves, strict=True):
            if isinstance(leaf, torch.Tensor):
                names.append(_unique(path, names))
                in_leaves.append(_TENSOR)
            else:
                in_leaves.append(leaf)
        return cls(parameters, spec, in_leaves, names)

    def tensors(self, call: CallArgs) -> list[torch.Tensor]:
        """The flat graph inputs of ``call``; fails if it does not match the traced call."""
        leaves, spec = pytree.tree_flatten(_bind(self.parameters, call))
        if spec != self.in_spec:
            raise PartitionError(
                f"the pipelined module was traced for a call with arguments {self.describe(self.in_spec)} but is "
                f"now called with {self.describe(spec)}; call it the same way every time (the graph is "
                "specialised to one call signature)"
            )
        out = []
        for leaf, traced in zip(leaves, self.in_leaves, strict=True):
            if traced is _TENSOR:
                if not isinstance(leaf, torch.Tensor):
                    raise PartitionError(f"expected a tensor where the traced call had one, got {type(leaf).__name__}")
                out.append(leaf)
            elif not _same_constant(leaf, traced):
                raise PartitionError(
                    f"the pipelined module was traced with the constant argument {traced!r} but is now called with "
                    f"{leaf!r}; non-tensor arguments are fixed when the graph is traced"
                )
        return out

    def matches(self, call: CallArgs) -> bool:
        """Whether ``call`` passes tensors and constants where the traced call did."""
        try:
            self.tensors(call)
        except PartitionError:
            return False
        return True

    def rebuild(self, flat: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        it = iter(flat)
        leaves = [next(it) if leaf is _TENSOR else leaf for leaf in self.in_leaves]
        bound = inspect.BoundArguments(self.parameters, pytree.tree_unflatten(leaves, self.in_spec))
        return bound.args, bound.kwargs

    def flatten_output(self, tracer: ConcreteTracer, output: Any) -> tuple[Any, ...]:
        leaves, self.out_spec = pytree.tree_flatten(_expand(tracer, output))
        flat, self.out_leaves = [], []
        for leaf in leaves:
            if isinstance(leaf, (fx.Proxy, torch.Tensor)):
                flat.append(leaf)
                self.out_leaves.append(_TENSOR)
            else:
                self.out_leaves.append(leaf)
        return tuple(flat)

    def unflatten_output(self, flat: Sequence[Any]) -> Any:
        it = iter(flat)
        leaves = [next(it) if leaf is _TENSOR else leaf for leaf in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def describe(self, spec: Any) -> str:
        if spec.type is dict:
            return "(" + ", ".join(str(k) for k in spec.context) + ")"
        return str(spec)


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()


def class_forward(module: nn.Module) -> Callable[..., Any]:
    """``module.forward`` as its class defines it (a wrapper set on the instance, such as PipeStrategy's
    hand-off to the pipeline, is not the model's code)."""
    return type(module).forward.__get__(module, type(module))  # type: ignore[no-any-return]


def _bind(parameters: inspect.Signature, call: CallArgs, module: nn.Module | None = None) -> dict[str, Any]:
    try:
        bound = parameters.bind(*call.args, **call.kwargs)
    except TypeError as exc:
        name = type(module).__name__ if module is not None else "the pipelined module"
        raise PartitionError(f"the example call does not match {name}.forward{parameters}: {exc}") from None
    return dict(bound.arguments)


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return a is b


def _path_name(path: Sequence[Any]) -> str:
    atoms = []
    for key in path:
        atom = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
        atoms.append(str(atom))
    name = "_".join(atoms)
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "input"


def _unique(name: str, taken: list[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    return candidate


def _expand(tracer: ConcreteTracer, output: Any) -> Any:
    """Replace proxies whose value is a container by containers of item proxies."""

    def expand(x: Any) -> Any:
        if isinstance(x, _Concrete) and isinstance(x.value, (tuple, list)) and not isinstance(x.value, torch.Size):
            return type(x.value)(expand(x[i]) for i in range(len(x.value)))  # type: ignore[index]
        if isinstance(x, _Concrete) and isinstance(x.value, dict):
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
    forward caches (``self.mask = ...``, which would keep a proxy) must look untouched afterwards.
    """
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    attributes = [(m, dict(m.__dict__)) for m in module.modules()]
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
        except _UntraceableError as failure:
            if not failure.inside or failure.inside in leaves:
                raise TraceError(failure.message) from failure.__cause__
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
    with preserved(module), _explained(module, tracer):
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


# errors that say where tracing stopped and what to do
class _UntraceableError(Exception):
    def __init__(self, message: str, inside: str, reason: str) -> None:
        super().__init__(message)
        self.message, self.inside, self.reason = message, inside, reason


@contextlib.contextmanager
def _explained(module: nn.Module, tracer: ConcreteTracer) -> Iterator[None]:
    try:
        yield
    except (TraceError, _UntraceableError):
        raise
    except Exception as exc:
        where = _user_frame(sys.exc_info()[2])
        scopes = [path for path, _ in tracer.module_stack.values() if path]
        inside = scopes[-1] if scopes else ""
        reason = f"{type(exc).__name__}: {exc}" + (f" at {where}" if where else "")
        raise _UntraceableError(_explain(module, exc, where, inside), inside, reason) from exc


def _explain(module: nn.Module, exc: BaseException, where: str, inside: str) -> str:
    lines = [f"could not trace {type(module).__name__} to split it into stages: {type(exc).__name__}: {exc}"]
    if where:
        lines.append(f"  tracing stopped at {where}")
    if inside:
        kind = type(module.get_submodule(inside)).__name__
        lines.append(f"  inside the submodule {inside!r} ({kind}), which is already kept whole")
    else:
        lines.append(f"  in the top-level forward of {type(module).__name__}")
    lines.append("what to do:")
    lines.append(
        "  - move that code into a submodule and mark it as a leaf, TracedPartitioner(leaf_modules=[name or class]): "
        "a leaf runs as one layer and is not traced into"
    )
    lines.append("  - or give split_points=[...] at the submodules around it")
    lines.append("  - or make the pipelined module an nn.Sequential of layers, which is split without tracing")
    return "\n".join(lines)


def _skipped(filename: str) -> bool:
    return filename.startswith((_TORCH_DIR, _PACKAGE_DIR, "<")) or "/contextlib.py" in filename


def _user_frame(tb: TracebackType | None) -> str:
    """The innermost frame outside torch and lightning_pipe: the model code that stopped the tracer."""
    found = ""
    for frame, lineno in traceback.walk_tb(tb):
        if not _skipped(frame.f_code.co_filename):
            found = _describe_frame(frame.f_code.co_filename, lineno, frame.f_code.co_name)
    return found


def _user_frame_of(frame: FrameType | None) -> str:
    """The innermost caller outside torch and lightning_pipe, walking out from ``frame``."""
    while frame is not None:
        if not _skipped(frame.f_code.co_filename):
            return _describe_frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return ""


def _describe_frame(filename: str, lineno: int, name: str) -> str:
    source = traceback.FrameSummary(filename, lineno, name).line or ""
    return f"{filename}:{lineno} in {name}: {source.strip()}"
