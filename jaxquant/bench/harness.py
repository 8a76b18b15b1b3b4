"""What every benchmark shares: timing, the copy-bandwidth yardstick, progress
lines, argument parsing helpers, the result table and the plot (docs/measuring.md).

Timing. A timed function does `n_products` distinct products (one per input
copy: no two alike, so XLA can merge none, and together more bytes than a
cache holds); each sample issues `inner` calls back to back (host dispatch
overlaps device work) and syncs once; time per product = median over samples
of (sample time / inner / n_products).

Bandwidth. A device-to-device copy (read + write of a large buffer) is timed
in the same run; "%copy" is (bytes the product must move) / time over the
copy's (bytes read + written) / time. On a CPU a copy of a fixed size measures
whichever cache holds it, so the scenarios that show GB/s and %copy there (qmm)
time a copy of the same bytes as each row's timed call (cpu_copy_bandwidth: the
same cache or memory, the same threads); the others leave those columns out on
a CPU (GFLOP/s instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import time
from typing import Callable

from jaxquant.formats import PRESETS

# Quantization settings the benchmarks accept, by the name the options use.
MODES = {name: PRESETS[name] for name in (
    "affine4", "affine8", "affine3", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3",
    "mxfp8_e5m2", "nvfp4", "fp4", "iq4nl")}


def platform() -> str:
    """The default device's platform: "cpu", "gpu", "cuda", "rocm", ..."""
    import jax

    return jax.devices()[0].platform


def on_cpu() -> bool:
    return platform() == "cpu"


def progress(msg: str) -> None:
    """One line per case on stderr, so a long run shows where it is."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def timed_samples(fn, args, iters, inner):
    """`iters` samples of seconds per call of fn(*args), each over `inner` calls back to
    back, after one call (compilation)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return times


def timeit(fn, args, n_products, iters, inner):
    """Median seconds per product of fn(*args) (see the module docstring)."""
    return statistics.median(timed_samples(fn, args, iters, inner)) / n_products


def inner_calls(est_us, n_products, target_ms, most=200):
    """Calls per sample for about `target_ms` of device work (at least 2)."""
    return int(max(2, min(most, target_ms * 1e3 / (max(est_us, 1.0) * n_products))))


