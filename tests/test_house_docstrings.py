"""House rules on module docstrings: what the module is for, in a few lines, and no measurements.

Read from the source with `ast`; nothing is imported. How a part works at length lives in
``docs/internals.md``, measurements in ``benchmarks/`` and the docs' performance page, history in the CHANGELOG.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_pipe"
INTERNALS = PACKAGE.parent / "docs" / "internals.md"
MAX_LINES = 12
# a timing, a speed-up or a share measured on some machine: "1.5 us per call", "3x faster", "40 %"
MEASUREMENT = re.compile(
    r"\b\d+(?:\.\d+)?\s*(?:ns|us|µs|ms)\b|\b\d+(?:\.\d+)?\s*(?:x|times)\s+(?:faster|slower|the)\b|\b\d+(?:\.\d+)?\s*%"
)


def module_docstrings(root: Path) -> dict[str, str]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        text = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=True)
        if text is not None:
            found[str(path.relative_to(root.parent))] = text
    return found


def too_long(docstrings: dict[str, str], limit: int = MAX_LINES) -> dict[str, int]:
    lines = {name: len(text.strip().splitlines()) for name, text in docstrings.items()}
    return {name: n for name, n in lines.items() if n > limit}


def measurements(docstrings: dict[str, str]) -> dict[str, list[str]]:
    found = {name: [m.group(0) for m in MEASUREMENT.finditer(text)] for name, text in docstrings.items()}
    return {name: hits for name, hits in found.items() if hits}


def test_module_docstrings_say_what_the_module_is_for_in_a_few_lines() -> None:
    assert too_long(module_docstrings(PACKAGE)) == {}, f"module docstrings over {MAX_LINES} lines (docs/internals.md)"


def test_module_docstrings_carry_no_measurements() -> None:
    assert measurements(module_docstrings(PACKAGE)) == {}, "measurements belong in benchmarks/ or docs/performance.md"


def test_each_section_of_the_internals_page_names_a_module_that_exists() -> None:
    """A module moved or renamed takes its section's heading along (``## `lightning_pipe/x.py` ``)."""
    named = re.findall(r"(?m)^## `([^`]+)`", INTERNALS.read_text())
    assert named, "docs/internals.md has a section per module, headed by its path"
    assert [n for n in named if not (PACKAGE.parent / n).is_file()] == []


def test_the_checks_see_what_they_look_for() -> None:
    docstrings = {
        "short.py": "What it is for.\n\nOne more line.",
        "long.py": "\n".join(f"line {i}" for i in range(MAX_LINES + 1)),
        "timed.py": "Routing costs about 1.5 us per call and is 3x faster than before.",
        "fine.py": "Blocks from 8 MiB up are mapped; a heartbeat every 2 s; 2 x (bundled - 1).",
    }
    assert too_long(docstrings) == {"long.py": MAX_LINES + 1}
    assert measurements(docstrings) == {"timed.py": ["1.5 us", "3x faster"]}
