"""The docs in the repo: every ```python block of README.md and docs/*.md runs as
written (on the CPU, each block on its own in a fresh Python process, as a reader
pastes it: forked from tests/forked_python.py after its imports), and no text points
outside the repo (no links to a folder beside the clone, no design file outside the repo:
the design notes are docs/, docs/design.md the contract).

Every ```python block must run as written on a CPU in a few seconds: make it
self-contained (its own imports and small inputs). A block that needs several
devices says so and sets them itself (`jax.config.update("jax_num_cpu_devices", 8)`
before JAX touches a device: each block gets a fresh process, so it can). Shell
commands go in ```bash blocks, and code that cannot run here (a GPU, a downloaded
checkpoint) in a block fenced without a language."""

import importlib.util
import os
import pathlib
import re

import pytest

from tests.forked_python import ForkedPython

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README] + sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def python_blocks(path):
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = [(f"{p.relative_to(ROOT)}:{line}", code) for p in DOCS for line, code in python_blocks(p)]

# Optional packages a docs block may import (pyproject's extras): a block that needs
# one that is not installed is skipped, naming it; CI's main job installs them all.
OPTIONAL = ("flax", "gguf", "tokenizers", "torch", "transformers", "safetensors")
IMPORTS = re.compile(r"^\s*(?:import|from)\s+([\w.]+(?:\s*,\s*[\w.]+)*)", re.M)


def missing_optional(code):
    """The optional packages `code` imports that are not installed."""
    names = {n.strip().split(".")[0] for m in IMPORTS.finditer(code) for n in m.group(1).split(",")}
    return sorted(n for n in names & set(OPTIONAL) if importlib.util.find_spec(n) is None)


def test_docs_have_python_blocks():
    # the extraction itself works (a renamed fence would skip all)
    names = {where.split(":")[0] for where, _ in BLOCKS}
    assert "README.md" in names and len(names) >= 2, names


def test_missing_optional_packages_are_named():
    code = "import os, gguf\nfrom flax import nnx\nimport jax.numpy as jnp\n"
    missing = missing_optional(code)
    assert set(missing) <= {"gguf", "flax"}
    assert ("gguf" in missing) == (importlib.util.find_spec("gguf") is None)
    assert ("flax" in missing) == (importlib.util.find_spec("flax") is None)
    assert missing_optional("import jax, numpy as np\n") == []


def test_fence_extraction(tmp_path):
    text = "x\n```python\na = 1\n```\n```\nnot python\n```\n```python title\nb = 2\n```\n"
    path = tmp_path / "doc.md"
    path.write_text(text)
    assert python_blocks(path) == [(2, "a = 1\n"), (8, "b = 2\n")]


def _block_env():
    """A reader's environment: the CPU, the repo importable, no backend chosen."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("JAXQUANT_BACKEND", None)
    # a block that needs host devices sets them itself; XLA's compile options of the
    # tests (tests/conftest.py) stay
    env["XLA_FLAGS"] = os.environ.get("JAXQUANT_TEST_XLA_FLAGS", "")
    return env


@pytest.fixture(scope="module")
def python():
    """tests/forked_python.py: a process per block, forked after the imports."""
    with ForkedPython(_block_env(), ROOT) as py:
        yield py


@pytest.mark.slow
@pytest.mark.parametrize("where,code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_docs_python_block_runs(where, code, python):
    missing = missing_optional(code)
    if missing:
        pytest.skip(f"{where} needs {', '.join(missing)} (pip install {' '.join(missing)})")
    run = python.run(["-c", code], timeout=300)
    assert run.returncode == 0, f"{where} failed:\n{run.stderr[-3000:]}"


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "subprocess"])
def test_forked_python_is_a_fresh_process(fork, monkeypatch):
    import tests.forked_python as fp

    monkeypatch.setattr(fp, "FORK", fork and fp.FORK)
    with ForkedPython(_block_env(), ROOT) as python:
        assert (python.proc is not None) == (fork and fp.FORK)
        _check_fresh_processes(python)


def _check_fresh_processes(python):
    assert python.run(["-c", "import jaxquant\nx = 1\nprint(x)"]).stdout == "1\n"
    failed = python.run(["-c", "x\n"])  # the run before left nothing behind
    assert failed.returncode == 1 and "NameError" in failed.stderr, failed
    assert python.run(["-c", "raise SystemExit(3)"]).returncode == 3
    assert python.run(["-c", "import time\ntime.sleep(5)"], timeout=0.5).returncode == -9
    # host devices chosen by the code: JAX had touched no device before the fork
    code = ('import jax\njax.config.update("jax_num_cpu_devices", 3)\n'
            'assert jax.device_count() == 3, jax.devices()\n')
    p = python.run(["-c", code])
    assert p.returncode == 0, p.stderr


def _text_files():
    files = list(DOCS)
    files += sorted((ROOT / "jaxquant").rglob("*.py"))
    return files


# the needles computed, so that this file does not name them itself
@pytest.mark.parametrize("needle", ["../" + "shared", "design".upper() + ".md"])
def test_no_pointers_outside_the_repo(needle):
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _text_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if needle in line]
    assert not hits, f"{needle!r} in {hits} (cite docs/<file>.md instead)"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_resolve():
    """[text](path) links in README.md and docs/ name files of the repo."""
    broken = []
    for p in DOCS:
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
