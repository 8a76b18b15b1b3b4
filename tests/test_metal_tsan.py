"""The Metal kernels under ThreadSanitizer, on the MSL-on-CPU shim (tests/metal_shim/):
every kernel dispatched once with the bridge's plans; TSan reports any access to
threadgroup or device memory that no barrier orders, whether or not it changed a result.
A kernel with a missing barrier is reported (the check can fail). Separate from
tests/test_metal.py because the sanitizer build takes ~30 s of CPU."""

import os
import subprocess

import pytest

from tests.metal_shim import shim

# one xdist work unit: the sanitizer build (the module fixture) then runs once, not per worker
# compiles and runs the MSL shim under ThreadSanitizer (half a minute of CPU): CI's full
# matrix (tests/conftest.py), not the README's run
pytestmark = [pytest.mark.toolchain, pytest.mark.slow, pytest.mark.full,
              pytest.mark.xdist_group("metal_tsan")]


@pytest.fixture(scope="module")
def tsan_driver(tmp_path_factory):
    if shim.cxx() is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("metal_tsan")
    probe = subprocess.run([shim.cxx(), "-fsanitize=thread", "-x", "c++", "-", "-o",
                            str(out / "probe")], input="int main() { return 0; }",
                           capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"the C++ compiler cannot build with -fsanitize=thread: {probe.stderr[-300:]}")
    return shim.build_tsan(out)


def _run(exe, *args):
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=600)


def test_kernels_have_no_data_races(tsan_driver):
    r = _run(tsan_driver)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "dispatched 63 kernels" in r.stdout


def test_a_missing_barrier_is_reported(tsan_driver):
    r = _run(tsan_driver, "racy")
    assert r.returncode == 66 and "ThreadSanitizer: data race" in r.stderr
    assert "faulty.metal" in r.stderr
