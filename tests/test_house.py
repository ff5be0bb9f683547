"""House rules on the package's imports: no circles, Lightning only in the strategy, data flows one way.

The imports are read from the source with `ast`; nothing is imported. An import inside
``if TYPE_CHECKING:`` does not run and does not count; one inside a function runs when the function
is called: it counts for the direction of the layers but cannot close an import circle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_pipe"
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")  # Lightning's packages
LOWER = ("comm", "engine", "schedule", "partition", "executors", "runtime", "backends")  # below the pipeline
UPPER = (  # the strategy, and the pipeline with the modules it is made of
    "lightning_pipe.strategy",
    "lightning_pipe.pipeline",
    "lightning_pipe.pipeline_inputs",
    "lightning_pipe.stage_state",
    "lightning_pipe.transports",
)
# ``import lightning_pipe`` registers the strategy name with Lightning's StrategyRegistry (DESIGN.md):
# the package's own __init__ is the one place outside strategy/ that may name Lightning.
LIGHTNING_ALLOWED = ("lightning_pipe",)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a name imported from a module counts as the module)
    line: int
    module_level: bool  # runs when the module is imported (not inside a function)


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
    """Every import of ``path`` that runs at some point (TYPE_CHECKING blocks left out)."""
    found: list[Import] = []
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, module_level)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(name, alias.name, node.lineno, module_level))
            return
        if isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append(Import(name, submodule if submodule in known else base, node.lineno, module_level))
            return
        inner = module_level and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), True)
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


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_package_imports_no_circles() -> None:
    known = set(modules())
    edges: dict[str, set[str]] = {}
    for i in all_imports():
        if i.module_level and i.target in known and i.target != i.source:
            edges.setdefault(i.source, set()).add(i.target)
    found = circles(edges)
    assert not found, "import circles among module-level imports: " + "; ".join(" <-> ".join(c) for c in found)


def test_only_the_strategy_imports_lightning() -> None:
    wrong = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in all_imports()
        if i.module_level
        and any(_is_under(i.target, package) for package in LIGHTNING)
        and not _is_under(i.source, "lightning_pipe.strategy")
        and i.source not in LIGHTNING_ALLOWED
    ]
    assert not wrong, "Lightning imported outside lightning_pipe.strategy: " + "; ".join(wrong)


def test_the_lower_layers_never_import_upward() -> None:
    lower = tuple(f"lightning_pipe.{package}" for package in LOWER)
    wrong = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in all_imports()
        if any(_is_under(i.source, p) for p in lower) and any(_is_under(i.target, u) for u in UPPER)
    ]
    assert not wrong, "a lower layer imports the pipeline or the strategy: " + "; ".join(wrong)


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The reader finds each kind of import, and the circle search finds a circle."""
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import lightning.pytorch as pl\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_pipe.strategy import PipeStrategy\n"
        "def f():\n"
        "    from lightning_pipe.pipeline import Pipeline\n"
    )
    found = {(i.target, i.module_level) for i in imports_of("lightning_pipe.comm.mod", source, set())}
    assert found == {
        ("typing", True),
        ("lightning.pytorch", True),
        ("lightning_pipe.comm", True),
        ("lightning_pipe.pipeline", False),
    }
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
