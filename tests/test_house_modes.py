"""House rule on modes: which mode runs is decided by objects, not by branches spread over the package.

A mode (local, rpc, launched) is a `lightning_pipe.strategy.modes.mode.Mode` object chosen once, and
``schedule="async"`` a variant of the step driver (`lightning_pipe.strategy.training.Training`) chosen once;
the code around them asks the object. Counted from the source with `ast`, outside the files of the mode
objects (`MODE_FILES`), a *mode test* is:

- a comparison of a ``world`` with None (``world is None``, ``self.world is not None``);
- a condition that mentions ``asynchronous`` (an ``if``/``elif``/``while`` test, a conditional expression's
  test, an ``assert``, or a boolean operation outside those);
- a comparison with ``transport`` by ``==``, ``!=``, ``in`` or ``not in``;
- a comparison of a mode's name (``mode.name == ...``, ``== LOCAL``/``RPC``/``LAUNCHED``, or their strings);
- a mode flag (`FLAGS`: ``stages_own_parameters``, ``launched``) named anywhere: read, tested, passed on or taken.

The package holds at most `MOST` of them (issue 29: "at most 10 mode tests outside the mode objects"), and none that
asks which mode runs (`MODE_FLAG_KINDS`, issue 39: "no mode flag is passed around or tested; ask the mode instead";
what remain are the rpc transport's own world and the schedules' ``asynchronous``).

The modes are interfaces each mode fills in full (issue 39): the abstract classes of `INTERFACES` hold no behaviour
(only abstract methods, their bodies a docstring), and each class that implements one derives from interfaces only
and defines every abstract method itself (`IMPLEMENTATIONS`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass

from test_house import PACKAGE

MOST = 10
#: the mode objects, the mode rule (which transport means which mode, what each refuses) and the one place that
#: chooses among them; the step driver's two variants (a flush after each batch, ``schedule="async"``'s stream)
MODE_FILES = {
    "strategy/layout.py",
    "strategy/modes/mode.py",
    "strategy/modes/local_mode.py",
    "strategy/modes/rpc_mode.py",
    "strategy/modes/launched_mode.py",
    "strategy/modes/replica_groups.py",
    "strategy/modes/mode_choice.py",
    "strategy/training.py",
    "strategy/async_training.py",
}
MODE_NAMES = {"LOCAL", "RPC", "LAUNCHED"}
MODE_STRINGS = {"local", "rpc", "launched"}
COMPARING = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
#: the flags that said which mode runs before the modes were objects (issue 39): never tested nor passed on
FLAGS = {"stages_own_parameters", "launched"}
#: the kinds of mode test that ask which mode runs: none outside the mode files
MODE_FLAG_KINDS = {"flag", "mode name", "transport"}
#: the files of the interfaces a mode (or a transport's parameter home) fills in, and their abstract classes
INTERFACES = {
    "strategy/modes/mode.py": {"Collectives", "ProcessWorld", "StageResidence", "TrainingStateIO", "Mode"},
    "comm/parameter_home.py": {"ParameterHome"},
}
#: every implementation of an interface, by module: each defines every abstract method itself
IMPLEMENTATIONS = {
    "Mode": {
        "lightning_pipe.strategy.modes.local_mode.LocalMode",
        "lightning_pipe.strategy.modes.rpc_mode.RpcMode",
        "lightning_pipe.strategy.modes.launched_mode.LaunchedMode",
    },
    "Collectives": {
        "lightning_pipe.strategy.modes.one_process.Alone",
        "lightning_pipe.strategy.modes.launched_collectives.CoordinatorCollectives",
    },
    "ParameterHome": {
        "lightning_pipe.comm.parameter_home.SharedParameters",
        "lightning_pipe.comm.parameter_home.StageCopies",
    },
}


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


def _is_flag(node: ast.AST) -> bool:
    """Whether ``node`` names a mode flag (`FLAGS`): a name, an attribute, a keyword argument or a parameter."""
    if isinstance(node, ast.Name):
        return node.id in FLAGS
    if isinstance(node, ast.Attribute):
        return node.attr in FLAGS
    return isinstance(node, (ast.keyword, ast.arg)) and node.arg in FLAGS


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
        if _is_flag(node):
            add(node, "flag")
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp) and id(node) not in seen:
            if _mentions(node, "asynchronous"):
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


def test_no_mode_flag_is_tested_or_passed_outside_the_modes() -> None:
    found = [t for t in mode_tests() if t.kind in MODE_FLAG_KINDS]
    places = "\n".join(map(str, found))
    assert found == [], (
        f"{len(found)} tests of which mode runs outside the mode files; ask the mode (`strategy.mode`, a method whose "
        f"answer differs by mode) or the communicator's `parameters` instead:\n{places}"
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
    flags = """