def copy_bandwidth(nbytes=None, iters=None):
    """Bytes/s of a device-to-device copy (read + write of `nbytes`: default 2 GiB on
    accelerators, 64 MiB on the CPU), one XLA elementwise kernel per call."""
    import jax
    import jax.numpy as jnp

    cpu = on_cpu()
    nbytes = nbytes or ((64 << 20) if cpu else (2 << 30))
    iters = iters or (5 if cpu else 10)
    a = jnp.arange(nbytes // 4, dtype=jnp.uint32)
    f = jax.jit(lambda a: a ^ jnp.uint32(1))
    sec = timeit(f, (a,), 1, iters, inner=5)
    del a
    return 2 * nbytes / sec


def cpu_threads() -> int:
    """Threads a CPU run uses: the cores this process may run on (`taskset -c 0` for
    one), which is also the size of XLA's intra-op pool the ffi kernels use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


CPU_COPY_MAX_BYTES = 512 << 20  # a larger call is compared with a copy of this many


def cpu_copy_bandwidth(nbytes, threads=None, iters=5, _cache={}):
    """Bytes/s (read + written) of a host copy of `nbytes` (at most CPU_COPY_MAX_BYTES:
    past the last-level cache either way) split over `threads` threads (numpy copies
    release the GIL); median of `iters`. Cached per (size, threads) for one run."""
    import concurrent.futures

    import numpy as np

    threads = threads or cpu_threads()
    nbytes = max(4096, min(int(nbytes), CPU_COPY_MAX_BYTES)) // 4096 * 4096
    key = (nbytes, threads)
    if key not in _cache:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        bounds = np.linspace(0, src.size, threads + 1).astype(int)
        parts = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            def copy():
                list(ex.map(lambda p: np.copyto(*p), parts))
            copy()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                copy()
                times.append(time.perf_counter() - t0)
        _cache[key] = 2 * nbytes / statistics.median(times)
    return _cache[key]


def dense_matmul_flops(n=None, iters=None):
    """FLOP/s of one dense bf16 n x n x n product (XLA's dot: cuBLAS on a GPU), calls
    back to back: the tensor-core rate a prefill is held against in the same process.
    Default n = 8192 on accelerators (1.1 TFLOP a call), 512 on the CPU."""
    import jax
    import jax.numpy as jnp

    cpu = on_cpu()
    n = n or (512 if cpu else 8192)
    iters = iters or (3 if cpu else 10)
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
                .astype(jnp.bfloat16))
    sec = timeit(f, (a, b), 1, iters, inner=5)
    del a, b
    return 2.0 * n**3 / sec


def last_level_cache_bytes() -> int | None:
    """The CPU's last-level cache in bytes (glibc's `getconf`, else Linux sysfs), or None."""
    import subprocess

    for name in ("LEVEL3_CACHE_SIZE", "LEVEL2_CACHE_SIZE"):
        try:
            text = subprocess.run(["getconf", name], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
            if text.isdigit() and int(text) > 0:
                return int(text)
        except (OSError, subprocess.SubprocessError):
            break
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        sizes = []
        for name in os.listdir(base):
            with open(os.path.join(base, name, "size")) as f:
                text = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * mult)
        return max(sizes) if sizes else None
    except (OSError, ValueError):
        return None


def start(out, interpret, cpu_copy_per_row=False) -> float:
    """Times the copy bandwidth and prints the lines every run starts with: the device,
    jax version, copy bandwidth and which backends cannot run here. Returns bytes/s.
    cpu_copy_per_row: the scenario gives each CPU row a copy of its own bytes."""
    import jax

    from jaxquant import dispatch

    bw = copy_bandwidth()
    dev = jax.devices()[0]
    out(f"# device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}")
    if on_cpu() and cpu_copy_per_row:
        llc = last_level_cache_bytes()
        out(f"# CPU, {cpu_threads()} thread(s) (XLA's pool and the ffi kernels; `taskset -c 0` "
            "for one): GB/s and %copy against a host copy of the same bytes as the row's "
            f"timed call, on as many threads (at most {CPU_COPY_MAX_BYTES >> 20} MiB); "
            f"last-level cache {llc >> 20 if llc else '?'} MiB: a call whose bytes fit it "
            "runs from the cache, and so does its copy")
    elif on_cpu():
        out("# CPU: no GB/s or %copy columns (a copy or a product this size runs from the "
            "caches, so bytes/s say nothing about memory); GFLOP/s instead of TFLOP/s")
    else:
        out(f"# copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    if dispatch.unavailable_reason("ffi") is not None:
        out(f"# ffi: {dispatch.unavailable_reason('ffi')}")
    if pallas_label(interpret) is None:
        out("# pallas: no GPU here (--interpret times the kernels in interpret mode)")
    return bw


# ---------------------------------------------------------------------------
# Results.


@dataclasses.dataclass
class Row:
    """One timed implementation at one case. `case` labels the shape (and layer),
    `x` is the swept size (M, rows or tokens) the plot puts on its axis and
    `family` the rest of the shape (one plot panel per family and mode)."""
    case: str
    x: int
    family: str
    mode: str
    impl: str
    us: float | None
    nbytes: float
    flops: float = 0.0
    err: float | None = None
    note: str = ""
    bw: float | None = None   # this row's copy bandwidth (CPU: a copy of the same bytes)


def run_case(rows, fn, args, *, n_products, nbytes, case, x, family, mode, impl, iters,
             target_ms, bw, flops=0.0, check: Callable | None = None, out=print,
             row_bw: float | None = None):
    """Time fn(*args) and append its Row (err from check(first output), where given;
    row_bw: the row's own copy bandwidth); a failure is reported in one line and the
    run goes on."""
    import jax

    progress(f"{case} {mode} {impl}")
    inner = inner_calls(max(nbytes / bw * 1e6, 3.0), n_products, target_ms)
    try:
        first = jax.block_until_ready(fn(*args))
        err = check(first) if check is not None else None
        sec = timeit(fn, args, n_products, iters, inner)
    except Exception as e:  # noqa: BLE001 - report and go on
        msg = str(e).splitlines()[0][:200] if str(e) else ""
        out(f"# {impl} failed at {case} {mode}: {type(e).__name__}: {msg}")
        rows.append(Row(case, x, family, mode, impl, None, nbytes, flops, note="failed",
                        bw=row_bw))
        return None
    row = Row(case, x, family, mode, impl, sec * 1e6, nbytes, flops, err, bw=row_bw)
    rows.append(row)
    return row


def print_table(rows, bw, out, *, base: str | None, ref: str, case_title: str, flops=True):
    """A markdown table of `rows` (one case): time, speed-up over the `base` impl
    (where given) and over the same mode's `ref` impl, GB/s and %copy (not on the CPU),
    TFLOP/s (GFLOP/s on the CPU), error."""
    cpu = on_cpu()
    with_copy = not cpu or any(r.bw for r in rows)
    cols = [case_title, "mode", "impl", "µs"] + ([f"vs {base}"] if base else [])
    cols += [f"vs {ref}"]
    cols += ["GB/s", "%copy"] if with_copy else []
    cols += [("GFLOP/s" if cpu else "TFLOP/s")] if flops else []
    cols += ["rel.err"]
    out("")
    out("| " + " | ".join(cols) + " |")
    out("|" + "|".join("---" if i < 3 else "---:" for i in range(len(cols))) + "|")
    base_row = next((r for r in rows if r.impl == base and r.us), None) if base else None
    for r in rows:
        if r.us is None:
            out("| " + " | ".join([r.case, r.mode, r.impl, r.note] + [""] * (len(cols) - 4))
                + " |")
            continue
        ref_row = next((q for q in rows if q.mode == r.mode and q.impl == ref and q.us), None)
        vs_ref = (f"{ref_row.us / r.us:.2f}x" if ref_row is not None and r.impl != ref
                  and r.mode != "-" else "")
        vs_base = [f"{base_row.us / r.us:.2f}x" if base_row is not None else ""] if base else []
        gbs = r.nbytes / (r.us * 1e-6) / 1e9
        cells = [r.case, r.mode, r.impl, f"{r.us:.1f}", *vs_base, vs_ref]
        if with_copy:
            cells += [f"{gbs:.2f}" if cpu else f"{gbs:.0f}",
                      f"{100 * gbs * 1e9 / (r.bw or bw):.0f}%"]
        flop_s = r.flops / (r.us * 1e-6)
        cells += [f"{flop_s / 1e9:.1f}" if cpu else f"{flop_s / 1e12:.2f}"] if flops else []
        cells += ["" if r.err is None else f"{r.err:.1e}"]
        out("| " + " | ".join(cells) + " |")


def plot(rows, bw, path, xlabel):
    """Time vs the swept size per implementation, one panel per (mode, shape family),
    with the bandwidth roofline (bytes / copy bandwidth) of the quantized product."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.family, r.mode) for r in rows if r.mode != "-" and r.us})
    if not panels:
        raise ValueError("nothing to plot: no timed rows")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 3.2 * len(panels)), squeeze=False)
    for ax, (fam, mode) in zip(axes[:, 0], panels):
        sel = [r for r in rows if r.family == fam and r.mode in (mode, "-") and r.us]
        for impl in dict.fromkeys(r.impl for r in sel):
            pts = sorted((r.x, r.us) for r in sel if r.impl == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        roof = sorted({(r.x, r.nbytes / bw * 1e6) for r in sel if r.mode == mode})
        ax.plot([p[0] for p in roof], [p[1] for p in roof], "k--", label="copy-bandwidth bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("µs per product")
        ax.set_title(f"{fam}, {mode}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Command-line helpers: parse errors become one-line argparse messages.


def int_tuples(width: int, what: str):
    """An argparse type: 'a,b;a,b' -> ((a, b), ...) of `width` positive ints each."""
    def parse(text):
        out = []
        for item in text.split(";"):
            item = item.strip().strip("()")
            if not item:
                continue
            try:
                vals = tuple(int(v) for v in item.replace("x", ",").split(","))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{item!r} is not {width} comma-separated integers ({what})") from None
            if len(vals) != width or min(vals) < 1:
                raise argparse.ArgumentTypeError(
                    f"{item!r} must be {width} positive integers ({what})")
            out.append(vals)
        if not out:
            raise argparse.ArgumentTypeError(f"no shapes given ({what})")
        return tuple(out)
    return parse


def names(valid, what: str):
    """An argparse type: 'a,b' -> ('a', 'b'), each one of `valid`."""
    def parse(text):
        got = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in got if v not in valid]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad))}; expected some of {', '.join(valid)}")
        return got
    return parse


