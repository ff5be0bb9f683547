"""The documentation cannot rot: every page's opening example runs, and every relative link resolves.

Each page under docs/ (but the generated schedules.md and architecture.md) opens with a short runnable
example, its first ```python block, before the page's first `##` heading; the README's first ```python
block is its shortest complete example. The examples that run in one process share one subprocess (each in
a temporary directory of its own, so imports are paid once); the ones that start processes (launched mode,
rpc workers) run as scripts of their own, as their pages say, at the same time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from launching import ROOT, base_env, free_port, kill
from processes import session_members

DOCS = ROOT / "docs"
WITHOUT_EXAMPLE = {"architecture.md", "schedules.md"}  # the lead's page; the generated grids
OWN_SCRIPT = {"launched.md", "rpc.md"}  # start processes: each runs as `python example.py`
TIMEOUT = 180.0  # seconds for all of them together (about 30 on a quiet 2-core machine)
MARK = "DOC-EXAMPLE "

RUNNER = """
import json, os, runpy, sys, tempfile, time, traceback
mark, examples = sys.argv[1], json.loads(sys.argv[2])
for page, path in examples:
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            runpy.run_path(path, run_name="__main__")
            ok = True
        except BaseException:
            traceback.print_exc()
            ok = False
    sys.stdout.flush()
    print(mark + json.dumps({"page": page, "ok": ok, "seconds": time.monotonic() - start}), flush=True)
"""


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def example_pages() -> list[str]:
    return ["README.md", *(p.name for p in sorted(DOCS.glob("*.md")) if p.name not in WITHOUT_EXAMPLE)]


def outside_code(text: str) -> list[str]:
    """The lines of ``text`` that are not inside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def opening_example(page: Path) -> str:
    """The first ```python block of ``page``; on a docs page it must come before the first ``##`` heading."""
    text = page.read_text()
    match = re.search(r"^```python\n(.*?)^```$", text, re.S | re.M)
    assert match, f"{page.name} has no ```python example"
    if page.parent == DOCS:
        first_section = re.search(r"^## ", "\n".join(outside_code(text[: match.start()])), re.M)
        assert first_section is None, f"{page.name}: the example must open the page, before its first ## heading"
    return match.group(1)


@dataclass
class Outcome:
    ok: bool
    seconds: float
    output: str


def sessions_alive(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    """The processes of ``procs``' sessions still alive after ``timeout`` seconds (empty once all ended)."""
    until = time.monotonic() + timeout
    while (left := [pid for proc in procs for pid in session_members(proc.pid)]) and time.monotonic() < until:
        time.sleep(0.2)
    return left


@dataclass
class Examples:
    outcomes: dict[str, Outcome]  # by page
    left_behind: list[int]  # processes of the examples' sessions still alive 10 s after the examples ended


def run_examples(folder: Path) -> Examples:
    """Every page's opening example: the one-process ones in one subprocess, the others each in its own."""
    shared, scripts = [], {}
    for name in example_pages():
        path = folder / (name.replace(".md", "") + "_example.py")
        path.write_text(opening_example(ROOT / name if name == "README.md" else DOCS / name))
        if name in OWN_SCRIPT:
            scripts[name] = path
        else:
            shared.append((name, str(path)))
    env = base_env()
    commands = {"shared": ([sys.executable, "-c", RUNNER, MARK, json.dumps(shared)], env)}
    for name, path in scripts.items():
        commands[name] = ([sys.executable, str(path)], env | {"MASTER_PORT": str(free_port())})
    logs = {key: folder / f"{key}.log" for key in commands}
    start = time.monotonic()
    ended: dict[str, float] = {}  # seconds from the start, by command
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for key, (command, command_env) in commands.items():
            with open(logs[key], "w") as log:  # a file, not a pipe: no process waits for a reader
                procs[key] = subprocess.Popen(
                    command, env=command_env, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        while len(ended) < len(procs) and time.monotonic() - start < TIMEOUT:
            for key, proc in procs.items():
                if key not in ended and proc.poll() is not None:
                    ended[key] = time.monotonic() - start
            time.sleep(0.2)
        left = sessions_alive(list(procs.values()), timeout=10.0)
    finally:
        for proc in procs.values():
            kill(proc)  # its whole session: Lightning's second process, rpc workers
            proc.wait()
    outputs = {key: log.read_text() for key, log in logs.items()}
    for key in procs:
        if key not in ended:
            outputs[key] += f"\n[test] killed after {TIMEOUT:.0f} s"
    results = {
        name: Outcome(name in ended and procs[name].returncode == 0, ended.get(name, TIMEOUT), outputs[name][-6000:])
        for name in scripts
    }
    chunks = re.split(rf"^{MARK}(.*)$", outputs["shared"], flags=re.M)
    for output, report in zip(chunks[0::2], chunks[1::2], strict=False):
        done = json.loads(report)
        results[done["page"]] = Outcome(done["ok"], done["seconds"], output[-6000:])
    for name, _ in shared:
        ending = "did not run; the shared process ended with:\n" + outputs["shared"][-6000:]
        results.setdefault(name, Outcome(False, ended.get("shared", TIMEOUT), ending))
    return Examples(results, left)


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Examples:
    return run_examples(tmp_path_factory.mktemp("doc_examples"))


@pytest.mark.slow
@pytest.mark.parametrize("page", example_pages())
def test_page_opens_with_an_example_that_runs(page: str, examples: Examples) -> None:
    outcome = examples.outcomes[page]
    print(f"{page}: {'ran' if outcome.ok else 'FAILED'} in {outcome.seconds:.1f} s")
    assert outcome.ok, f"the opening example of {page} failed:\n{outcome.output}"


@pytest.mark.slow
def test_examples_leave_no_process_behind(examples: Examples) -> None:
    assert examples.left_behind == [], "processes of the examples (a launched rank, an rpc worker) outlived them"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in outside_code(page.read_text()):
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def links(page: Path) -> list[str]:
    """The targets of the page's markdown links and images, outside code blocks and code spans."""
    text = re.sub(r"`[^`\n]*`", "code", "\n".join(outside_code(page.read_text())))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in pages():
        for target in links(page):
            if re.match(r"[a-z]+:", target):
                continue  # https://, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {resolved.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if t.startswith("docs/")}
    assert linked, "the README links no docs page"
    missing = [str(p.relative_to(ROOT)) for p in linked if not p.exists()]
    assert not missing, f"the README links pages that do not exist: {missing}"
    unlinked = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README's table of topics does not link: {unlinked}"
    for name in example_pages():
        opening_example(ROOT / name if name == "README.md" else DOCS / name)  # each opens with an example