if self.communicator.stages_own_parameters: pass
send = a if not own.stages_own_parameters else b
ok = launched and ready
load(states, launched=True)
def opens(path, launched): pass
own = mode.stages_own_parameters
launched_mode = stages_owned = 1
"""
    assert [t.kind for t in mode_tests_in(flags, "example.py")] == ["flag"] * 6


def _interface_classes() -> dict[str, ast.ClassDef]:
    """The abstract classes of `INTERFACES`, by name, read from their files."""
    found: dict[str, ast.ClassDef] = {}
    for path, names in INTERFACES.items():
        classes = {n.name: n for n in ast.parse((PACKAGE / path).read_text()).body if isinstance(n, ast.ClassDef)}
        missing = names - set(classes)
        assert not missing, f"{path} no longer defines {sorted(missing)}: update INTERFACES"
        found.update({name: classes[name] for name in names})
    return found


def _behaviour_in(cls: ast.ClassDef) -> list[str]:
    """What ``cls``'s body holds besides its docstring, annotations without a value and abstract methods whose body
    is a docstring (or ``...``)."""
    held = []
    for index, node in enumerate(cls.body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.AnnAssign) and node.value is None:
            continue  # a name each mode gives a value
        if isinstance(node, ast.FunctionDef):
            abstract = any(ast.unparse(d) in ("abstractmethod", "abc.abstractmethod") for d in node.decorator_list)
            body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) else node.body
            empty = all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)
            if abstract and empty:
                continue
        held.append(f"{cls.name} line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return held


def test_the_mode_interfaces_hold_no_behaviour() -> None:
    held = [line for cls in _interface_classes().values() for line in _behaviour_in(cls)]
    assert held == [], (
        "the mode interfaces hold behaviour; give it to each mode (or an object they hold):\n" + "\n".join(held)
    )


def _load(qualified: str) -> type:
    module, _, name = qualified.rpartition(".")
    found: type = getattr(importlib.import_module(module), name)
    return found


def test_every_mode_implements_every_abstract_method_itself() -> None:
    """Each implementation derives from interfaces only (no behaviour inherited from another class of the package)
    and defines each abstract method of its interface in its own body."""
    interfaces = _interface_classes()
    problems = []
    for interface, implementations in IMPLEMENTATIONS.items():
        for qualified in sorted(implementations):
            cls = _load(qualified)
            base = next(b for b in cls.__mro__ if b.__name__ == interface)
            assert inspect.isabstract(base) and base.__abstractmethods__, f"{interface} has no abstract methods"
            missing = sorted(name for name in base.__abstractmethods__ if name not in vars(cls))
            if missing:
                problems.append(f"{cls.__name__} inherits {', '.join(missing)}")
            inherited = [b.__name__ for b in cls.__bases__ if b.__name__ not in interfaces]
            if inherited:
                problems.append(f"{cls.__name__} derives from {', '.join(inherited)}, not an interface")
            if inspect.isabstract(cls):
                problems.append(f"{cls.__name__} is abstract: {sorted(cls.__abstractmethods__)}")
    assert problems == [], "\n".join(problems)


def test_every_implementation_of_a_mode_interface_is_listed() -> None:
    """A class of the package deriving from an interface is in `IMPLEMENTATIONS` (so the test above sees it)."""
    interfaces = set(_interface_classes())
    listed = {q.rpartition(".")[2] for names in IMPLEMENTATIONS.values() for q in names}
    unlisted = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in interfaces and node.name not in listed:
                bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
                if bases & interfaces:
                    unlisted.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert unlisted == [], f"implementations of a mode interface missing from IMPLEMENTATIONS: {unlisted}"
