"""The benchmark CLI (`python -m jaxquant bench`), in process on the CPU with tiny
shapes: every scenario prints its table, help lists the scenarios and explains the
options, command-line mistakes are one line on stderr (no traceback), interpret-mode
rows are labelled; on the CPU, qmm's %copy is against a copy of each row's bytes and
the other scenarios leave it out."""

import re
import sys

import pytest

import jaxquant.ffi as jf
from jaxquant import bench
from jaxquant.bench import harness
from jaxquant.bench import moe as bench_moe

FAST = ["--iters", "1", "--target-ms", "0.1"]


def _run(argv, capsys):
    lines = []
    assert bench.main(argv, out=lines.append) == 0
    return lines, capsys.readouterr().err


def _table(lines):
    rows = [l for l in lines if l.startswith("| ") and not l.startswith("| M,")
            and not l.startswith("| rows") and not l.startswith("| layer")]
    header = next(l for l in lines if l.startswith("| "))
    return header, [[c.strip() for c in r.strip("|").split("|")] for r in rows]


def test_help_lists_every_scenario_and_explains_options(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for name in bench.SCENARIOS:
        assert re.search(rf"^\s+{name}\s+\S", text, re.M), name
    for name in bench.SCENARIOS:
        with pytest.raises(SystemExit):
            bench.main([name, "--help"])
        text = capsys.readouterr().out
        opts = {"moe": ("--layers", "--iters", "--copies", "--interpret", "--plot"),
                "model": ("--configs", "--modes", "--batch", "--iters", "--peer", "--profile",
                          "--mesh", "--xla-flags")}.get(
            name, ("--shapes", "--iters", "--copies", "--interpret", "--plot"))
        for opt in opts:
            m = re.search(rf"^\s+{opt}\b.*\n((?:\s{{10,}}.*\n)*)", text, re.M)
            assert m and len(m.group(0).split()) > 3, (name, opt)   # has a help text
        assert "issue" not in text


@pytest.mark.parametrize("argv, says", [
    (["qmm", "--shapes", "1,4096"], "must be 3 positive integers"),
    (["qmm", "--shapes", "1,a,3"], "is not 3 comma-separated integers"),
    (["norm", "--shapes", "4,0"], "must be 2 positive integers"),
    (["qmm", "--modes", "affine4,int3"], "unknown mode 'int3'"),
    (["moe", "--layers", "llama"], "unknown layer 'llama'"),
    (["moe", "--decode-t", "1,x"], "is not comma-separated integers"),
    (["qmm", "--copies", "2"], "--copies must be at least 8"),
    (["model", "--configs", "llama9"], "unknown config 'llama9'"),
    (["model", "--mesh", "2y1"], "'2y1' is not TPxEP"),
    (["model", "--forward-kw", "layer_loop"], "'layer_loop' is not KEY=VALUE"),
    (["flops"], "invalid choice: 'flops'"),
    ([], "required: scenario"),
])
def test_mistakes_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err, err


def test_plot_without_matplotlib_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        bench.main(["qmm", "--plot", "out.png"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs matplotlib" in err


def test_cpu_defaults_are_small():
    args = bench.parser(cpu=True).parse_args(["qmm"])
    assert max(m * k * n for m, k, n in args.shapes) <= 1 << 30
    args = bench.parser(cpu=False).parse_args(["qmm"])
    assert (1, 4096, 14336) in args.shapes


def test_qmm_table_progress_and_interpret_label(capsys):
    lines, err = _run(["qmm", "--shapes", "2,64,32", "--modes", "affine4", "--interpret",
                       *FAST], capsys)
    header, rows = _table(lines)
    # on a CPU each row against a host copy of the same bytes, on as many threads
    assert "%copy" in header and "GB/s" in header and "GFLOP/s" in header
    assert [l for l in lines if "a host copy of the same bytes" in l]
    impls = {r[2]: r for r in rows}
    assert {"dense", "dense einsum", "numpy float32", "jnp reference",
            "pallas (interpret)"} <= set(impls)
    cols = [c.strip() for c in header.strip("|").split("|")]
    for r in rows:
        assert r[cols.index("%copy")].endswith("%") and float(r[cols.index("GB/s")]) >= 0
    assert rows[0][0] == f"2, 64, 32 ({harness.cpu_threads()} thread" + \
        ("s)" if harness.cpu_threads() > 1 else ")")
    assert "pallas" not in impls                       # never an unlabelled interpret row
    for r in rows:
        assert float(r[3]) > 0
    assert float(impls["pallas (interpret)"][-1]) < 1e-2     # rel. error vs float32
    assert len([l for l in err.splitlines() if l.startswith("[bench]")]) == len(rows)
    # the op a user calls on what jq.quantize returns (canonical on a CPU), and how it
    # compares with the fastest quantized row
    default = impls["jq.qmm auto, jq.quantize default (canonical)"]
    assert "jq.qmm auto, canonical" in impls and float(default[-1]) < 1e-2
    summary = [l for l in lines if "jq.quantize default" in l and "the best" in l]
    assert len(summary) == 1, summary
    m = re.fullmatch(r"# 2, 64, 32 \(\d+ threads?\) affine4: jq\.quantize default ([\d.]+) µs = ([\d.]+)x the best "
                     r"\((.+), ([\d.]+) µs\)", summary[0])
    assert m is not None, summary
    assert m[1] == default[3] and m[3] in impls and impls[m[3]][1] == "affine4"
    assert m[4] == impls[m[3]][3] and float(m[2]) <= 1.0
    assert float(m[4]) <= min(float(r[3]) for r in rows if r[1] == "affine4") + 0.05


def test_qmm_leaves_pallas_out_on_cpu_unless_asked(capsys, skip_copy_timing):
    lines, _ = _run(["qmm", "--shapes", "1,64,32", "--modes", "mxfp4", "--no-check", *FAST],
                    capsys)
    _, rows = _table(lines)
    assert not any("pallas" in r[2] for r in rows)
    assert any("no GPU here" in l for l in lines)


@pytest.fixture
def skip_copy_timing(monkeypatch):
    """The copy-bandwidth yardstick is timed by the qmm tests; the others skip it."""
    monkeypatch.setattr(harness, "copy_bandwidth", lambda *a, **k: 1e10)


def test_norm_table(capsys, skip_copy_timing):
    lines, err = _run(["norm", "--shapes", "3,64", "--ops", "rms_norm,add_rms_norm", *FAST],
                      capsys)
    header, rows = _table(lines)
    assert "%copy" not in header
    assert {(r[1], r[2]) for r in rows} >= {("rms_norm", "reference"),
                                            ("add_rms_norm", "reference")}
    assert err.count("[bench]") == len(rows)


def test_moe_table(capsys, skip_copy_timing, monkeypatch):
    monkeypatch.setitem(bench_moe.LAYERS, "tiny", (4, 2, 64, 32))
    lines, _ = _run(["moe", "--layers", "tiny", "--decode-t", "1", "--prefill-t", "8",
                     *FAST], capsys)
    _, rows = _table(lines)
    impls = {(r[0], r[2]) for r in rows}
    assert {("tiny T=1", "jnp ref"), ("tiny T=1", "dense gather"),
            ("tiny T=8", "jnp ref"), ("tiny T=8", "dense ragged"),
            ("tiny T=1", "dense gemv 1")} <= impls
    assert not any("failed" in l for l in lines)


def test_prefill_qmm_table_has_the_a8_rows(capsys, skip_copy_timing):
    """bench prefill's qmm rows on the CPU, the opt-in 8-bit activations among them,
    each timed and near the 4-bit weight's product (x rounded to 8 bits)."""
    lines, _ = _run(["prefill", "--only", "qmm", "--shapes", "8,64,96", "--modes", "mxfp4",
                     "--iters", "1"], capsys)
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines
            if l.startswith("| 8, 64, 96 |")]
    a8 = {r[2]: r for r in rows if r[2].startswith("qmm_a8")}
    assert set(a8) == {f"qmm_a8 {t} (opt-in; weight rows from mxfp4)"
                       for t in ("int8", "float8_e4m3fn")}
    for impl, r in a8.items():
        assert float(r[3]) > 0 and 0 < float(r[6]) < (0.03 if "int8" in impl else 0.1), r
    assert not any("failed" in l for l in lines)


def test_import_jaxquant_leaves_bench_out():
    import subprocess

    code = ("import sys, jaxquant; print(sorted(m for m in sys.modules "
            "if m.startswith('jaxquant.bench')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)


def test_json_out_writes_each_row_as_data_and_merges(tmp_path, capsys, skip_copy_timing):
    """--json-out: one entry per table row (the labels as the key, the measurements as
    values, the command, GPU, jax version and date); a second run replaces the rows it
    measured again and keeps the others."""
    import json

    import jax

    path = tmp_path / "cpu" / "qmm.json"
    _run(["qmm", "--shapes", "1,64,128", "--modes", "affine4", "--json-out", str(path), *FAST],
         capsys)
    first = json.loads(path.read_text())["entries"]
    keys = [e["key"] for e in first]
    # dense (x @ w.T, XLA's einsum, numpy), the jnp reference, ffi (its ISA named), and
    # jq.qmm's automatic choice on the canonical weight and on jq.quantize's default
    # (canonical on a CPU: no prepacked row); the case names the threads
    assert keys == sorted(keys) and len(keys) == 7, keys
    ffi = next(e for e in first if "impl=ffi" in e["key"])
    t = harness.cpu_threads()
    case = f"M, K, N=1, 64, 128 ({t} thread{'s' * (t > 1)})"
    assert ffi["key"] == f"qmm: {case} / mode=affine4 / impl=ffi ({jf.cpu_kernels_isa()})"
    assert 0 < ffi["values"]["%copy"] if isinstance(ffi["values"]["%copy"], float) else \
        ffi["values"]["%copy"].endswith("%")
    assert isinstance(ffi["values"]["µs"], float) and ffi["values"]["µs"] > 0
    assert ffi["command"] == ("python -m jaxquant bench qmm --shapes 1,64,128 --modes affine4 "
                              + " ".join(FAST))
    assert ffi["gpu"] == jax.devices()[0].device_kind and ffi["jax"] == jax.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", ffi["date"])
    assert len(path.read_text().splitlines()) == 2 + len(keys)  # one entry per line
    _run(["qmm", "--shapes", "2,64,128", "--modes", "affine4", "--json-out", str(path), *FAST],
         capsys)
    second = {e["key"]: e for e in json.loads(path.read_text())["entries"]}
    assert len(second) == 14 and set(keys) <= set(second)
    assert ffi["key"].replace("N=1,", "N=2,") in second


def test_json_keys_keep_model_names_that_hold_a_decimal():
    """A row's key is its label columns; "llama3.2-1b" holds a decimal but is a name, so
    the model table's rows keep their config, impl, mode and batch in the key (each row
    its own entry), and the measured columns start at "decode tok/s"."""
    rec = harness.TableRecorder(lambda line: None)
    rec("| config | impl | mode | batch | decode tok/s | % of bound | vs float |")
    rec("|---|---|---|---:|---:|---:|---:|")
    rec("| llama3.2-1b | jaxquant | bf16 | 1 | 1.5 | 12% |  |")
    rec("| llama3.2-1b | jaxquant | affine4 | 1 | 6.0 | 22% | 4.11x |")
    rec("| gpt-oss-20b | jaxquant | mxfp4 | 8 | 2924.0 | 61% |  |")
    got = rec.records("model")
    assert [r["key"] for r in got] == [
        "model: config=llama3.2-1b / impl=jaxquant / mode=bf16 / batch=1",
        "model: config=llama3.2-1b / impl=jaxquant / mode=affine4 / batch=1",
        "model: config=gpt-oss-20b / impl=jaxquant / mode=mxfp4 / batch=8"]
    assert got[1]["values"] == {"decode tok/s": 6.0, "% of bound": "22%", "vs float": "4.11x"}


def test_bench_decode_tables_are_recorded():
    """`bench decode --json-out` keeps its rows: they print as markdown tables (the
    recorder reads nothing else), and the op-level default against the fastest variant is
    a table of its own, the default's time over the best's, re-timed in turns where
    another variant was faster."""
    import jax
    import jax.numpy as jnp

    from jaxquant.bench import decode

    rec = harness.TableRecorder(lambda line: None)
    decode.print_header(rec, "qmm: M, K, N", "mode", "impl", "us", "%copy")
    decode.print_row(rec, "1, 4096, 14336", "affine4", "ffi mma (prepacked)", "16.7", "68%")
    decode.print_row(rec, "1, 4096, 14336", "affine4", decode.DEFAULT_IMPL, "16.9", "67%")
    key = (1, 4096, 14336, "affine4")
    f = jax.jit(lambda x: x + 1)
    results = {key + ("ffi mma (prepacked)",): 16.7, key + (decode.DEFAULT_IMPL,): 16.9}
    runs = {k: (f, (jnp.ones(4),), 1) for k in results}
    slower = decode.default_vs_best(results, runs, key, "1, 4096, 14336", "affine4",
                                    "cuda_mma", rounds=1)
    fastest = decode.default_vs_best({key + (decode.DEFAULT_IMPL,): 20.0,
                                      key + ("pallas (canonical)",): 40.0}, {}, key,
                                     "1, 4096, 14336", "affine4", "cuda_mma")
    assert fastest[3:] == ("1.00x", decode.DEFAULT_IMPL, "20.0", "20.0")
    assert decode.default_vs_best({}, {}, key) is None
    decode.print_header(rec, "qmm default vs best: M, K, N", "mode", "default layout",
                        "default / best", "best", "best us", "default us")
    decode.print_row(rec, *slower)
    got = rec.records("decode")
    assert [r["key"] for r in got] == [
        "decode: qmm: M, K, N=1, 4096, 14336 / mode=affine4 / impl=ffi mma (prepacked)",
        f"decode: qmm: M, K, N=1, 4096, 14336 / mode=affine4 / impl={decode.DEFAULT_IMPL}",
        "decode: qmm default vs best: M, K, N=1, 4096, 14336 / mode=affine4 / "
        "default layout=cuda_mma"]
    assert got[2]["values"]["best"] == "ffi mma (prepacked)"
    assert set(got[2]["values"]) == {"default / best", "best", "best us", "default us"}
