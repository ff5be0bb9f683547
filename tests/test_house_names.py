"""House rules on names: one class per name, and control calls named by their method, never by a string.

Read from the source with `ast`; nothing is imported. A control call is a method of `StageProtocol`
(`engine/stage_protocol.py`), reached through `CoordinatorLink` (`engine/coordinator_link.py`), which sends the
method's own name: a call site names the method (``stages.call(StageProtocol.grad_norm, 2.0)``), so a
type checker checks it and go-to-definition finds it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_pipe"
PROTOCOL_FILES = {PACKAGE / "engine" / "stage_protocol.py", PACKAGE / "engine" / "coordinator_link.py"}
CALL_METHODS = {"call", "post", "call_each", "post_each"}


def _sources(root: Path) -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(root.rglob("*.py"))}


def classes_defined_twice(root: Path) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for path, tree in _sources(root).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(root.parent)))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def calls_named_by_a_string(root: Path, allowed: set[Path]) -> list[str]:
    """``x.call("name", ...)``-like calls and ``Message(..., payload=("name", args))`` outside ``allowed``."""
    found = []
    for path, tree in _sources(root).items():
        if path in allowed:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            first = node.args[0] if node.args else None
            named = isinstance(node.func, ast.Attribute) and node.func.attr in CALL_METHODS
            if named and isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
            for keyword in node.keywords:
                value = keyword.value
                if keyword.arg == "payload" and isinstance(value, ast.Tuple) and value.elts:
                    head = value.elts[0]
                    if isinstance(head, ast.Constant) and isinstance(head.value, str):
                        found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_class_name_is_defined_twice() -> None:
    assert classes_defined_twice(PACKAGE) == {}


def test_no_control_call_is_named_by_a_string_outside_the_protocol() -> None:
    assert calls_named_by_a_string(PACKAGE, PROTOCOL_FILES) == []


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("class Twice: ...\ncoordinator.call('grads')\nstages.post_each('x', [])\n")
    (package / "b.py").write_text("class Twice: ...\nMessage('call', 0, payload=('ping', ()))\nstages.call(P.grads)\n")
    assert classes_defined_twice(package) == {"Twice": ["pkg/a.py", "pkg/b.py"]}
    assert calls_named_by_a_string(package, set()) == ["pkg/a.py:2", "pkg/a.py:3", "pkg/b.py:2"]


def test_a_stage_serves_exactly_the_protocol_and_the_coordinator_refuses_other_methods() -> None:
    import pytest

    from lightning_pipe.base.errors import PipeError
    from lightning_pipe.engine import CoordinatorLink, StageProtocol

    protocol = StageProtocol(3, None, None, None, None)  # type: ignore[arg-type]
    assert protocol.serve("ping")() == 3
    with pytest.raises(PipeError, match=r"serves no call 'serve'; it serves .*apply_grads"):
        protocol.serve("serve")
    with pytest.raises(TypeError, match="not a control call"):
        CoordinatorLink(None, 1, 1.0).call(CoordinatorLink.ping)  # type: ignore[arg-type]


#: a basename several modules may share: a package's own files, and the same role in sibling plug-in folders
#: (a ``base.py`` or ``registry.py`` per plug-in family, a ``communicator.py`` per transport under comm/)
SHARED_BASENAMES = {"__init__.py", "__main__.py", "base.py", "registry.py", "communicator.py"}


def modules_by_basename(root: Path) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        where[path.name].append(path.relative_to(root).as_posix())
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_one_module_per_basename() -> None:
    shared = {name: paths for name, paths in modules_by_basename(PACKAGE).items() if name not in SHARED_BASENAMES}
    assert not shared, f"modules sharing a basename (one name per concept): {shared}"


def test_the_basename_check_finds_a_shared_name(tmp_path: Path) -> None:
    for folder in ("engine", "pipeline"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "stage_state.py").write_text("")
    assert modules_by_basename(tmp_path) == {"stage_state.py": ["engine/stage_state.py", "pipeline/stage_state.py"]}
