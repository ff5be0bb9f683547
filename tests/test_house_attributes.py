"""House rule on private attributes: a class reads only the ``self._x`` that it (or its own file) defines.

A mixin that reads ``self._x`` set by another file's class is one class spread over files: a rename
there breaks it where no type checker looks. The rule, read from the source with `ast`:

- a *read* is a load of ``self._x`` (one leading underscore or a mangled ``__x``; dunders are not
  private) anywhere in a method of class ``C``, closures included;
- ``_x`` is *defined* for ``C`` when a method of ``C``, or of a base class of ``C`` defined in the same
  module, assigns ``self._x`` (``=``, an annotated assignment with a value, ``+=``, a ``for``/``with``
  target, ``setattr(self, "_x", ...)``), or the class body of one of them defines ``_x`` (a value,
  a method or property named ``_x``, a nested class); an annotation without a value declares a type,
  not a value, and defines ``_x`` only in a dataclass, a ``NamedTuple``, a ``TypedDict`` or a ``Protocol``;
- a base class from outside the package (torch's, Lightning's) defines what its own source assigns or
  its class holds: that one is imported and read (`inspect`), the only import this test does.

Every read must be of a defined attribute.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

from test_house import PACKAGE, module_name, modules

DECLARING_BASES = ("NamedTuple", "TypedDict", "Protocol")


@dataclass(frozen=True)
class Read:
    path: str
    line: int
    cls: str
    attribute: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.cls} reads self.{self.attribute}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _name(node: ast.expr) -> str:
    """The last part of a (dotted) name: ``dataclasses.dataclass`` -> ``dataclass``."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _self_attribute(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _method_nodes(cls: ast.ClassDef) -> list[ast.AST]:
    """Every node inside the methods of ``cls`` (closures included, nested classes left to themselves)."""
    found: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        found.append(node)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.ClassDef):
                visit(child)

    for statement in cls.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            visit(statement)
    return found


def defined_by(cls: ast.ClassDef) -> set[str]:
    """What ``cls`` itself defines: its class body's names and what its methods assign to ``self``."""
    declares = any(_name(d) == "dataclass" for d in cls.decorator_list) or any(
        _name(b) in DECLARING_BASES for b in cls.bases
    )
    names: set[str] = set()
    for statement in cls.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign):
            names |= {n.id for t in statement.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            if statement.value is not None or declares:
                names.add(statement.target.id)
    for node in _method_nodes(cls):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign) and node.value is not None or isinstance(node, ast.AugAssign):
            targets = [node.target]
        elif isinstance(node, ast.For | ast.AsyncFor):
            targets = [node.target]
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            targets = [node.optional_vars]
        elif isinstance(node, ast.Call):
            names |= _set_by_call(node)
        names |= {a for t in targets for n in ast.walk(t) if (a := _self_attribute(n)) is not None}
    return names


def _set_by_call(call: ast.Call) -> set[str]:
    """``setattr(self, "_x", v)``, ``object.__setattr__(self, "_x", v)`` or ``super().__setattr__("_x", v)``."""
    function, args = _name(call.func), [a for a in call.args if not (isinstance(a, ast.Name) and a.id == "self")]
    if function not in ("setattr", "__setattr__") or len(args) != 2:
        return set()
    named = args[0]
    return {named.value} if isinstance(named, ast.Constant) and isinstance(named.value, str) else set()


def _outside_definitions(module: str, qualname: str) -> set[str]:
    """What the classes outside the package in the MRO of ``module.qualname`` define."""
    obj: object = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    assert isinstance(obj, type)
    names: set[str] = set()
    for base in obj.__mro__[1:]:
        if base.__module__.split(".")[0] == "lightning_pipe":
            continue
        names |= set(vars(base))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):  # a class without Python source (a builtin)
            continue
        names |= {n for cls in tree.body if isinstance(cls, ast.ClassDef) for n in defined_by(cls)}
    return names


def unknown_reads(path: Path, root: Path = PACKAGE.parent) -> list[Read]:
    """The reads of ``self._x`` in ``path`` that neither the class nor its same-module bases define."""
    tree = ast.parse(path.read_text(), str(path))
    classes: dict[str, ast.ClassDef] = {}
    qualnames: dict[ast.ClassDef, str] = {}

    def collect(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                classes.setdefault(child.name, child)
                qualnames[child] = prefix + child.name
                collect(child, prefix + child.name + ".")
            elif not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                collect(child, prefix)

    collect(tree, "")

    def lineage(cls: ast.ClassDef, seen: frozenset[str] = frozenset()) -> tuple[set[str], bool]:
        """What ``cls`` and its same-module bases define, and whether any base is outside the module."""
        names, outside = defined_by(cls), False
        for base in cls.bases:
            parent = classes.get(_name(base)) if isinstance(base, ast.Name) else None
            if parent is None or parent.name in seen:
                outside = outside or _name(base) not in ("object", "Generic")
                continue
            more, further = lineage(parent, seen | {cls.name})
            names, outside = names | more, outside or further
        return names, outside

    relative = str(path.relative_to(root))
    found = []
    for cls, qualname in qualnames.items():
        names, outside = lineage(cls)
        reads = [
            (node.lineno, attribute)
            for node in _method_nodes(cls)
            if (attribute := _self_attribute(node)) is not None
            and isinstance(node.ctx, ast.Load)
            and _private(attribute)
            and attribute not in names
        ]
        if reads and outside:  # reads that a base from elsewhere may define
            names |= _outside_definitions(module_name(path), qualname)
        found += [Read(relative, line, cls.name, a) for line, a in sorted(reads) if a not in names]
    return found


def test_no_class_reads_private_attributes_it_does_not_define() -> None:
    wrong = [str(read) for path in modules().values() for read in unknown_reads(path)]
    assert not wrong, "private attributes read but defined elsewhere (hold a part instead): " + "; ".join(wrong)


def test_the_rule_sees_a_mixin(tmp_path: Path) -> None:
    """A mixin reading what only another class sets is caught; a base in the same file, a property, a
    dataclass field and a class-level value are definitions; an annotation alone is not."""
    source = tmp_path / "mixed.py"
    source.write_text(
        "from dataclasses import dataclass\n"
        "class Mixin:\n"
        "    _seen: int\n"
        "    _limit = 3\n"
        "    def f(self):\n"
        "        return self._seen + self._limit + self._other\n"
        "class Base:\n"
        "    def __init__(self):\n"
        "        self._a, (self._b, _) = 1, (2, 3)\n"
        "        setattr(self, '_c', 4)\n"
        "    @property\n"
        "    def _d(self):\n"
        "        return self._a\n"
        "class Child(Base):\n"
        "    def g(self):\n"
        "        return self._a + self._b + self._c + self._d + self.__dict__['x']\n"
        "@dataclass\n"
        "class Fields:\n"
        "    _x: int\n"
        "    def h(self):\n"
        "        return self._x\n"
    )
    reads = sorted((r.line, r.cls, r.attribute) for r in unknown_reads(source, tmp_path))
    assert reads == [(6, "Mixin", "_other"), (6, "Mixin", "_seen")]
