"""`python -m jaxquant`: the demo (the default: a decoder, bf16 against each
quantized mode), the report (backends, per-mode round-trip error) and the
command line, each run in a process of its own (forked: tests/forked_python.py)."""

import os
import re
import sys

import pytest

from tests import oracle
from tests.forked_python import ForkedPython

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


_PYTHON = []  # the module's ForkedPython (tests/forked_python.py)


@pytest.fixture(scope="module", autouse=True)
def forked_python():
    env = {k: v for k, v in os.environ.items() if k != "JAXQUANT_BACKEND"}
    with ForkedPython(env, ROOT) as py:
        _PYTHON.append(py)
        yield
        _PYTHON.remove(py)


def run(args, timeout=120):
    """`python ARGS` in a process of its own, forked after jax's and jaxquant's imports."""
    return _PYTHON[0].run(args, timeout=timeout)


@pytest.mark.full  # ~13 s of CPU: every mode's round trip; CI's full matrix
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
    # under the ffi backend, one line a native library: loaded, or why not
    for platform in ("cpu", "cuda", "rocm"):
        assert re.search(rf"^    library {platform}\s+(loaded from \S+|\S.*)$", p.stdout, re.M)
    assert re.search(r"^    library cpu\s+loaded from \S+libjaxquant_cpu", p.stdout, re.M)
    # mode bits group bits/weight rel.error max-abs-err ms: one row per mode of docs/formats.md
    rows = {}
    for line in lines:
        m = re.fullmatch(r"(\w+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
                         line)
        if m:
            assert m[1] not in rows, line
            rows[m[1]] = (int(m[2]), int(m[3]), float(m[4]), float(m[5]), float(m[6]))
    assert sorted(rows) == sorted(oracle.MODES)
    # bits per weight from the format: element bits + scale (and bias) bits per group
    scale_bits = {"affine": 2 * 32, "fp4": 32, "iq4nl": 32, "nvfp4": 8}
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
    assert p.returncode == 0 and "python -m jaxquant [demo | report | generate | eval | bench ...]" in p.stdout
    p = run(["-m", "jaxquant", "generate", "--help"])
    assert p.returncode == 0 and "--top-p" in p.stdout and "chat template" in p.stdout
    p = run(["-m", "jaxquant", "nonsense"])
    assert p.returncode == 2
    assert "unknown command 'nonsense'" in p.stderr and "demo (default)" in p.stderr
    p = run(["-m", "jaxquant", "demo", "--modes", "bf16,int3"])
    assert p.returncode == 2 and "'int3' is not known" in p.stderr
    p = run(["-m", "jaxquant", "--mesh", "2by1", "--config", "tiny"])
    assert p.returncode != 0 and "--mesh wants TPxEP" in p.stderr


def _one_line_error(p, says):
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.count("\n") == 1 and says in p.stderr and "Traceback" not in p.stderr, \
        p.stderr


