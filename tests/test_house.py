"""House rules on the package's imports: no circles, Lightning only in the strategy, data flows one way.

The imports are read from the source with `ast`; nothing is imported. Every import counts: one at
module level runs when the module is imported, one inside a function when the function is called
(a circle closed there is one the function hides until it runs), and one inside
``if TYPE_CHECKING:`` is read by the type checker. A ``TYPE_CHECKING`` import is for a type that an
annotation needs and nothing else: its names appear only in annotations, and it closes no circle (an
import that would close one at run time, moved under ``TYPE_CHECKING``, hides the circle instead of
breaking it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_pipe"
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")  # Lightning's packages
STRATEGY = "lightning_pipe.strategy"
#: the package's folders by layer, from the ground up (DESIGN.md "Folders are layers", docs/architecture.md): a module
#: imports its own layer and those below, never one above. Folders on one level are plug-ins beside each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("base",),  # errors, trees, units, microbatches, DTensor helpers, allocator and pages, moved paths
    ("schedule", "runtime", "backends", "rng"),  # the plug-ins as data
    ("weights",),  # where a stage's tensors come from
    ("checkpoint",),  # checkpoint files: reading, writing, resuming, a stage's part, consolidating
    ("comm",),  # communicators and transports
    ("engine",),  # coordinator and stage workers: executors, loss, grads, the stash, a stage's memory
    ("partition",),  # model -> shards
    ("pipeline",),  # the Pipeline and what only it uses
    ("strategy",),  # PipeStrategy, its modes (strategy/modes/), Lightning's side
)
LEVEL = {folder: level for level, folders in enumerate(LAYERS) for folder in folders}
#: the package's own files at the top: what ``import lightning_pipe`` gives, and the command line
TOP = ("lightning_pipe", "lightning_pipe.__main__")


def folder_of(module: str) -> str | None:
    """The layer folder of a module of the package (None: the package's own ``__init__``/``__main__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LEVEL else None


# ``import lightning_pipe`` registers the strategy name with Lightning's StrategyRegistry (DESIGN.md):
# the package's own __init__ is the one place outside strategy/ that may name Lightning.
LIGHTNING_ALLOWED = ("lightning_pipe",)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a name imported from a module counts as the module)
    line: int
    module_level: bool  # runs when the module is imported (not inside a function)
    type_checking: bool = False  # inside ``if TYPE_CHECKING:``: read by the type checker only
    name: str = ""  # the name it binds in the importing module


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    """Every import of ``path``: at module level, in functions, and under ``if TYPE_CHECKING:``."""
    found: list[Import] = []
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, module_level: bool, checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, module_level, True)
            for child in node.orelse:
                visit(child, module_level, checking)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                found.append(Import(name, alias.name, node.lineno, module_level, checking, bound))
            return
        if isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in known else base
                found.append(Import(name, target, node.lineno, module_level, checking, alias.asname or alias.name))
            return
        inner = module_level and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner, checking)

    visit(ast.parse(path.read_text(), str(path)), True, False)
    return found


def all_imports() -> list[Import]:
    found = modules()
    return [i for name, path in found.items() for i in imports_of(name, path, set(found))]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), Tarjan's way."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def import_graph(imports: list[Import]) -> dict[str, set[str]]:
    known = set(modules())
    edges: dict[str, set[str]] = {}
    for i in imports:
        if i.target in known and i.target != i.source:
            edges.setdefault(i.source, set()).add(i.target)
    return edges


def uses_outside_annotations(tree: ast.Module, names: set[str]) -> list[tuple[str, int]]:
    """Where ``names`` are read other than in an annotation or inside ``if TYPE_CHECKING:``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.arg):
            return  # its annotation is an annotation
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for child in (*node.decorator_list, *node.args.defaults, *node.args.kw_defaults, *node.body):
                if child is not None:
                    visit(child)
            return  # its return annotation and its arguments' annotations are annotations
        if isinstance(node, ast.AnnAssign):
            for child in (node.target, node.value):
                if child is not None:
                    visit(child)
            return
        if isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load):
            found.append((node.id, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_package_imports_no_circles() -> None:
    found = circles(import_graph([i for i in all_imports() if not i.type_checking]))
    assert not found, "import circles (module or function level): " + "; ".join(" <-> ".join(c) for c in found)


def test_type_checking_imports_close_no_circle() -> None:
    found = circles(import_graph(all_imports()))
    assert not found, (
        "import circles closed by TYPE_CHECKING imports (hidden, not broken; give the type a home both sides "
        "import, or a Protocol): " + "; ".join(" <-> ".join(c) for c in found)
    )


def test_type_checking_imports_serve_annotations_only() -> None:
    wrong = []
    for name, path in modules().items():
        checking = {i.name: i for i in imports_of(name, path, set()) if i.type_checking}
        if not checking:
            continue
        for used, line in uses_outside_annotations(ast.parse(path.read_text(), str(path)), set(checking)):
            wrong.append(f"{name}:{line} uses {used} (imported under TYPE_CHECKING) outside an annotation")
    assert not wrong, "; ".join(wrong)


def test_only_the_strategy_imports_lightning() -> None:
    wrong = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in all_imports()
        if any(_is_under(i.target, package) for package in LIGHTNING)
        and not _is_under(i.source, STRATEGY)
        and i.source not in LIGHTNING_ALLOWED
    ]
    assert not wrong, "Lightning imported outside lightning_pipe.strategy: " + "; ".join(wrong)


def test_every_module_lives_in_a_layer_folder() -> None:
    loose = [name for name in modules() if name not in TOP and folder_of(name) is None]
    assert not loose, "modules outside the layer folders (tests/test_house.py LAYERS): " + ", ".join(loose)


def test_no_folder_imports_a_higher_one() -> None:
    wrong = []
    for i in all_imports():
        source, target = folder_of(i.source), folder_of(i.target)
        if source is not None and target is not None and LEVEL[target] > LEVEL[source]:
            wrong.append(f"{i.source}:{i.line} ({source}/) imports {i.target} ({target}/)")
    assert not wrong, "a folder imports a higher layer (LAYERS, DESIGN.md's direction of data): " + "; ".join(wrong)


def test_the_folders_import_no_circle() -> None:
    edges: dict[str, set[str]] = {}
    for i in all_imports():
        source, target = folder_of(i.source), folder_of(i.target)
        if source is not None and target is not None and source != target:
            edges.setdefault(source, set()).add(target)
    found = circles(edges)
    assert not found, "folder-level import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The reader finds each kind of import, the circle search finds a circle, the use check a misused name."""
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import lightning.pytorch as pl\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_pipe.strategy import PipeStrategy\n"
        "    from lightning_pipe.pipeline.pipeline import Pipeline\n"
        "def f(s: PipeStrategy) -> PipeStrategy:\n"
        "    from lightning_pipe.pipeline.pipeline import resolve_partitioner\n"
        "    x: Pipeline = Pipeline()\n"
    )
    found = {(i.target, i.module_level, i.type_checking) for i in imports_of("lightning_pipe.comm.mod", source, set())}
    assert found == {
        ("typing", True, False),
        ("lightning.pytorch", True, False),
        ("lightning_pipe.comm", True, False),
        ("lightning_pipe.strategy", True, True),
        ("lightning_pipe.pipeline.pipeline", True, True),
        ("lightning_pipe.pipeline.pipeline", False, False),
    }
    used = uses_outside_annotations(ast.parse(source.read_text()), {"PipeStrategy", "Pipeline"})
    assert used == [("Pipeline", 9)]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
