"""Test order for pytest-xdist, and XLA:CPU's compile options for the tests.

Order (CI: `-n auto --dist loadgroup` on 2 cores): the tests marked `slow` (a minute
or so of a core each: toolchain compile checks, subprocesses with several host
devices, whole-model decodes) are moved to the front, in collection order, so that
they start first and the short tests fill in around them; a worker left running one
long test alone at the end would set the suite's wall time. Under `--dist loadgroup`
a module whose expensive module fixture must run once (`pytest.mark.xdist_group`) is
one work unit, and xdist starts the largest units first.

Compile options: on a CPU most of the suite's time is XLA compiling thousands of small
programs (about 70%, measured per test through jax.monitoring), not running them. Where
no GPU plugin of jax is installed, the tests' XLA:CPU compiles without LLVM
optimization (`--xla_backend_optimization_level=0`) and, on jaxlib < 0.12 (which has
both), with XLA:CPU's earlier loop emitters instead of its fusion emitters
(`--xla_cpu_use_fusion_emitters=false`): the same HLO, compiled 2-3x faster
(docs/building.md, "CI's time"). Subprocesses the tests start inherit them (those that
set XLA_FLAGS anew add $JAXQUANT_TEST_XLA_FLAGS). A run with
either option already in XLA_FLAGS, or with JAXQUANT_TEST_XLA_DEFAULTS=1, keeps XLA's
defaults.

JAXQUANT_TEST_ONE_CASE=1 runs each test function once (its first parameter set).

Parallel by default: a plain `pytest` (no paths: the whole suite, the README's command)
runs on every core through pytest-xdist (`-n auto --dist loadgroup`) where xdist is
installed (the `test` extra), serially where it is not; a run naming files or tests, or
passing -n itself (`-n 0`: serial), is left as asked.

The full matrix: the parameter sets marked `full` (pytest.param(..., marks=
pytest.mark.full)) are the ones past what the default run needs to cover each code
path once (the longest compile checks, the larger sweeps); a run without
JAXQUANT_TEST_FULL=1 skips them, saying so, and CI (.ci/run) sets it."""

import importlib.metadata
import os

import pytest


def _test_xla_flags() -> list[str]:
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAXQUANT_TEST_XLA_DEFAULTS") == "1" or "xla_backend_optimization_level" in flags:
        return []
    names = {(d.metadata["Name"] or "").lower().replace("_", "-")
             for d in importlib.metadata.distributions()}
    if any(n.startswith(("jax-cuda", "jax-rocm")) for n in names):  # GPU tests: XLA's own
        return []
    out = ["--xla_backend_optimization_level=0"]
    try:
        jaxlib = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        jaxlib = (0, 0)
    if jaxlib < (0, 12) and "xla_cpu_use_fusion_emitters" not in flags:  # gone in 0.12
        out.append("--xla_cpu_use_fusion_emitters=false")
    return out


# JAXQUANT_TEST_XLA_FLAGS: the options added, for subprocesses that set XLA_FLAGS anew.
# Once per run: pytest-xdist's workers inherit both variables from the controller.
if "JAXQUANT_TEST_XLA_FLAGS" not in os.environ:
    os.environ["JAXQUANT_TEST_XLA_FLAGS"] = " ".join(_test_xla_flags())
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), os.environ["JAXQUANT_TEST_XLA_FLAGS"]]).strip()


FULL = os.environ.get("JAXQUANT_TEST_FULL") == "1"


@pytest.hookimpl(tryfirst=True)  # before xdist reads -n
def pytest_cmdline_main(config):
    if (config.pluginmanager.hasplugin("xdist") and os.environ.get("PYTEST_XDIST_WORKER") is None
            and getattr(config.option, "numprocesses", 0) is None
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not config.option.collectonly):
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadgroup"


# JAXQUANT_TEST_SKIPPED_LIST=FILE: the ids of the tests (and modules) this run skipped,
# one a line, written at its end: .ci/run runs the README's `pytest` first with only the
# `test` extra, then, with the optional packages, toolchains and JAXQUANT_TEST_FULL=1,
# only what that run skipped (pytest @FILE).
_SKIPPED: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED.append(report.nodeid)


def pytest_collectreport(report):
    if report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session):
    path = os.environ.get("JAXQUANT_TEST_SKIPPED_LIST")
    if path and os.environ.get("PYTEST_XDIST_WORKER") is None:  # the controller sees all
        with open(path, "w") as f:
            f.writelines(f"{n}\n" for n in dict.fromkeys(_SKIPPED) if n)


def pytest_configure(config):
    config.addinivalue_line("markers", "full: part of the full matrix, run with "
                                       "JAXQUANT_TEST_FULL=1 (CI) and skipped without it")


@pytest.hookimpl(trylast=True)  # after -k and -m deselected theirs
def pytest_collection_modifyitems(config, items):
    if not FULL:
        skip = pytest.mark.skip(reason="the full matrix (JAXQUANT_TEST_FULL=1, as CI runs it); "
                                       "the default run covers this test's other parameters")
        for item in items:
            if item.get_closest_marker("full") is not None:
                item.add_marker(skip)
    if os.environ.get("JAXQUANT_TEST_ONE_CASE") == "1":
        # each test function once, its first parameter set left by -k: .ci/run's Python
        # 3.12 leg, which checks that jaxquant's jax-facing code runs under the newest
        # jax; the parameter sweeps run in the full suite
        seen, kept, dropped = set(), [], []
        for item in items:
            key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
            (dropped if key in seen else kept).append(item)
            seen.add(key)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    # slow tests first; a runs_last test after all (in the order the command line
    # gave, .ci/run's list of what the first run skipped, it could come first)
    items.sort(key=lambda item: (item.get_closest_marker("runs_last") is not None,
                                 item.get_closest_marker("slow") is None))  # stable