@pytest.mark.parametrize("argv, says", [
    (["--checkpoint", "/no/such/dir"], "is not a checkpoint directory (no config.json"),
    (["--mesh", "4x4", "--config", "tiny"], "needs 16 devices; 1 here"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--prompt", "Hello"], "--prompt needs --checkpoint DIR"),
    (["report", "--verbose"], "takes no arguments"),
])
def test_command_line_mistakes_are_one_line_with_a_hint(argv, says):
    p = run(["-m", "jaxquant", *argv])
    _one_line_error(p, says)
    assert "--help" in p.stderr


def test_prompt_with_a_checkpoint_without_tokenizer_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    _one_line_error(run(["-m", "jaxquant", "--checkpoint", str(tmp_path), "--prompt", "Hi"]),
                    "tokenizer.json")


def test_report_help_prints_help():
    p = run(["-m", "jaxquant", "report", "--help"], timeout=60)
    assert p.returncode == 0 and "python -m jaxquant report:" in p.stdout
    assert "round trip" in p.stdout and "backend" not in p.stdout.splitlines()[-1]
    assert "devices: " not in p.stdout        # the help, not the report itself


# mode, weights, prefill tok/s, decode tok/s, logit rel.err, KL, top-1, same tokens, kernels
TABLE_ROW = re.compile(r"(\w+)\s+([\d.]+ [KMG]?i?B)\s+([\d.]+)\s+([\d.]+)\s+"
                       r"(-|[\d.]+%)\s+(-|[\d.]+e[-+]\d+)\s+(-|[\d.]+%)\s+(-|\d+/\d+)\s+(.+)")


def _demo_rows(stdout):
    rows = {}
    for line in stdout.splitlines():
        m = TABLE_ROW.fullmatch(line.strip())
        if m:
            rows[m[1]] = m
    return rows


@pytest.mark.slow
def test_demo_smoke():
    """The default command on the tiny preset: one row per mode with positive
    tokens/s, quantized weights smaller than bf16's, a finite logit difference."""
    p = run(["-m", "jaxquant", "--config", "tiny", "--modes", "bf16,mxfp4,affine8",
             "--tokens", "3", "--prompt-len", "8", "--dtype", "float32"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "model: gpt_oss, 2 layers" in p.stdout
    assert "weights: random" in p.stdout and "--checkpoint DIR" in p.stdout
    assert "3/15" in p.stderr and "15/15" in p.stderr  # the progress bar
    # the bar's line is ended before anything else is printed on it
    assert not re.search(r"\d+\.\ds(?=done )", p.stderr + p.stdout)
    rows = _demo_rows(p.stdout)
    # --dtype float32: the reference row says float32, and the legend measures against it
    assert sorted(rows) == ["affine8", "float32", "mxfp4"], p.stdout
    assert "Measured against the float32 run" in p.stdout and "bf16" not in p.stdout
    size = lambda m: float(m[2].split()[0]) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[m[2].split()[1]]
    assert size(rows["mxfp4"]) < size(rows["affine8"]) < size(rows["float32"])
    for m in rows.values():
        assert float(m[3]) > 0 and float(m[4]) > 0
    assert [rows["float32"][i] for i in (5, 6, 7, 8)] == ["-"] * 4
    assert rows["float32"][9] == "reference (jnp) (float weights)"
    for mode in ("mxfp4", "affine8"):
        backend, layout = re.fullmatch(r"(.+) \((.+)\)", rows[mode][9]).groups()
        assert backend in ("ffi", "reference (jnp)") and layout == "canonical", rows[mode][9]
    # float32 activations: 8-bit weights move the logits and distributions far less
    rel, kl, top1 = (lambda m, i: float(m[i].rstrip("%"))), 6, 7
    assert 0 < rel(rows["affine8"], 5) < rel(rows["mxfp4"], 5)
    assert 0 < rel(rows["affine8"], kl) < rel(rows["mxfp4"], kl)
    assert rel(rows["affine8"], top1) >= rel(rows["mxfp4"], top1) > 0


@pytest.mark.slow
def test_demo_reports_a_failing_mode_and_goes_on():
    """One mode failing (here: nvfp4 quantization made to raise) prints FAILED for
    it, the table for the others, and exits 1."""
    code = ("import sys, runpy; import jaxquant.models.params as d; real = d.quantize_params\n"
            "def broken(p, mode, **kw):\n"
            "    if mode == 'nvfp4': raise RuntimeError('injected')\n"
            "    return real(p, mode, **kw)\n"
            "d.quantize_params = broken; import jaxquant.models as m; m.quantize_params = broken\n"
            "sys.argv = ['jaxquant', '--config', 'tiny', '--modes', 'nvfp4,bf16', "
            "'--tokens', '2', '--prompt-len', '4']\n"
            "runpy.run_module('jaxquant', run_name='__main__', alter_sys=True)")
    p = run(["-c", code], timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "nvfp4: FAILED: RuntimeError: injected" in p.stderr
    assert re.search(r"^nvfp4\s+FAILED$", p.stdout, re.M)
    assert sorted(_demo_rows(p.stdout)) == ["bf16"]
    assert "Measured against the bf16 run" in p.stdout


def test_eval_without_tokenizers_names_the_extra(tmp_path, monkeypatch, capsys):
    # without the optional package eval says which extra installs it, in one line
    from jaxquant import evaluate
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)     # import tokenizers fails
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--checkpoint", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "needs the 'tokenizers' package" in err[-1]
    assert '.[text]' in err[-1] and 'jaxquant[text]' in err[-1]
