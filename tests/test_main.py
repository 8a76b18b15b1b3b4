"""`python -m jaxquant`: the report main job (backends, per-mode round-trip error)
and its command line, run in subprocesses."""

import os
import re
import subprocess
import sys

import pytest

from tests import oracle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("reference", "pallas", "ffi", "metal")

# `python -m jaxquant report` with one (bits, group) per mode. The full report
# (every bits x group of affine and fp4, 27 rows) compiles one round trip per
# row, ~30 s on 2 cores, and has no size or mode option; the table the report
# iterates is trimmed to each mode's defaults, the rest runs as `python -m`.
REPORT_ONE_ROW_PER_MODE = """
import dataclasses, runpy, sys
import jaxquant
jaxquant.FORMATS = {m: dataclasses.replace(f, bits=(f.default_bits,),
                                           group_sizes=(f.default_group_size,))
                    for m, f in jaxquant.FORMATS.items()}
sys.argv = ["jaxquant", "report"]
runpy.run_module("jaxquant", run_name="__main__", alter_sys=True)
"""


def run(args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "JAXQUANT_BACKEND"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_report_prints_backends_and_one_error_row_per_mode():
    p = run(["-c", REPORT_ONE_ROW_PER_MODE])
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("jaxquant ") and "devices: " in lines[0]
    built = [n for n in BACKENDS if n != "metal" or sys.platform == "darwin"]
    for name in built:
        (line,) = [l for l in lines if re.match(rf"\s+backend {name}\s", l)]
        status = line.split(name, 1)[1].strip()
        assert status == "available" or re.fullmatch(r"unavailable: .+", status), line
    if sys.platform != "darwin":  # metal exists on macOS only: not listed as a backend here
        assert not [l for l in lines if re.match(r"\s+backend metal", l)]
        assert re.search(r"^\s+\(not built on this platform: metal: .*macOS only", p.stdout, re.M)
    assert re.search(r"backend reference\s+available$", p.stdout, re.M)
    # mode bits group bits/weight rel.error max-abs-err ms: one row per mode of DESIGN §3
    rows = {}
    for line in lines:
        m = re.fullmatch(r"(\w+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
                         line)
        if m:
            assert m[1] not in rows, line
            rows[m[1]] = (int(m[2]), int(m[3]), float(m[4]), float(m[5]), float(m[6]))
    assert sorted(rows) == sorted(oracle.MODES)
    # bits per weight from the format: element bits + scale (and bias) bits per group
    scale_bits = {"affine": 2 * 32, "fp4": 32, "nvfp4": 8}
    for mode, (bits, group, bpw, rel, max_abs) in rows.items():
        _, allowed_bits, _, default_group, _ = oracle.MODES[mode]
        assert bits == (4 if 4 in allowed_bits else allowed_bits[0]) and group == default_group
        assert bpw == pytest.approx(bits + scale_bits.get(mode, 8) / group, abs=1e-3), mode
        # a standard normal matrix: a relative error a few % (8 bits) to ~12% (4 bits)
        assert 0.001 < rel < 0.15, (mode, rel)
        assert 0 < max_abs < 1.5, (mode, max_abs)
    assert rows["mxfp8_e4m3"][3] < rows["mxfp4"][3] and rows["affine"][3] < rows["mxfp4"][3]


def test_command_line_help_and_unknown_command():
    p = run(["-m", "jaxquant", "--help"])
    assert p.returncode == 0 and "python -m jaxquant [report | bench ...]" in p.stdout
    p = run(["-m", "jaxquant", "nonsense"])
    assert p.returncode == 2
    assert "unknown command 'nonsense'" in p.stderr and "report (default)" in p.stderr
