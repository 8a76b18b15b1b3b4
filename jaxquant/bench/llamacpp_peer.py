"""llama.cpp's CPU matrix-vector product as a peer of `bench qmm` (`--peer llamacpp`).

The peer is ggml, the tensor library under llama.cpp, as the `llama-cpp-python`
package ships it (`pip install llama-cpp-python`, or this project's `peer-cpu`
extra): its shared libraries are loaded from the installed `llama_cpp` package
with ctypes and driven through ggml's own C API, the way llama.cpp runs a
model's weights on a CPU:

- the weight is a ggml tensor in a ggml block format, in the first of the CPU
  device's extra buffer types (AMX, the repacked "CPU_REPACK" layouts) that takes
  the product, else in the plain CPU buffer: llama.cpp's own choice when it
  loads a model (`llama-model.cpp`, select_weight_buft). `Product(..., plain=True)`
  takes the plain buffer instead, to time ggml's generic `vec_dot` path beside it;
- the product is `ggml_mul_mat` on a CPU graph, computed by the CPU backend on a
  ggml threadpool of the thread count asked for (OpenMP's threads in a build with
  OpenMP, as pip's is), created for each timed sample and freed after it, so its
  waiting threads never compete with the implementation timed next;
- x is float32: ggml quantizes it to 8 bits per block of 32 (Q8_0 or Q8_1, the
  format's `vec_dot_type`) before its integer dot products, so its result differs
  from the float product of the same weights by that rounding (about 5e-3
  relative for normal x), not only by float32 accumulation.

Block formats and how each is built from jaxquant's weights (`BLOCKS`):

- Q4_1 (per 32: float16 d and m, value d*q + m) holds `affine` 4-bit group 32 with
  float16 scales and biases exactly: the same codes, scales and biases, in ggml's
  block order;
- MXFP4 (per 32: an E8M0 byte, 4-bit E2M1 codes) holds `mxfp4` exactly;
- IQ4_NL (per 32: float16 d, 4-bit codebook indices) holds `iq4nl` with float16
  scales exactly;
- Q4_0 (symmetric 4-bit, float16 d) and Q8_0 (symmetric int8, float16 d) are
  *like* affine 4-bit and 8-bit group 32 (the same bytes per weight within a
  half-bit), not the same bits: they are quantized by ggml's own
  `ggml_quantize_chunk` from the same float weights.

The blocks are GGUF's bytes, written by `jq.io.to_gguf_tensor` (the exporter, whose
tests hold it to the gguf package's dequantizers) and read back for the checks by
`jq.io.from_gguf_tensor`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import os
import sys

import numpy as np

from jaxquant.io.gguf import GGML_TYPES

INSTALL = "pip install llama-cpp-python (or this project's extra: pip install -e '.[peer-cpu]')"

GGML_F32 = GGML_TYPES["F32"][0]
GGML_MAX_N_THREADS = 512    # ggml.h: the size of ggml_threadpool_params.cpumask


@dataclasses.dataclass(frozen=True)
class Block:
    """One ggml block format and the jaxquant format it is compared with."""
    name: str
    mode: str              # the jaxquant mode of its pair
    same_bits: bool        # built from jaxquant's codes and scales (else ggml quantizes)

    @property
    def type_id(self) -> int:
        return GGML_TYPES[self.name][0]

    @property
    def block_bytes(self) -> int:
        return GGML_TYPES[self.name][2]


BLOCKS = {"Q4_0": Block("Q4_0", "affine4", False), "Q4_1": Block("Q4_1", "affine4", True),
          "Q8_0": Block("Q8_0", "affine8", False), "IQ4_NL": Block("IQ4_NL", "iq4nl", True),
          "MXFP4": Block("MXFP4", "mxfp4", True)}
# jaxquant mode -> the ggml blocks it is compared with (same bits first).
PAIRS = {mode: tuple(sorted((b.name for b in BLOCKS.values() if b.mode == mode),
                            key=lambda name: not BLOCKS[name].same_bits))
         for mode in dict.fromkeys(b.mode for b in BLOCKS.values())}
QK = 32   # elements per block in every format above


def jaxquant_mode_args(mode: str) -> dict:
    """jq.quantize arguments of the jaxquant side of `mode`'s pairs: group 32 (every
    block above is 32 wide)."""
    return {"affine4": dict(mode="affine", bits=4, group_size=32),
            "affine8": dict(mode="affine", bits=8, group_size=32),
            "mxfp4": dict(mode="mxfp4"), "iq4nl": dict(mode="iq4nl")}[mode]


def blocks_from_jaxquant(block: Block, qw) -> np.ndarray:
    """The ggml blocks (GGUF bytes, uint8 [N, K/32 * block bytes]) holding a 2-D
    QuantizedArray's bits exactly: Q4_1 from affine 4-bit group 32 with float16 scales
    and biases, MXFP4 from mxfp4, IQ4_NL from iq4nl with float16 scales."""
    import jaxquant as jq

    if not block.same_bits:
        raise ValueError(f"{block.name} is not built from jaxquant's bits (ggml quantizes it)")
    if len(qw.shape) != 2:
        raise ValueError(f"the peer's weights are 2-D [N, K]; got shape {qw.shape}")
    return jq.io.to_gguf_tensor(qw, block.name)


def dequantize64(block: Block, blocks: np.ndarray, k: int) -> np.ndarray:
    """The float32 values of ggml blocks [N, K], as float64: jq.io's importer, then the
    reference dequantize (the check's weights; the tests hold them to the oracle)."""
    import jax.numpy as jnp

    import jaxquant as jq
    from jaxquant.quantize import dequantize_reference

    qw = jq.io.from_gguf_tensor(blocks, block.name, (blocks.shape[0], k), dtype=jnp.float32)
    return np.asarray(dequantize_reference(qw, jnp.float32), np.float64)


# ---------------------------------------------------------------------------
# ggml through ctypes.


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


class _ThreadpoolParams(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS), ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int), ("poll", ctypes.c_uint32),
                ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


