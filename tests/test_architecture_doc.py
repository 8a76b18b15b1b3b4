"""docs/architecture.md names real code: every `path/file.py:name` (a Python module's
function, class or attribute, dotted names allowed), `jaxquant.module.name` and
`path/file.h:name` (a native identifier) it mentions exists, so the walk of a jq.qmm
call cannot drift from the code without this test failing."""

import ast
import dataclasses
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TEXT = DOC.read_text()

# `jaxquant/pallas/qmm.py:lower_qmm`, `cpu_src/cpu_ffi.cc:CpuPlatform`
FILE_REF = re.compile(r"`((?:[\w-]+/)*[\w-]+\.(?:py|h|cc|hip|inc)):([\w.]+)`")
# `jaxquant.dispatch.register`, `jaxquant.pallas.configs`
DOTTED_REF = re.compile(r"`(jaxquant(?:\.\w+)+)`")
# `jaxquant/bench/`, `jaxquant/pallas/gemv.py`
PATH_REF = re.compile(r"`((?:cpu_src|gpu_src|include|jaxquant|tests|scripts|tools)/[\w./-]*)`")

FILE_REFS = sorted(set(FILE_REF.findall(TEXT)))
DOTTED_REFS = sorted(set(DOTTED_REF.findall(TEXT)))
PATH_REFS = sorted(set(PATH_REF.findall(TEXT)) - {f for f, _ in FILE_REFS})


def _resolve_python(module, attr):
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def _missing_package(error):
    """The top-level name of the third-party package whose absence raised `error` (the
    modules for optional packages, e.g. jaxquant.nnx without flax), else None."""
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and error.name:
            top = error.name.split(".")[0]
            return None if top == "jaxquant" else top
        error = error.__cause__
    return None


def _defined_in_source(file, attr):
    """attr (dotted: a class's member) is defined in file's source: a def, class or
    assignment at module level, then inside the class named before it."""
    body = ast.parse(file.read_text()).body
    for part in attr.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            if part in names:
                found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def test_the_doc_names_code():
    assert len(FILE_REFS) >= 20 and DOTTED_REFS and PATH_REFS   # the parsing itself works


@pytest.mark.parametrize("path,name", FILE_REFS, ids=[f"{p}:{n}" for p, n in FILE_REFS])
def test_file_reference_exists(path, name):
    file = ROOT / path
    assert file.is_file(), f"{path} does not exist"
    if path.endswith(".py"):
        module = path[:-3].replace("/", ".").removesuffix(".__init__")
        try:
            _resolve_python(module, name)
        except ImportError as e:
            # a module for an optional package that is not installed (jaxquant.nnx needs
            # flax, in the `ci` extra): its source still has to define the name
            if _missing_package(e) is None:
                raise
            assert _defined_in_source(file, name), f"{name} not defined in {path}"
    else:
        ident = name.split(".")[-1]
        assert re.search(rf"\b{re.escape(ident)}\b", file.read_text()), f"{name} not in {path}"


@pytest.mark.parametrize("ref", DOTTED_REFS)
def test_dotted_reference_imports(ref):
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):      # the longest importable module, then attributes
        try:
            importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        _resolve_python(".".join(parts[:i]), ".".join(parts[i:]))
        return
    pytest.fail(f"{ref} does not import")


@pytest.mark.parametrize("path", PATH_REFS)
def test_path_reference_exists(path):
    assert (ROOT / path).exists(), path


def test_the_model_code_reads_config_fields_not_family_names():
    """"Adding a model family" holds: every family has its traits, and the decoder's
    modules never branch on a family's name (only the checkpoint name maps do)."""
    from jaxquant.models import config

    assert set(config.FAMILY_TRAITS) == set(config.FAMILIES)
    for family, traits in config.FAMILY_TRAITS.items():
        cfg_fields = {f.name for f in dataclasses.fields(config.Config)}
        assert set(traits) <= cfg_fields, family
        assert traits["mlp_activation"] in config.MLP_ACTIVATIONS
        assert traits["moe_router"] in config.MOE_ROUTERS
    for module in ("layers", "moe", "params", "decoder", "parallel", "sampling"):
        source = (ROOT / "jaxquant" / "models" / f"{module}.py").read_text()
        assert not re.search(r"\.family\b", source), f"models/{module}.py reads cfg.family"
