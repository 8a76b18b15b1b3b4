"""The docs in the repo: every ```python block of README.md runs as written (on the
CPU, each block on its own, as a reader pastes it), and no text points outside the
repo (no ../shared links, no DESIGN.md: the design notes are docs/).

Every ```python block must run as written on a CPU in a few seconds: make it
self-contained (its own imports and small inputs). Shell commands go in ```bash
blocks, and code that cannot run here (a GPU, a downloaded checkpoint) in a
block fenced without a language."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def python_blocks(path):
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks(README)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 1  # the extraction itself works (a renamed fence would skip all)


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("JAXQUANT_BACKEND", raising=False)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


def _text_files():
    files = [README] + sorted((ROOT / "docs").rglob("*.md"))
    files += sorted((ROOT / "jaxquant").rglob("*.py"))
    return files


@pytest.mark.parametrize("needle", ["../shared", "DESIGN.md"])
def test_no_pointers_outside_the_repo(needle):
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _text_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if needle in line]
    assert not hits, f"{needle!r} in {hits} (cite docs/<file>.md instead)"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_resolve():
    """[text](path) links in README.md and docs/ name files of the repo."""
    broken = []
    for p in [README] + sorted((ROOT / "docs").rglob("*.md")):
        for target in LINK.findall(p.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            if not (p.parent / target).exists():
                broken.append(f"{p.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_version_is_one_and_in_the_changelog():
    import jaxquant

    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert jaxquant.__version__ == version
    assert re.search(rf"^## {re.escape(version)}\b", (ROOT / "CHANGELOG.md").read_text(), re.M)