_P = ctypes.c_void_p
# name: (restype, argtypes)
_SIGNATURES = {
    "ggml_init": (_P, [_InitParams]),
    "ggml_free": (None, [_P]),
    "ggml_tensor_overhead": (ctypes.c_size_t, []),
    "ggml_graph_overhead": (ctypes.c_size_t, []),
    "ggml_new_tensor_2d": (_P, [_P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
    "ggml_mul_mat": (_P, [_P, _P, _P]),
    "ggml_new_graph": (_P, [_P]),
    "ggml_build_forward_expand": (None, [_P, _P]),
    "ggml_nbytes": (ctypes.c_size_t, [_P]),
    "ggml_row_size": (ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
    "ggml_quantize_chunk": (ctypes.c_size_t, [ctypes.c_int, _P, _P, ctypes.c_int64,
                                              ctypes.c_int64, ctypes.c_int64, _P]),
    "ggml_backend_cpu_init": (_P, []),
    "ggml_backend_free": (None, [_P]),
    "ggml_backend_cpu_set_n_threads": (None, [_P, ctypes.c_int]),
    "ggml_backend_cpu_set_threadpool": (None, [_P, _P]),
    "ggml_threadpool_params_default": (_ThreadpoolParams, [ctypes.c_int]),
    "ggml_threadpool_new": (_P, [ctypes.POINTER(_ThreadpoolParams)]),
    "ggml_threadpool_free": (None, [_P]),
    "ggml_backend_cpu_reg": (_P, []),
    "ggml_backend_reg_dev_get": (_P, [_P, ctypes.c_size_t]),
    "ggml_backend_reg_get_proc_address": (_P, [_P, ctypes.c_char_p]),
    "ggml_backend_cpu_buffer_type": (_P, []),
    "ggml_backend_buft_name": (ctypes.c_char_p, [_P]),
    "ggml_backend_alloc_ctx_tensors_from_buft": (_P, [_P, _P]),
    "ggml_backend_buffer_free": (None, [_P]),
    "ggml_backend_dev_supports_op": (ctypes.c_bool, [_P, _P]),
    "ggml_backend_tensor_set": (None, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
    "ggml_backend_tensor_get": (None, [_P, _P, ctypes.c_size_t, ctypes.c_size_t]),
    "ggml_backend_graph_compute": (ctypes.c_int, [_P, _P]),
    "ggml_log_set": (None, [_P, _P]),
}
# ggml's log callback: (enum ggml_log_level, const char *, void *). Its messages at
# debug and info level (one a repacked tensor) would interleave with the progress lines.
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
GGML_LOG_LEVEL_WARN = 3


@_LOG_CALLBACK
def _log(level, text, _):
    if level >= GGML_LOG_LEVEL_WARN and text:
        sys.stderr.write("[ggml] " + text.decode(errors="replace"))


def library_dir() -> str | None:
    """The folder of the ggml libraries the installed llama_cpp package ships, or None."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for sub in ("lib", ""):
            if glob.glob(os.path.join(root, sub, "libggml-base.*")):
                return os.path.join(root, sub)
    return None


def unavailable() -> str | None:
    """Why the peer cannot run here (one line naming the install), or None."""
    try:
        _ggml()
    except (OSError, AttributeError) as e:
        return str(e).splitlines()[0]
    return None


@functools.lru_cache(maxsize=None)
def _ggml():
    """The loaded libraries as one namespace of typed functions (functions are looked
    up in libggml-base, libggml-cpu and libggml, in that order)."""
    where = library_dir()
    if where is None:
        raise OSError(f"the llama.cpp peer needs the llama_cpp package's ggml libraries: "
                      f"{INSTALL}")
    libs = []
    for stem in ("libggml-base", "libggml-cpu", "libggml"):
        paths = sorted(glob.glob(os.path.join(where, stem + ".*")))
        if not paths:
            raise OSError(f"{where} has no {stem} library (the llama_cpp package's ggml; "
                          f"{INSTALL})")
        libs.append(ctypes.CDLL(paths[0], mode=ctypes.RTLD_GLOBAL))

    class Namespace:
        pass

    ns = Namespace()
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = next((getattr(lib, name) for lib in libs if hasattr(lib, name)), None)
        if fn is None:
            raise AttributeError(f"the ggml in {where} has no {name} (an llama-cpp-python "
                                 "whose ggml API this peer does not know)")
        fn.restype, fn.argtypes = restype, argtypes
        setattr(ns, name, fn)
    ns.ggml_log_set(ctypes.cast(_log, ctypes.c_void_p), None)
    return ns


def quantize(block: Block, w: np.ndarray) -> np.ndarray:
    """ggml's own quantization of float weights w [N, K] into `block`s (GGUF bytes, uint8
    [N, K/32 * block bytes])."""
    g = _ggml()
    w = np.ascontiguousarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [N, K]; got shape {list(w.shape)}")
    n, k = w.shape
    if k % QK:
        raise ValueError(f"K={k} must be a multiple of {QK} for ggml's blocks")
    out = np.empty((n, k // QK * block.block_bytes), np.uint8)
    size = g.ggml_quantize_chunk(block.type_id, w.ctypes.data, out.ctypes.data, 0, n, k, None)
    if size != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {size} bytes, expected {out.nbytes}")
    return out


# Extra buffer types whose M > 1 kernels use AMX tiles: ggml's tinygemm_kernel_amx raises
# SIGILL on a tile instruction on this project's CPU machine (a Xeon with AMX-INT8, where
# a tile program of our own runs): ggml loads its tile configuration from a stack copy
# the compiler may drop (ggml-org/llama.cpp pull request 26954). M = 1 takes the
# AVX512-VNNI GEMV of the same buffer, no tiles, and keeps it.
TILE_BUFFERS = ("AMX",)


class Product:
    """`len(weights)` products y_i = x @ w_i.T in one ggml CPU graph (ggml_mul_mat each),
    the weights ggml blocks of one format (GGUF bytes, uint8 [N, K/32 * block bytes]), in
    the buffer llama.cpp would pick (plain=True: the plain CPU buffer; at M > 1 never
    TILE_BUFFERS, which `skipped` names where llama.cpp would have used one). `buffer`
    names the buffer type; `set_x` writes x; `run()` computes the graph on the threads
    `set_threads` gave; `outputs()` reads the products back."""

    def __init__(self, block: Block, weights, m: int, plain: bool = False):
        g = self.g = _ggml()
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"m (rows of x) must be a positive int; got {m!r}")
        weights = [np.asarray(w) for w in weights]
        if not weights or weights[0].ndim != 2:
            raise ValueError(f"weights must be {block.name} blocks (uint8 [N, K/32 * "
                             f"{block.block_bytes}]), at least one")
        self.block, self.m = block, m
        n, row = weights[0].shape
        self.n, self.k = n, row // block.block_bytes * QK
        for w in weights:
            if (w.dtype != np.uint8 or w.shape != (n, row) or row % block.block_bytes
                    or not row):
                raise ValueError(f"weights must be {block.name} blocks (uint8 [N, K/32 * "
                                 f"{block.block_bytes}]) of one shape; got {w.dtype} "
                                 f"{list(w.shape)} after {list(weights[0].shape)}")
        self.backend = g.ggml_backend_cpu_init()
        if not self.backend:
            raise RuntimeError("ggml_backend_cpu_init failed")
        self.ctx_w = self.ctx_x = self.buf_w = self.buf_x = self.pool = None
        try:
            self._build(weights, plain)
        except BaseException:
            self.close()
            raise

    def _context(self, n_tensors, graph=False):
        g = self.g
        size = g.ggml_tensor_overhead() * (n_tensors + 4) + (g.ggml_graph_overhead()
                                                             if graph else 0)
        ctx = g.ggml_init(_InitParams(size, None, True))
        if not ctx:
            raise RuntimeError("ggml_init failed")
        return ctx

    def _build(self, weights, plain):
        g = self.g
        dev = g.ggml_backend_reg_dev_get(g.ggml_backend_cpu_reg(), 0)
        # llama.cpp's order: the CPU device's extra buffer types first, the first that
        # takes the product wins; then the plain CPU buffer.
        candidates = [] if plain else self._extra_buffer_types(dev)
        self.skipped = []
        for buft in candidates + [g.ggml_backend_cpu_buffer_type()]:
            name = g.ggml_backend_buft_name(buft).decode()
            if self.m > 1 and name in TILE_BUFFERS:
                if self._graph_in(buft, len(weights), dev, keep=False):
                    self.skipped.append(name)     # llama.cpp would have put it there
                continue
            if self._graph_in(buft, len(weights), dev):
                self.buffer = name
                break
        else:
            raise RuntimeError(f"ggml's CPU device takes no {self.block.name} product")
        for t, w in zip(self.w, weights):
            w = np.ascontiguousarray(w)
            if w.nbytes != g.ggml_nbytes(t):
                raise ValueError(f"{w.nbytes} bytes for a {g.ggml_nbytes(t)}-byte tensor")
            g.ggml_backend_tensor_set(t, w.ctypes.data, 0, w.nbytes)

    def _graph_in(self, buft, copies, dev, keep=True) -> bool:
        """Builds the graph with the weights in buffer type `buft`; False (and nothing
        kept) where the CPU device does not take the product from that buffer. keep=False:
        only says whether it takes it, keeping nothing either way."""
        g = self.g
        self.ctx_w = self._context(copies)
        self.ctx_x = self._context(2 * copies + 1, graph=True)
        self.w = [g.ggml_new_tensor_2d(self.ctx_w, self.block.type_id, self.k, self.n)
                  for _ in range(copies)]
        self.x = g.ggml_new_tensor_2d(self.ctx_x, GGML_F32, self.k, self.m)
        self.y = [g.ggml_mul_mat(self.ctx_x, w, self.x) for w in self.w]
        self.graph = g.ggml_new_graph(self.ctx_x)
        for y in self.y:
            g.ggml_build_forward_expand(self.graph, y)
        self.buf_x = g.ggml_backend_alloc_ctx_tensors_from_buft(
            self.ctx_x, g.ggml_backend_cpu_buffer_type())
        self.buf_w = g.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx_w, buft)
        if not self.buf_x or not self.buf_w:
            raise MemoryError(f"ggml could not allocate the {self.block.name} product")
        takes = bool(g.ggml_backend_dev_supports_op(dev, self.y[0]))
        if takes and keep:
            return True
        for attr, free in (("buf_w", g.ggml_backend_buffer_free),
                           ("buf_x", g.ggml_backend_buffer_free),
                           ("ctx_w", g.ggml_free), ("ctx_x", g.ggml_free)):
            free(getattr(self, attr))
            setattr(self, attr, None)
        return takes

    def _extra_buffer_types(self, dev) -> list:
        g = self.g
        addr = g.ggml_backend_reg_get_proc_address(g.ggml_backend_cpu_reg(),
                                                   b"ggml_backend_dev_get_extra_bufts")
        if not addr:
            return []
        fn = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)
        arr, out = fn(dev), []
        while arr and arr[len(out)]:
            out.append(arr[len(out)])
        return out

    def set_threads(self, n: int):
        """Compute on a fresh ggml threadpool of n threads (the previous one freed; until
        the first call, and after `release_threads`, ggml makes a pool per compute)."""
        g = self.g
        self.release_threads()
        params = g.ggml_threadpool_params_default(n)
        self.pool = g.ggml_threadpool_new(ctypes.byref(params))
        if not self.pool:
            raise RuntimeError(f"ggml_threadpool_new({n}) failed")
        g.ggml_backend_cpu_set_threadpool(self.backend, self.pool)
        g.ggml_backend_cpu_set_n_threads(self.backend, n)

    def set_x(self, x: np.ndarray):
        x = np.ascontiguousarray(x, np.float32)
        if x.shape != (self.m, self.k):
            raise ValueError(f"x must be [{self.m}, {self.k}]; got {list(x.shape)}")
        self.g.ggml_backend_tensor_set(self.x, x.ctypes.data, 0, x.nbytes)

    def run(self):
        status = self.g.ggml_backend_graph_compute(self.backend, self.graph)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute returned status {status}")

    def outputs(self) -> list[np.ndarray]:
        out = []
        for y in self.y:
            a = np.empty((self.m, self.n), np.float32)
            self.g.ggml_backend_tensor_get(y, a.ctypes.data, 0, a.nbytes)
            out.append(a)
        return out

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight in the block format (what a product reads)."""
        return self.n * self.g.ggml_row_size(self.block.type_id, self.k)

    def release_threads(self):
        """Free the threadpool: its threads poll for work a while after each compute."""
        if self.pool:
            # detach first: the backend pauses a pool it is handed away from
            self.g.ggml_backend_cpu_set_threadpool(self.backend, None)
            self.g.ggml_threadpool_free(self.pool)
            self.pool = None

    def close(self):
        g = self.g
        self.release_threads()
        for attr, free in (("buf_w", g.ggml_backend_buffer_free),
                           ("buf_x", g.ggml_backend_buffer_free),
                           ("ctx_w", g.ggml_free), ("ctx_x", g.ggml_free),
                           ("backend", g.ggml_backend_free)):
            if getattr(self, attr, None):
                free(getattr(self, attr))
                setattr(self, attr, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------
# The comparison `bench qmm --peer llamacpp` prints.

JAXQUANT_IMPL = "jaxquant jq.qmm"
RATIO = "llama.cpp µs / jaxquant µs"


def _set_jaxquant_threads(n: int) -> int | None:
    """Caps the jaxquant CPU library's threads (jq_cpu_set_threads) from the next call on;
    returns the previous cap, or None where the library is not loaded."""
    from jaxquant import ffi

    lib = ffi.libraries().get("cpu")
    if lib is None or lib.handle is None:
        return None
    return lib.handle.jq_cpu_set_threads(n)


def _relerr(y, want) -> float:
    y = np.asarray(y, np.float64)
    return float(np.linalg.norm(y - want) / np.linalg.norm(want))


@dataclasses.dataclass
class _Timed:
    """One implementation of a comparison: `call()` runs one timed call (all copies),
    `start(threads)` / `stop()` bracket its samples, `check()` its rel. error."""
    impl: str
    nbytes: int
    call: object
    check: object
    start: object = lambda threads: None
    stop: object = lambda: None


def _interleaved(timed, threads, *, copies, iters, target_ms, case, mode, x, family, out):
    """Rows of `timed` at one case: each sample times every implementation once, in turn
    (on a machine shared with other work, load that comes and goes falls on all of them
    alike), `inner` calls back to back per sample; time = median over `iters` samples /
    inner / copies. A failure is one line and a row marked failed."""
    import statistics
    import time

    from jaxquant.bench import harness

    live, rows = [], []
    for t in timed:
        harness.progress(f"{case} {mode} {t.impl}")
        bw = harness.cpu_copy_bandwidth(copies * t.nbytes, threads)
        row = harness.Row(case, x, family, mode, t.impl, None, t.nbytes, bw=bw)
        rows.append(row)
        try:
            t.start(threads)
            try:
                t.call()                               # warm up, then check and estimate
                row.err = t.check()
                t0 = time.perf_counter()
                t.call()
                est = (time.perf_counter() - t0) * 1e6 / copies
            finally:
                t.stop()
        except Exception as e:  # noqa: BLE001 - report and go on
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            out(f"# {t.impl} failed at {case} {mode}: {type(e).__name__}: {msg}")
            row.note = "failed"
            continue
        live.append((t, row, harness.inner_calls(est, copies, target_ms), []))
    for _ in range(iters):
        for t, row, inner, samples in live:
            t.start(threads)
            try:
                t0 = time.perf_counter()
                for _ in range(inner):
                    t.call()
                samples.append((time.perf_counter() - t0) / inner / copies)
            finally:
                t.stop()
    for t, row, inner, samples in live:
        row.us = statistics.median(samples) * 1e6
    return rows


def compare(m, k, n, modes, *, copies, iters, target_ms, plain=True, out=print):
    """Rows (harness.Row) of jaxquant's `jq.qmm` and llama.cpp's ggml_mul_mat at one shape,
    per jaxquant mode of PAIRS in `modes` and per thread count (1 and every core this
    process may use), timed interleaved in this process (`_interleaved`) on the same x
    (float32) and the same float16 weights (`copies` distinct ones per timed call, as
    `bench qmm`). plain: also time ggml's plain CPU buffer where llama.cpp would pick
    another."""
    import jax
    import jax.numpy as jnp

    import jaxquant as jq
    from jaxquant import ffi
    from jaxquant.bench import harness
    from jaxquant.quantize import dequantize_reference

    if k % QK:
        raise ValueError(f"K={k} must be a multiple of {QK} for ggml's blocks")
    counts = sorted({1, harness.cpu_threads()})
    kx, kw = jax.random.split(jax.random.PRNGKey(51))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    x64 = np.asarray(x, np.float64)
    io = (m * k + m * n) * 4
    isa = ffi.cpu_kernels_isa()
    rows = []
    for mode in (md for md in modes if md in PAIRS):
        label = mode + (" g32" if mode.startswith("affine") else "")
        qws, blocks = [], {name: [] for name in PAIRS[mode]}
        for i in range(copies):
            w = (jax.random.normal(jax.random.fold_in(kw, i), (n, k), jnp.float32)
                 * 0.05).astype(jnp.float16)
            q = jq.quantize(w, **jaxquant_mode_args(mode), layout="canonical")
            for name in PAIRS[mode]:
                b = BLOCKS[name]
                blocks[name].append(blocks_from_jaxquant(b, q) if b.same_bits
                                    else quantize(b, np.asarray(w, np.float32)))
            qws.append(jq.prepack(q))
            del w
        jax.block_until_ready(qws)
        want_jq = x64 @ np.asarray(dequantize_reference(qws[0], jnp.float32), np.float64).T
        f = jax.jit(lambda x, ws: tuple(jq.qmm(x, w) for w in ws))
        previous = []

        def jq_start(threads):
            previous.append(_set_jaxquant_threads(threads))

        def jq_stop():
            before = previous.pop()
            if before is not None:
                _set_jaxquant_threads(before)

        timed = [_Timed(f"{JAXQUANT_IMPL} ({'ffi ' + isa if isa else 'no ffi library'}, "
                        f"{qws[0].layout})", qws[0].nbytes + io,
                        call=lambda: jax.block_until_ready(f(x, qws)),
                        check=lambda: _relerr(f(x, qws)[0], want_jq),
                        start=jq_start, stop=jq_stop)]
        products = []
        try:
            for name in PAIRS[mode]:
                b = BLOCKS[name]
                want = x64 @ dequantize64(b, blocks[name][0], k).T
                for p in [Product(b, blocks[name], m)] + (
                        [Product(b, blocks[name], m, plain=True)] if plain else []):
                    if p.buffer == "CPU" and len(products) and products[-1].block is b \
                            and products[-1].buffer == "CPU":
                        p.close()          # llama.cpp's pick is the plain buffer already
                        continue
                    products.append(p)
                    p.set_x(np.asarray(x))
                    for skipped in p.skipped:
                        out(f"# llama.cpp {b.name} at M = {m}: not in the {skipped} buffer, "
                            "where llama.cpp would put it: its tile kernels fault here "
                            "(TILE_BUFFERS in jaxquant/bench/llamacpp_peer.py)")
                    kind = "same bits" if b.same_bits else "like"
                    timed.append(_Timed(
                        f"llama.cpp {b.name}, {kind} ({p.buffer} buffer)",
                        p.weight_bytes + io, call=p.run,
                        check=lambda p=p, want=want: _relerr(p.outputs()[0], want),
                        start=p.set_threads, stop=p.release_threads))
            del blocks
            for t in counts:
                rows += _interleaved(timed, t, copies=copies, iters=iters,
                                     target_ms=target_ms, mode=label, x=m,
                                     case=f"{m}, {k}, {n} ({t} thread{'s' * (t > 1)})",
                                     family=f"K={k}, N={n}", out=out)
        finally:
            for p in products:
                p.close()
        del qws
    return rows


def print_table(rows, out):
    """One markdown table: per row µs, GB/s and %copy (against a host copy of the same
    bytes on as many threads), and for llama.cpp's rows its time over jaxquant's at the
    same case and format (>= 1: jaxquant is as fast or faster)."""
    out("")
    out(f"| M, K, N | format | impl | µs | GB/s | %copy | {RATIO} | rel.err |")
    out("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if r.us is None:
            out(f"| {r.case} | {r.mode} | {r.impl} | {r.note} | | | | |")
            continue
        ours = next((q for q in rows if q.case == r.case and q.mode == r.mode and q.us
                     and q.impl.startswith(JAXQUANT_IMPL)), None)
        ratio = (f"{r.us / ours.us:.2f}x" if ours is not None and r is not ours else "")
        gbs = r.nbytes / (r.us * 1e-6) / 1e9
        err = "" if r.err is None else f"{r.err:.1e}"
        out(f"| {r.case} | {r.mode} | {r.impl} | {r.us:.1f} | {gbs:.2f} | "
            f"{100 * gbs * 1e9 / r.bw:.0f}% | {ratio} | {err} |")


NOTE = ("# llama.cpp: ggml_mul_mat on a ggml CPU graph (the llama_cpp package's ggml), the "
        "weight in the buffer llama.cpp picks when it loads a model (AMX, CPU_REPACK: a "
        "repacked layout; CPU: ggml's plain vec_dot path); ggml rounds x to 8 bits per 32 "
        "(Q8_0 / Q8_1) before its dot products, hence its larger rel.err. 'same bits': the "
        "ggml blocks hold jaxquant's codes and scales; 'like': ggml quantized the same "
        "float16 weights in its own format of the same size. Both read float32 x.")