def ints(text):
    """An argparse type: '1,8' -> (1, 8) ('' -> ())."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers") from None


def common_options(parser, *, copies, iters, target_ms):
    """Options every benchmark takes (defaults from the platform)."""
    g = parser.add_argument_group("measurement")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="activation (and dense-weight) dtype (default: %(default)s)")
    g.add_argument("--copies", type=int, default=copies,
                   help="distinct input copies per timed call, at least 8, so inputs come from "
                        "memory rather than cache (default here: %(default)s)")
    g.add_argument("--iters", type=int, default=iters,
                   help="timed samples; the table shows their median (default here: "
                        "%(default)s)")
    g.add_argument("--target-ms", type=float, default=target_ms,
                   help="device work per sample, in ms (default here: %(default)s)")
    g.add_argument("--no-check", action="store_true",
                   help="skip the accuracy column (rel. error against a float32/float64 product)")
    g.add_argument("--interpret", action="store_true",
                   help="also time the Pallas kernels in interpret mode where there is no GPU "
                        "(slow; rows labelled 'pallas (interpret)'; checks, not speed)")
    json_out_option(g)
    g.add_argument("--plot", metavar="FILE", default=None,
                   help="also draw time vs size per implementation with the copy-bandwidth "
                        "bound into FILE (.png, .svg, .pdf; needs matplotlib)")


def json_out_option(group):
    """--json-out FILE: the tables as data (write_json)."""
    group.add_argument("--json-out", metavar="FILE", default=None,
                       help="also merge every table row into FILE (benchmarks/<device>/<op>.json, "
                            "benchmarks/README.md): one entry per row with its command, GPU, "
                            "jax version and date; a row whose key is there replaces it")


def check_common(parser, args):
    if args.copies < 8:
        parser.error("--copies must be at least 8 (fewer let the cache hold the inputs)")
    if args.iters < 1 or args.target_ms <= 0:
        parser.error("--iters must be >= 1 and --target-ms > 0")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")


def pallas_label(interpret: bool) -> str | None:
    """The Pallas rows' label here ('pallas', 'pallas (interpret)'), or None where
    the Pallas kernels cannot run (no GPU and no --interpret)."""
    if not on_cpu():
        return "pallas"
    return "pallas (interpret)" if interpret else None


# ---------------------------------------------------------------------------
# Results as data (--json-out; benchmarks/README.md describes the files).

_MEASURED = re.compile(r"\d\.\d|%|\dx\b")
# A name such as "llama3.2-1b" or "gpt-oss-20b" (a letter first, no spaces) is a label
# even where it holds a decimal: the model table's config column.
_NAME = re.compile(r"[A-Za-z][\w.\-]*")


def _measured(cell: str) -> bool:
    return bool(_MEASURED.search(cell)) and not _NAME.fullmatch(cell)


class TableRecorder:
    """An `out` that passes every line on and keeps the markdown tables printed through
    it, each as (header, rows of cells)."""

    def __init__(self, out):
        self.out, self.tables, self._open = out, [], False

    def __call__(self, line=""):
        self.out(line)
        for text in str(line).splitlines() or [""]:
            text = text.strip()
            if not (text.startswith("|") and text.endswith("|")):
                self._open = False
                continue
            cells = [c.strip().strip("*") for c in text.strip("|").split("|")]
            if not self._open:
                self.tables.append((cells, []))
                self._open = True
            elif not all(set(c) <= set("-: ") for c in cells):
                self.tables[-1][1].append(cells)

    def records(self, scenario: str) -> list[dict]:
        """One {"key", "values"} per table row. The key is the scenario and the row's
        leading label columns (those whose cells hold no measurement: no decimal, %, or
        ratio), the values the other columns (numbers where a cell is one)."""
        out = []
        for header, rows in self.tables:
            n_key = next((i for i in range(len(header))
                          if any(i < len(r) and _measured(r[i]) for r in rows)), len(header))
            for r in rows:
                if not any(r[n_key:]):
                    continue
                key = " / ".join(f"{h}={c}" for h, c in zip(header[:n_key], r) if c)
                values = {h: _number(c) for h, c in zip(header[n_key:], r[n_key:]) if c}
                out.append({"key": f"{scenario}: {key}", "values": values})
        return out


def _number(cell: str):
    try:
        return float(cell)
    except ValueError:
        return cell


def write_json(path: str, records: list[dict], command: str) -> int:
    """Merge `records` into the JSON file at `path` (created if absent): each entry gets
    the command, the GPU, the jax version and today's date; an entry whose key is already
    there replaces it. One entry per line, sorted by key. Returns the entry count."""
    import jax

    stamp = {"command": command, "gpu": jax.devices()[0].device_kind,
             "jax": jax.__version__, "date": datetime.date.today().isoformat()}
    entries = {}
    if os.path.exists(path):
        with open(path) as f:
            entries = {e["key"]: e for e in json.load(f)["entries"]}
    for r in records:
        entries[r["key"]] = {**r, **stamp}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    lines = [json.dumps(entries[k], ensure_ascii=False) for k in sorted(entries)]
    with open(path, "w") as f:
        f.write('{"entries": [\n' + ",\n".join(lines) + "\n]}\n")
    return len(entries)
