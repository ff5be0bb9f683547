"""House rule on modes: which mode runs is decided by objects, not by branches spread over the package.

A mode (local, rpc, launched) is a `lightning_pipe.strategy.modes.mode.Mode` object chosen once, and
``schedule="async"`` a variant of the step driver (`lightning_pipe.strategy.training.Training`) chosen once;
the code around them asks the object. Counted from the source with `ast`, outside the files of the mode
objects (`MODE_FILES`), a *mode test* is:

- a comparison of a ``world`` with None (``world is None``, ``self.world is not None``);
- a condition that mentions ``asynchronous`` (an ``if``/``elif``/``while`` test, a conditional expression's
  test, an ``assert``, or a boolean operation outside those);
- a comparison with ``transport`` by ``==``, ``!=``, ``in`` or ``not in``;
- a comparison of a mode's name (``mode.name == ...``, ``== LOCAL``/``RPC``/``LAUNCHED``, or their strings).

The package holds at most `MOST` of them (issue 29: "at most 10 mode tests outside the mode objects").
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from test_house import PACKAGE

MOST = 10
#: the mode objects, the mode rule (which transport means which mode, what each refuses) and the one place that
#: chooses among them; the step driver's two variants (a flush after each batch, ``schedule="async"``'s stream)
MODE_FILES = {
    "strategy/layout.py",
    "strategy/modes/mode.py",
    "strategy/modes/rpc_mode.py",
    "strategy/modes/launched_mode.py",
    "strategy/modes/fault_tolerant_mode.py",
    "strategy/modes/mode_choice.py",
    "strategy/training.py",
    "strategy/async_training.py",
}
MODE_NAMES = {"LOCAL", "RPC", "LAUNCHED"}
MODE_STRINGS = {"local", "rpc", "launched"}
COMPARING = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


@dataclass(frozen=True)
class ModeTest:
    path: str
    line: int
    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.kind}) {self.text}"


def _mentions(node: ast.AST, word: str) -> bool:
    """Whether a name or attribute in ``node`` contains ``word``."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name) and word in inner.id:
            return True
        if isinstance(inner, ast.Attribute) and word in inner.attr:
            return True
    return False


def _is_world(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("world", "_world")) or (
        isinstance(node, ast.Attribute) and node.attr in ("world", "_world")
    )


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _is_mode_name(node: ast.expr) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(map(_is_mode_name, node.elts))
    if isinstance(node, ast.Attribute) and node.attr == "name" and _mentions(node.value, "mode"):
        return True
    if isinstance(node, ast.Constant) and node.value in MODE_STRINGS:
        return True
    return isinstance(node, ast.Name) and node.id in MODE_NAMES


def mode_tests_in(source: str, path: str) -> list[ModeTest]:
    """The mode tests of one module's ``source`` (see the module's docstring); each condition counts once."""
    tree = ast.parse(source)
    found: list[ModeTest] = []
    seen: set[int] = set()  # the nodes of a condition already counted (a boolean operation inside an ``if``)

    def add(node: ast.AST, kind: str) -> None:
        found.append(ModeTest(path, getattr(node, "lineno", 0), kind, ast.unparse(node)[:100]))

    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            if _mentions(node.test, "asynchronous"):
                add(node.test, "asynchronous")
            seen.update(id(inner) for inner in ast.walk(node.test))
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and id(node) not in seen and _mentions(node, "asynchronous"):
            add(node, "asynchronous")
            seen.update(id(inner) for inner in ast.walk(node))
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        identity = any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
        comparing = any(isinstance(op, COMPARING) for op in node.ops)
        if identity and any(map(_is_world, operands)) and any(map(_is_none, operands)):
            add(node, "world")
        elif comparing and any(_mentions(o, "transport") for o in operands):
            add(node, "transport")
        elif comparing and any(map(_is_mode_name, operands)):
            add(node, "mode name")
    return found


def mode_tests() -> list[ModeTest]:
    found: list[ModeTest] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative not in MODE_FILES:
            found.extend(mode_tests_in(path.read_text(), relative))
    return found


def test_the_mode_files_exist() -> None:
    missing = [f for f in sorted(MODE_FILES) if not (PACKAGE / f).is_file()]
    assert missing == [], f"MODE_FILES names files the package no longer has: {missing}"


def test_modes_are_decided_by_objects_not_by_branches() -> None:
    found = mode_tests()
    places = "\n".join(map(str, found))
    assert len(found) <= MOST, (
        f"{len(found)} mode tests outside the mode objects (at most {MOST}); ask the `Mode` object or the step "
        f"driver's `Training` instead:\n{places}"
    )


def test_the_count_sees_each_kind_of_mode_test() -> None:
    source = """
if world is None: pass
x = a if self.world is not None else b
if self.asynchronous and ready: pass
ok = asynchronous or other
assert not config.asynchronous
while transport == "rpc": pass
same = self.mode.name != LAUNCHED
known = mode in ("local", "rpc")
fine = stage is None and name == "x"
"""
    kinds = [t.kind for t in mode_tests_in(source, "example.py")]
    assert kinds.count("world") == 2 and kinds.count("asynchronous") == 3
    assert kinds.count("transport") == 1 and kinds.count("mode name") == 2 and len(kinds) == 8
