"""Build and drive the MSL-on-CPU shim (metal_stdlib here): the metal_src/*.metal kernels
compiled as C++ with harness.cc into one shared library, dispatched through ctypes with
the grids of metal_src/dispatch_plan.h (the bridge's own choice of kernel and geometry).

`MetalOnCpu` mirrors what metal_src/metal_ffi.mm does for each op: the parameter block
from the operand shapes, the plan, the buffers in binding order. Only the Objective-C++
part (buffers, pipelines, command encoding) is not exercised here.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess

import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIM = pathlib.Path(__file__).resolve().parent
METAL_SRC = ROOT / "metal_src"

DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
               np.dtype(ml_dtypes.bfloat16): "bfloat16"}


def cxx() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++", "clang++-19"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def sources() -> list[pathlib.Path]:
    return sorted(METAL_SRC.glob("*.metal")) + [SHIM / "faulty.metal"]


def build(out_dir: pathlib.Path) -> pathlib.Path:
    """Compile every kernel source and the harness (two at a time) into one library."""
    compiler = cxx()
    flags = ["-std=c++20", "-O1", "-fPIC", "-pthread", "-fno-strict-aliasing", "-w",
             f"-I{SHIM}", f"-I{METAL_SRC}"]
    import jax.ffi  # the XLA FFI headers of the handlers (shim_ffi.cc)

    jobs = [(src, out_dir / (src.name + ".o"), ["-x", "c++"]) for src in sources()]
    jobs.append((SHIM / "harness.cc", out_dir / "harness.o", []))
    jobs.append((SHIM / "shim_ffi.cc", out_dir / "shim_ffi.o", ["-isystem", jax.ffi.include_dir()]))
    return _compile_and_link(compiler, flags, jobs, ["-shared", "-pthread"],
                             out_dir / "libjq_metal_shim.so", "the shim")


def build_tsan(out_dir: pathlib.Path) -> pathlib.Path:
    """The ThreadSanitizer driver (tsan_main.cc) with every kernel and the harness."""
    compiler = cxx()
    flags = ["-std=c++20", "-O1", "-g", "-fsanitize=thread", "-pthread", "-fno-strict-aliasing",
             "-w", f"-I{SHIM}", f"-I{METAL_SRC}"]

    jobs = [(src, out_dir / (src.name + ".o"), ["-x", "c++"] if src.suffix == ".metal" else [])
            for src in [*sources(), SHIM / "harness.cc", SHIM / "tsan_main.cc"]]
    return _compile_and_link(compiler, flags, jobs, flags, out_dir / "tsan_main",
                             "the TSan driver")


def _compile_and_link(compiler, flags, jobs, link_flags, out, what) -> pathlib.Path:
    """Compile jobs (source, object, extra flags) two at a time, then link the objects
    into out; a RuntimeError with the compiler's message (what names out) on failure."""

    def compile_one(job):
        src, obj, extra = job
        r = subprocess.run([compiler, *flags, *extra, "-c", str(src), "-o", str(obj)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compiling {src.name} failed:\n{r.stderr[-4000:]}")
        return obj

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        objs = list(pool.map(compile_one, jobs))
    r = subprocess.run([compiler, *link_flags, *map(str, objs), "-o", str(out)],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"linking {what} failed:\n{r.stderr[-4000:]}")
    return out


def build_cached(cache_root: pathlib.Path) -> pathlib.Path:
    """build() once per source state: keyed by the sources' and the compiler's bytes, under
    a lock, so pytest-xdist workers sharing `cache_root` compile it once between them."""
    h = hashlib.sha256(cxx().encode())
    for src in [*sources(), SHIM / "harness.cc", SHIM / "shim_ffi.cc", *sorted(SHIM.glob("metal_*")),
                *sorted(METAL_SRC.glob("*.h")), *sorted((SHIM / "MetalPerformancePrimitives").glob("*"))]:
        h.update(src.name.encode() + src.read_bytes())
    out = cache_root / f"metal_shim_{h.hexdigest()[:16]}"
    cache_root.mkdir(parents=True, exist_ok=True)
    with open(cache_root / "metal_shim.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lib = out / "libjq_metal_shim.so"
        if not lib.is_file():
            out.mkdir(exist_ok=True)
            build(out)
        return lib


class ShimError(RuntimeError):
    pass


def _aligned(a: np.ndarray) -> np.ndarray:
    """A 64-byte aligned C-contiguous copy (Metal buffers are page aligned)."""
    a = np.ascontiguousarray(a)
    raw = np.empty(a.nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _u32(*fields) -> np.ndarray:
    """A parameter block: every field is 4 bytes (jq_params.h)."""
    out = np.empty(len(fields), np.uint32)
    for i, f in enumerate(fields):
        out[i] = np.float32(f).view(np.uint32) if isinstance(f, float) else f
    return out


class MetalOnCpu:
    def __init__(self, lib_path, timeout_s: float = 60.0):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.jq_shim_kernel_name.restype = ctypes.c_char_p
        self.timeout_s = timeout_s

    def kernels(self) -> list[str]:
        return [self.lib.jq_shim_kernel_name(i).decode()
                for i in range(self.lib.jq_shim_kernel_count())]

    def plan(self, op, a, b, params):
        name = ctypes.create_string_buffer(128)
        grid = (ctypes.c_uint * 3)()
        threads = ctypes.c_uint()
        rc = self.lib.jq_shim_plan(op.encode(), a.encode(), (b or "").encode(),
                                   params.ctypes.data_as(ctypes.c_void_p), name, 128, grid,
                                   ctypes.byref(threads))
        assert rc == 0, op
        return name.value.decode(), tuple(grid), threads.value

    def dispatch(self, kernel, buffers, grid, threads, timeout_s=None):
        bufs = (ctypes.c_void_p * len(buffers))(*[b.ctypes.data for b in buffers])
        err = ctypes.create_string_buffer(1024)
        rc = self.lib.jq_shim_dispatch(kernel.encode(), bufs, len(buffers), *grid, threads,
                                       ctypes.c_double(timeout_s or self.timeout_s), err, 1024)
        if rc:
            raise ShimError(err.value.decode())

    def run(self, op, a, b, buffers, params, **plan_kw):
        kernel, grid, threads = self.plan(op, a, b, params)
        self.dispatch(kernel, [*buffers, params], grid, threads)
        return kernel, grid, threads

    # ---- the ops, as the bridge runs them -------------------------------------------

    @staticmethod
    def _format(qw) -> str:
        return {"affine": "affine4", "mxfp4": "mxfp4", "fp4": "fp4"}[qw.mode]

    @staticmethod
    def _qw_buffers(qw, n_lead):
        """data/scales/biases flattened to [prod(lead), N, ...], aligned."""
        lead = int(np.prod(qw.shape[:n_lead], dtype=np.int64))
        data = _aligned(np.asarray(qw.data).reshape(lead, *qw.data.shape[n_lead:]))
        scales = _aligned(np.asarray(qw.scales))
        biases = (_aligned(np.asarray(qw.biases)) if qw.biases is not None
                  else _aligned(np.zeros(1, np.asarray(qw.scales).dtype)))
        return lead, data, scales, biases

    def qmv(self, x3, qw, ids=None):
        """x3 [Sx, M, K] @ qw[e(s)].T -> [S, M, N]; qw [E, N, K]; ids int32 [S] or None."""
        e, n, k = qw.shape
        sx, m, _ = x3.shape
        s = len(ids) if ids is not None else e
        _, data, scales, biases = self._qw_buffers(qw, 1)
        x = _aligned(x3)
        idb = _aligned(np.asarray(ids if ids is not None else [0], np.int32))
        out = _aligned(np.zeros((s, m, n), x3.dtype))
        params = _u32(k, n, m, qw.group_size, e, s, s // sx, int(ids is not None))
        self.run("qmv", self._format(qw), DTYPE_NAMES[x.dtype],
                 [data, scales, biases, x, idb, out], params)
        return out

    def qmm(self, x3, qw3, nax=False):
        """x3 [B, M, K] @ qw3[b].T -> [B, M, N] (the GEMM; nax: the tensor-op kernel)."""
        b, n, k = qw3.shape
        _, m, _ = x3.shape
        _, data, scales, biases = self._qw_buffers(qw3, 1)
        x = _aligned(x3)
        out = _aligned(np.full((b, m, n), np.nan, x3.dtype))
        params = _u32(k, n, m, qw3.group_size, b, b, 1, 0)
        return out, self.run("qmm_nax" if nax else "qmm", self._format(qw3),
                             DTYPE_NAMES[x.dtype], [data, scales, biases, x, out], params)

    def dequantize(self, qw, dtype):
        *lead, n, k = qw.shape
        rows = int(np.prod(lead, dtype=np.int64)) * n
        _, data, scales, biases = self._qw_buffers(qw, 0)
        out = _aligned(np.full((rows, k), np.nan, dtype))
        params = _u32(rows, k, qw.group_size)
        self.run("dequantize", self._format(qw), DTYPE_NAMES[np.dtype(dtype)],
                 [data, scales, biases, out], params)
        return out.reshape(*lead, n, k)

    @staticmethod
    def _weight(w, dtype):
        return _aligned(np.asarray(w) if w is not None else np.zeros(1, dtype))

    def rms_norm(self, x, w=None, eps=1e-6, off=0.0):
        n = x.shape[-1]
        xa = _aligned(x.reshape(-1, n))
        out = _aligned(np.full(xa.shape, np.nan, x.dtype))
        params = _u32(xa.shape[0], n, n, int(w is not None), float(eps), float(off), 0, 0)
        kernel, _, _ = self.run("rms_norm", DTYPE_NAMES[x.dtype], None,
                                [xa, self._weight(w, x.dtype), out], params)
        return out.reshape(x.shape), kernel

    def add_rms_norm(self, x, r, w=None, eps=1e-6, off=0.0):
        n = x.shape[-1]
        xa, ra = _aligned(x.reshape(-1, n)), _aligned(r.reshape(-1, n))
        y = _aligned(np.full(ra.shape, np.nan, r.dtype))
        h = _aligned(np.full(ra.shape, np.nan, r.dtype))
        params = _u32(xa.shape[0], n, n, int(w is not None), float(eps), float(off), 0, 0)
        self.run("add_rms_norm", DTYPE_NAMES[x.dtype], DTYPE_NAMES[r.dtype],
                 [xa, ra, self._weight(w, r.dtype), y, h], params)
        return y.reshape(x.shape), h.reshape(x.shape)

    def gated_rms_norm(self, x, gate, w=None, eps=1e-6, off=0.0, activation="silu",
                       norm_before_gate=True, group_size=None):
        n = x.shape[-1]
        g = group_size or n
        xa, ga = _aligned(x.reshape(-1, g)), _aligned(gate.reshape(-1, g))
        out = _aligned(np.full(ga.shape, np.nan, gate.dtype))
        params = _u32(xa.shape[0], g, n, int(w is not None), float(eps), float(off),
                      {"silu": 0, "sigmoid": 1}[activation], int(bool(norm_before_gate)))
        self.run("gated_rms_norm", DTYPE_NAMES[x.dtype], DTYPE_NAMES[gate.dtype],
                 [xa, ga, self._weight(w, gate.dtype), out], params)
        return out.reshape(gate.shape)
