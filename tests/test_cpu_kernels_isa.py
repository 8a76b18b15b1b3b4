"""The CPU kernels of every ISA give the same bits (cpu_src/kernels_impl.inc's claim:
one output element's float op sequence does not depend on the ISA), the arm64 ones
included although no arm64 machine is at hand: tests/native/cpu_kernels_driver.cc runs
every entry of the kernel table (dequantize, the fused dequantize-GEMV qmv, the blocked
GEMM, the three norms) on the cases below, built natively (x86-64: baseline, AVX2, AVX-512) and with
the aarch64 cross compiler, statically, run under qemu-user (NEON and the generic
baseline). Every output is compared with the x86-64 baseline's bit for bit, NaN equal
to NaN (IEEE 754 leaves a NaN result's sign and payload open, and the ISAs' decoders
differ there: the F16C/NEON E4M3 decode returns +NaN for -NaN's code).

Two exceptions, measured and named:
- the AVX-512 GEMV of 4- and 8-bit codes (qmv_tile_wide, docs/backends.md) sums a
  unit's products in another order: its qmv outputs are checked against the float64
  oracle's bound instead (and in the edge cases, NaN wherever a NaN must propagate);
- the GEMM takes one FMA a term where the ISA has one (AVX2, AVX-512, NEON) and a
  multiply and an add in the generic baseline code: the FMA builds give the AVX2
  build's bits, the baseline builds (x86-64 and arm64) the x86-64 baseline's, and both
  are checked against the oracle; the AVX-512 build's GEMM of bfloat16 x on a CPU with
  AMX runs the tiles, checked against the oracle's bound.

The cases: every (format, bits, group size) the table allows, x / scale / output dtypes
rotating through float32, float16 and bfloat16, N and the norm width off every vector
multiple, 1 to 5 rows of x, slots with invalid expert ids; random codes (every NaN/Inf
code of E4M3 / E5M2 included) and, in the edge cases, NaN, +-Inf, huge and subnormal
values in x, and extreme scales (E8M0 0, 1, 254, 255; E4M3 0, subnormal, NaN; float
scales 0, subnormal, the dtype's max, Inf, NaN)."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import shutil
import struct
import subprocess

import ml_dtypes
import numpy as np
import pytest

from jaxquant import formats
from tests import oracle
from tests.common import CPU_ISA_FLAGS, assert_matmul_close, cpu_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
DRIVER = "tests/native/cpu_kernels_driver.cc"

# ~1-3 minutes of a core (the builds, qemu): CI's full matrix (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.xdist_group("cpu_kernels_isa")]

# include/jq/codec.h's DType ids and the numpy types of their bits / values
F32, F16, BF16, U8 = 0, 1, 2, 3
NP_VALUE = {F32: np.float32, F16: np.float16, BF16: ml_dtypes.bfloat16}
NP_BITS = {F32: np.uint32, F16: np.uint16, BF16: np.uint16}
DTS = [F32, BF16, F16]
FORMAT_IDS = {m: i for i, m in enumerate(formats.FORMATS)}  # codec.h's order (test_ffi.py)
NORM_KINDS = {"rms": 0, "add": 1, "gated": 2}
NPARAMS = 24

QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
CROSS = shutil.which("aarch64-linux-gnu-g++")
HOST_CXX = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
MACHINE = os.uname().machine


# ---------------------------------------------------------------------------
# The build: the sources and flags of CMakeLists.txt's jaxquant_cpu (read from it, so
# the driver is compiled as the library is).

def cmake_flags():
    """(common flags, {source: its own flags}) of jaxquant_cpu in CMakeLists.txt."""
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"target_compile_options\(jaxquant_cpu PRIVATE(.*?)\)", text, re.S)
    assert m, "CMakeLists.txt: no target_compile_options(jaxquant_cpu PRIVATE ...)"
    common = m.group(1).split()
    own = {}
    for src in ("kernels_avx2.cc", "kernels_avx512.cc"):
        m = re.search(r"set_source_files_properties\(cpu_src/" + re.escape(src) +
                      r"\s+PROPERTIES\s+COMPILE_OPTIONS\s+\"([^\"]*)\"", text)
        assert m, f"CMakeLists.txt: no COMPILE_OPTIONS for cpu_src/{src}"
        own[src] = m.group(1).split(";")
    assert "-ffp-contract=off" in common, common  # the ISAs' agreement depends on it
    return common, own


def build(cxx: list[str], arch: str, out: pathlib.Path, static: bool) -> pathlib.Path:
    """The driver with every ISA's kernels of `arch` ("x86_64" or "aarch64")."""
    common, own = cmake_flags()
    if arch == "x86_64":
        sources = ["kernels_base.cc", "kernels_avx2.cc", "kernels_avx512.cc"]
        defs = ["-DJQ_HAVE_AVX2_VARIANT=1", "-DJQ_HAVE_AVX512_VARIANT=1"]
    else:
        sources = ["kernels_base.cc", "kernels_neon.cc"]
        defs = ["-DJQ_HAVE_NEON_VARIANT=1"]
    base = [*cxx, "-std=c++17", *common, "-Iinclude", "-Icpu_src", *defs]
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(f"cpu_src/{s}", own.get(s, [])) for s in sources] + [(DRIVER, [])]

    def compile_one(job):
        src, extra = job
        obj = out / (pathlib.Path(src).stem + ".o")
        p = subprocess.run([*base, *extra, "-c", src, "-o", str(obj)], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"{' '.join(cxx)} {src}:\n{p.stderr[-4000:]}"
        return str(obj)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as ex:
        objs = list(ex.map(compile_one, jobs))
    exe = out / "cpu_kernels_driver"
    link = [*cxx, *objs, "-o", str(exe), "-pthread"] + (["-static"] if static else [])
    p = subprocess.run(link, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return exe


# ---------------------------------------------------------------------------
# The cases.

def _as_dt(values: np.ndarray, dt: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(values, np.float64).astype(np.float32).astype(NP_VALUE[dt])


def _max(dt: int) -> float:
    return float(ml_dtypes.finfo(NP_VALUE[dt]).max)


def _tiny(dt: int) -> float:
    return {F32: 1e-40, BF16: 1e-40, F16: 3e-7}[dt]  # a subnormal of each


def _scales(rng, mode, shape, dt, edge):
    """Scales of `mode` (uint8 codes for E8M0 / E4M3, else values in dt) and their dtype id."""
    kind = formats.FORMATS[mode].scale
    n = int(np.prod(shape))
    if kind == "e8m0":  # elements times 2**-4 .. 1 of the element's largest
        top = int(np.ceil(np.log2(oracle.max_finite(formats.FORMATS[mode].element))))
        s = (127 - top + rng.integers(-4, 1, n)).astype(np.uint8)
        if edge:
            s[rng.choice(n, 8, replace=False)] = [0, 1, 254, 255, 0, 1, 254, 120]
        return s.reshape(shape), U8
    if kind == "e4m3":  # positive codes of about 2**-3 .. 2**3
        s = rng.integers(0x28, 0x58, n).astype(np.uint8)
        if edge:
            s[rng.choice(n, 6, replace=False)] = [0x00, 0x01, 0x7e, 0x7f, 0x80, 0x07]
        return s.reshape(shape), U8
    v = rng.standard_normal(n) * 2.0 ** rng.integers(-4, 3, n) / 4
    if edge:
        big = _max(dt)
        v[rng.choice(n, 7, replace=False)] = [0.0, -0.0, _tiny(dt), big, np.inf, np.nan, -big]
    return _as_dt(v, dt).reshape(shape), dt


def _x(rng, shape, dt, edge):
    v = rng.standard_normal(shape)
    if edge:  # rows of specials (each value in one row of its own where there are rows)
        flat = v.reshape(-1, shape[-1])
        big = _max(dt)
        specials = [np.nan, np.inf, -np.inf, big, _tiny(dt), 0.0]
        for i, val in enumerate(specials):
            flat[i % flat.shape[0], (7 * i + 3) % shape[-1]] = val
        flat[-1, :] *= 2.0 ** 60 if dt != F16 else 2.0 ** 8  # products past float32's range
    return _as_dt(v, dt)


def _data(rng, mode, bits, shape, edge):
    """Random codes; outside the edge cases without E4M3 / E5M2 NaN or Inf codes."""
    d = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    el = formats.FORMATS[mode].element
    if not edge and el in ("e4m3", "e5m2"):
        b = d.view(np.uint8)
        if el == "e4m3":
            b[(b & 0x7F) == 0x7F] ^= 1
        else:
            b[(b & 0x7C) == 0x7C] &= 0xFB
    return d


def _biases(rng, mode, shape, dt, edge):
    if not formats.FORMATS[mode].has_biases:
        return None
    v = rng.standard_normal(int(np.prod(shape))) / 2
    if edge:
        v[rng.choice(v.size, 2, replace=False)] = [np.inf, np.nan]
    return _as_dt(v, dt).reshape(shape)


def combos():
    """Every (mode, bits, group size) of the format table."""
    return [(mode, b, g) for mode, f in formats.FORMATS.items() for b in f.bits
            for g in f.group_sizes]


def make_cases(seed=20261128):
    rng = np.random.default_rng(seed)
    cases = []
    for ci, (mode, bits, group) in enumerate(combos()):
        kunit = max(group, 32)
        K = kunit * (7 if kunit == 32 else 3)  # an odd number of units and of groups
        for edge in (False, True):
            xdt, sdt, odt = DTS[ci % 3], DTS[(ci + 1) % 3], DTS[(ci + 2 + edge) % 3]
            words, groups = K * bits // 32, K // group
            # qmv: S slots over E experts (one id past E, one negative: NaN rows)
            E, N, M = 3, 37, 1 + (ci + 2 * edge) % 5
            S = 4
            idx = np.array([2, 0, -1, 3] if edge else [1, 2, 0, 1], np.int32)
            Sx, x_div = (S, 1) if ci % 2 == 0 else (1, S)
            data = _data(rng, mode, bits, (E, N, words), edge)
            scales, scale_dt = _scales(rng, mode, (E, N, groups), sdt, edge)
            biases = _biases(rng, mode, (E, N, groups), sdt, edge)
            gs = None
            if formats.FORMATS[mode].has_global_scale:
                gs = np.array([3.0e-3 if not edge else 2.0**-126], np.float32)
            x = _x(rng, (Sx, M, K), xdt, edge)
            block = 16 if ci % 2 else N
            cases.append(dict(
                kind=1, mode=mode, bits=bits, group=group, edge=edge, x=x, data=data,
                scales=scales, biases=biases, gs=gs, idx=idx, x_dt=xdt, scale_dt=scale_dt,
                params=[FORMAT_IDS[mode], bits, group, S, M, N, K, E, Sx, x_div, words, groups,
                        xdt, scale_dt, block],
                arrays=[x, data, scales, biases, gs, idx],
                out=[(S * M * N, xdt)]))
            # gemm: past the GEMV's rows, M and N off every strip and panel (70: a
            # 64-row block and 6), the same weights and slots
            Mg, Ng = 21, 70
            gdata = _data(rng, mode, bits, (E, Ng, words), edge)
            gscales, _ = _scales(rng, mode, (E, Ng, groups), sdt, edge)
            gbiases = _biases(rng, mode, (E, Ng, groups), sdt, edge)
            gx = _x(rng, (Sx, Mg, K), odt, edge)
            cases.append(dict(
                kind=3, mode=mode, bits=bits, group=group, edge=edge, x=gx, data=gdata,
                scales=gscales, biases=gbiases, gs=gs, idx=idx, x_dt=odt, scale_dt=scale_dt,
                params=[FORMAT_IDS[mode], bits, group, S, Mg, Ng, K, E, Sx, x_div, words,
                        groups, odt, scale_dt, 0],
                arrays=[gx, gdata, gscales, gbiases, gs, idx],
                out=[(S * Mg * Ng, odt)]))
            # dequantize: 2 matrices of 5 rows (nvfp4: a global scale per matrix)
            n = 5
            d2 = _data(rng, mode, bits, (2, n, words), edge)
            s2, sdt2 = _scales(rng, mode, (2, n, groups), sdt, edge)
            b2 = _biases(rng, mode, (2, n, groups), sdt, edge)
            gs2 = None
            if formats.FORMATS[mode].has_global_scale:
                gs2 = np.array([0.75, 2.0**-130 if edge else 1e-2], np.float32)
            cases.append(dict(
                kind=0, mode=mode, edge=edge,
                params=[FORMAT_IDS[mode], bits, group, 2 * n, n, K, words, groups, sdt2,
                        0 if gs2 is None else 2, 1, odt],
                arrays=[d2, s2, b2, gs2], out=[(2 * n * K, odt)]))
    for i, (kind, d, group, act, before, w_div, edge) in enumerate([
            ("rms", 200, 200, 0, 0, 1, False), ("rms", 37, 37, 0, 0, 0, True),
            ("add", 96, 96, 0, 0, 2, False), ("add", 203, 203, 0, 0, 1, True),
            ("gated", 96, 32, 0, 0, 1, False), ("gated", 96, 48, 1, 1, 1, False),
            ("gated", 200, 200, 0, 1, 0, True), ("gated", 45, 15, 1, 0, 3, True),
            ("rms", 1, 1, 0, 0, 1, False), ("rms", 8, 8, 0, 0, 1, True)]):
        rows = 6
        xdt, rdt, wdt, ydt = DTS[i % 3], DTS[(i + 1) % 3], DTS[(i + 2) % 3], DTS[(i + 1) % 3]
        x = _x(rng, (rows, d), xdt, edge)
        r = None
        if kind != "rms":
            r = _as_dt(rng.standard_normal((rows, d)) * (8 if kind == "gated" else 1), rdt)
            if edge:
                r.reshape(-1)[[0, 5, 9]] = _as_dt(np.array([np.nan, 200.0, -200.0]), rdt)
        if edge:
            x[rows - 2] = 0  # an all-zero row: the norm of eps alone
        w = None
        if w_div:
            w = _as_dt(rng.standard_normal((rows // w_div, d)), wdt)
        hdt = rdt
        eps = np.float32(1e-6).view(np.uint32)
        off = np.float32(1.0 if i % 2 else 0.0).view(np.uint32)
        cases.append(dict(
            kind=2, mode=f"norm-{kind}", edge=edge,
            params=[NORM_KINDS[kind], rows, d, xdt, rdt if r is not None else F32, wdt,
                    w_div or 1, ydt, hdt, int(eps), int(off), act, before, group],
            arrays=[x, r, w],
            out=[(rows * d, ydt)] + ([(rows * d, hdt)] if kind == "add" else [])))
    return cases


def write_cases(cases, path: pathlib.Path):
    with open(path, "wb") as f:
        f.write(b"JQKCASE1" + struct.pack("<q", len(cases)))
        for c in cases:
            params = list(c["params"]) + [0] * (NPARAMS - len(c["params"]))
            f.write(struct.pack(f"<q{NPARAMS}qq", c["kind"], *params, len(c["arrays"])))
            for a in c["arrays"]:
                raw = b"" if a is None else np.ascontiguousarray(a).tobytes()
                f.write(struct.pack("<q", len(raw)) + raw)


def read_outputs(cases, path: pathlib.Path):
    """Each case's outputs, as their bits (uint16 / uint32 arrays)."""
    raw = path.read_bytes()
    out, at = [], 0
    for c in cases:
        arrs = []
        for count, dt in c["out"]:
            nb = count * np.dtype(NP_BITS[dt]).itemsize
            arrs.append(np.frombuffer(raw[at:at + nb], NP_BITS[dt]))
            at += nb
        out.append(arrs)
    assert at == len(raw), (at, len(raw))
    return out


def run_driver(cmd: list[str], isa: str, cases_path, out_path):
    p = subprocess.run([*cmd, isa, str(cases_path), str(out_path)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, f"{isa}: rc {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
    return p.stdout


def _isnan(bits, dt):
    return np.isnan(bits.view(NP_VALUE[dt]).astype(np.float32))


def _has_amx() -> bool:
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags and "amx_tile" in flags


HAS_AMX = _has_amx()


def reference(isa: str, c) -> str | None:
    """The x86-64 build whose bits `isa` gives in case c (None: the oracle's bound only)."""
    if c["kind"] == 3 and isa == "avx512" and c["x_dt"] == BF16 and HAS_AMX:
        return None  # the AMX tiles (docs/backends.md, "CPU kernels")
    if c["kind"] == 3 and isa in ("avx2", "avx512", "neon"):
        return "avx2"  # one FMA a term
    if c["kind"] == 1 and isa == "avx512" and wide_qmv(c):
        return None
    return "baseline"


def assert_same_bits(got, refs, cases, isa, what):
    """got == the reference build's outputs bit for bit, NaN == NaN, in every case
    whose reference (above) is among `refs` ({x86 isa: outputs})."""
    bad = []
    for i, (c, g_arrs) in enumerate(zip(cases, got)):
        ref = reference(isa, c)
        if ref is None or ref not in refs:
            continue
        w_arrs = refs[ref][i]
        for (count, dt), g, w in zip(c["out"], g_arrs, w_arrs):
            nan_g, nan_w = _isnan(g, dt), _isnan(w, dt)
            diff = (g != w) & ~(nan_g & nan_w)
            if diff.any():
                j = int(np.flatnonzero(diff)[0])
                bad.append(f"{c['mode']} kind={c['kind']} edge={c['edge']} params={c['params']}: "
                           f"{int(diff.sum())} of {count} differ, first at {j}: "
                           f"{g[j]:#x} vs {w[j]:#x}")
    assert not bad, f"{what}:\n" + "\n".join(bad[:20])


def wide_qmv(c) -> bool:
    """Whether the AVX-512 build's qmv takes its 16-lane GEMV for this case (4-bit codes;
    affine, E4M3 and E5M2 8-bit codes: kernels_impl.inc, wide_fits)."""
    el = formats.FORMATS[c["mode"]].element
    return c["bits"] == 4 or (c["bits"] == 8 and el in (None, "e4m3", "e5m2"))


def _values(bits, dt):
    return bits.view(NP_VALUE[dt]).astype(np.float64)


def check_against_oracle(cases, outs, what, kinds=(1, 3)):
    """qmv / gemm outputs within the float64 oracle's bound (assert_matmul_close) in the
    plain cases (finite inputs), where the sum's magnitude is within half the output
    dtype's range (float16 outputs of E5M2 weights overflow: the bits of those are the
    reference build's), and all NaN in the rows of invalid expert ids."""
    for c, arrs in zip(cases, outs):
        if c["kind"] not in kinds or c["edge"]:
            continue
        S, M, N, E, x_div = (c["params"][i] for i in (3, 4, 5, 7, 9))
        y = _values(arrs[0], c["x_dt"]).reshape(S, M, N)
        w64 = oracle.dequantize(c["mode"], c["bits"], c["group"], c["data"], c["scales"],
                                c["biases"], c["gs"])
        for s in range(S):
            e = int(c["idx"][s])
            if not 0 <= e < E:
                assert np.isnan(y[s]).all(), (what, c["mode"], s)
                continue
            x = np.asarray(c["x"][s // x_div], np.float64)
            mag = np.abs(x) @ np.abs(w64[e]).T
            for m in range(M):
                keep = mag[m] < _max(c["x_dt"]) / 2
                assert keep.mean() > 0.5, (what, c["mode"], s, m)  # the check checks
                assert_matmul_close(y[s][m:m + 1, keep], x[m:m + 1], w64[e][keep],
                                    NP_VALUE[c["x_dt"]])


def check_edge_nans(cases, got, what):
    """Where the sums are ordered differently (AVX-512's qmv), in the edge cases: NaN in
    every output of an x row holding NaN and of an invalid expert id (what does not
    depend on the order; which of +-Inf and NaN an overflow gives does)."""
    for c, g in zip(cases, got):
        if c["kind"] != 1 or not c["edge"] or not wide_qmv(c):
            continue
        S, M, N, E, x_div = (c["params"][i] for i in (3, 4, 5, 7, 9))
        y = _values(g[0], c["x_dt"]).reshape(S, M, N)
        for s in range(S):
            nan_x = np.isnan(np.asarray(c["x"][s // x_div], np.float32)).any(axis=-1)
            rows = np.ones(M, bool) if not 0 <= int(c["idx"][s]) < E else nan_x
            assert np.isnan(y[s][rows]).all(), (what, c["mode"], s)


# ---------------------------------------------------------------------------
# The tests: one module fixture builds the x86-64 driver and runs every ISA this CPU has.

@pytest.fixture(scope="module")
def cases_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu_kernels_isa")
    cases = make_cases()
    path = d / "cases.bin"
    write_cases(cases, path)
    return cases, path, d


@pytest.fixture(scope="module")
def x86_outputs(cases_file):
    """{isa: outputs} of the x86-64 kernels this CPU runs, and the cases."""
    if MACHINE != "x86_64":
        pytest.skip(f"the reference outputs are the x86-64 kernels'; this machine is {MACHINE}")
    if HOST_CXX is None:
        pytest.skip("no C++ compiler on PATH")
    cases, path, d = cases_file
    exe = build([HOST_CXX], "x86_64", d / "x86_64", static=False)
    flags = set(cpu_flags())
    outs = {}
    for isa in ("baseline", "avx2", "avx512"):
        if set(CPU_ISA_FLAGS[isa]) <= flags:
            run_driver([str(exe)], isa, path, d / f"{isa}.out")
            outs[isa] = read_outputs(cases, d / f"{isa}.out")
    return outs


def test_x86_isas_agree(cases_file, x86_outputs):
    """AVX2 == baseline but for the GEMM's FMA; AVX-512 == AVX2 in the GEMM and ==
    baseline elsewhere but for its 16-lane GEMV; what differs is within the oracle's
    bound, and so are the baseline's GEMV and GEMM."""
    cases = cases_file[0]
    base = x86_outputs["baseline"]
    check_against_oracle(cases, base, "baseline")
    if "avx2" not in x86_outputs:
        pytest.skip("this CPU has no AVX2: the x86-64 baseline only")
    for isa in ("avx2", "avx512"):
        if isa in x86_outputs:
            got = x86_outputs[isa]
            assert_same_bits(got, x86_outputs, cases, isa, f"{isa} vs its reference")
            check_against_oracle(cases, got, isa)
    if "avx512" in x86_outputs:
        check_edge_nans(cases, x86_outputs["avx512"], "avx512")
    # the exceptions are real: outputs that differ from the baseline's
    for isa, kind in (("avx2", 3), ("avx512", 1)):
        if isa in x86_outputs:
            assert any(c["kind"] == kind and reference(isa, c) != "baseline" and
                       not np.array_equal(g[0], b[0])
                       for c, g, b in zip(cases, x86_outputs[isa], base)), (isa, kind)


AARCH64_COMPILERS = [
    pytest.param("g++", id="gcc"),
    pytest.param("clang", id="clang"),
]


@pytest.mark.parametrize("compiler", AARCH64_COMPILERS)
def test_arm64_kernels_match_x86(compiler, cases_file, x86_outputs):
    """The arm64 build (NEON, and the generic baseline), cross-compiled and run under
    qemu-user, gives the x86-64 baseline's bits in every case: GCC, the compiler of an
    arm64 Linux host, and clang (what a macOS arm64 build uses)."""
    if QEMU is None or CROSS is None:
        pytest.skip("needs aarch64-linux-gnu-g++ and qemu-aarch64-static: "
                    "tools/toolchain/install_aarch64_toolchain.sh (Debian: "
                    "g++-aarch64-linux-gnu qemu-user-static)")
    if compiler == "clang":
        clang = shutil.which("clang++-19") or shutil.which("clang++")
        if clang is None:
            pytest.skip("no clang++ on PATH (tools/toolchain/install_hip_toolchain.sh installs clang-19)")
        cxx = [clang, "--target=aarch64-linux-gnu"]
    else:
        cxx = [CROSS]
    cases, path, d = cases_file
    exe = build(cxx, "aarch64", d / f"aarch64-{compiler}", static=True)
    for isa in ("neon", "baseline"):
        out = d / f"aarch64-{compiler}-{isa}.out"
        msg = run_driver([QEMU, str(exe)], isa, path, out)
        assert msg.startswith(f"{isa}: {len(cases)} cases"), msg
        got = read_outputs(cases, out)
        assert_same_bits(got, x86_outputs, cases, isa, f"aarch64 ({compiler}) {isa} vs x86-64")
        if "avx2" not in x86_outputs:  # no FMA build here to give the GEMM's bits
            check_against_oracle(cases, got, f"aarch64 {isa}", kinds=(3,))


def test_driver_refuses_an_isa_not_built(cases_file, x86_outputs, tmp_path):
    """The x86-64 build holds no NEON kernels: the driver says so (exit 3), it does not
    run another ISA's in their place."""
    exe = cases_file[2] / "x86_64" / "cpu_kernels_driver"
    p = subprocess.run([str(exe), "neon", str(cases_file[1]), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert p.returncode == 3 and "not compiled" in p.stderr
