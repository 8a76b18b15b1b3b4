"""Pallas gather_qmm (routed MoE decode) in interpret mode on the CPU, tiny shapes:
against the float64 oracle, bit for bit against the Pallas qmm of the selected
expert (docs/ops.md's invariant), NaN rows for bad ids with in-bounds reads, and
a jitted top-k MoE layer that compiles to one XLA program with no host traffic (on
the CPU, and lowered for CUDA and ROCm with the Pallas kernels); ragged_qmm against
the oracle.

The GPU tests (marked `gpu`, skipped with the reason where JAX sees no GPU), realistic
shapes: the float64 product of the selected experts' `dequantize_reference`, docs/ops.md's
invariant gather_qmm(x, qw, idx)[t, j] == qmm(x[t], qw[idx[t, j]]) bit for bit on the
pallas backend, NaN rows for ids -1 and E, the backward pass (transpose=False kernel), a
jitted top-k MoE layer against the reference backend, and ragged_qmm."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.ops.common import ragged_group_ends, sorted_search
from jaxquant.pallas import configs, moe
from jaxquant.pallas.qmm import qmm
from jaxquant.quantize import dequantize_reference
from tests import oracle
from tests.common import skip_without_gpu

_FAST_COMPILE = {"xla_backend_optimization_level": 0}
TOL = {jnp.float32: 2e-5, jnp.float16: 3e-3, jnp.bfloat16: 1.5e-2}
# N = 40: three interpret-mode row blocks of 16 (the last one masked), so a block
# whose first row is not row 0 exists; K = 320 (or 3 groups): masked group tails.
E, N, T, SLOTS = 5, 40, 3, 2


def _run(fn, *args):
    return jax.jit(fn).trace(*args).lower().compile(compiler_options=_FAST_COMPILE)(*args)


def _k(group):
    return 320 if 320 % group == 0 else 3 * group


def _case(mode, bits, dtype, seed, transpose=True, per_slot=False):
    rng = np.random.default_rng(seed)
    group = jq.FORMATS[mode].group_sizes[0] if mode != "affine" else 64
    k = _k(group)
    shape = (E, N, k) if transpose else (E, k, N - N % group or group)
    w = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    qw = jq.quantize(w, mode=mode, bits=bits if mode == "affine" else None)
    x = jnp.asarray(rng.standard_normal((T, SLOTS, k) if per_slot else (T, k)), dtype)
    idx = jnp.asarray(rng.integers(0, E, (T, SLOTS)), jnp.int32)
    return x, qw, idx


def _deq64(qw):
    arr = lambda a: None if a is None else np.asarray(a)
    return oracle.dequantize(qw.mode, qw.bits, qw.group_size, arr(qw.data), arr(qw.scales),
                             arr(qw.biases), arr(qw.global_scale))


def _qmm_per_slot(x, qw, idx, transpose=True, config=None):
    """[T, k, N]: the Pallas qmm of each (token, slot) on its expert (expert 0 for a bad
    id, which is what the kernel addresses), in one jit: one qmm(x[t], qw[e]) call (M = 1)
    inside a lax.map over the slots, so the interpret-mode kernel is lowered once."""
    idx = np.asarray(idx)
    t, slots = idx.shape
    ids = jnp.asarray(np.where((idx >= 0) & (idx < qw.shape[0]), idx, 0).reshape(-1), jnp.int32)

    def f(x, qw, ids):
        xs = x.reshape(t * slots, -1) if x.ndim == 3 else jnp.repeat(x, slots, axis=0)
        one = lambda a: qmm(a[0], qw[a[1]], transpose=transpose, interpret=True, config=config)
        return jax.lax.map(one, (xs, ids)).reshape(t, slots, -1)
    return _run(f, x, qw, ids)


CASES = [("affine", 4, jnp.bfloat16), ("affine", 4, jnp.float32), ("mxfp4", 4, jnp.bfloat16),
         ("mxfp4", 4, jnp.float16), ("nvfp4", 4, jnp.float32), ("mxfp6_e3m2", 6, jnp.bfloat16),
         ("mxfp8_e4m3", 8, jnp.float16), ("affine", 3, jnp.float32)]


def _id(c):
    return f"{c[0]}{c[1]}-{c[2].__name__}"


# The modes CASES leaves out (every mode of §3 between the two lists).
MORE_CASES = [("affine", 2, jnp.float32), ("affine", 5, jnp.bfloat16), ("affine", 6, jnp.float16),
              ("affine", 8, jnp.bfloat16), ("mxfp6_e2m3", 6, jnp.float32),
              ("mxfp8_e5m2", 8, jnp.bfloat16), ("fp4", 4, jnp.float16),
              ("iq4nl", 4, jnp.bfloat16)]


def test_gather_cases_cover_every_mode():
    from tests.common import MODES
    assert {c[:2] for c in CASES + MORE_CASES} == set(MODES)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_gather_matches_oracle_and_qmm_bitwise(case):
    _check_gather(*case, seed=CASES.index(case), per_slot=CASES.index(case) % 2 == 1)


@pytest.mark.parametrize("case", MORE_CASES, ids=_id)
def test_gather_more_modes(case):
    i = MORE_CASES.index(case)
    _check_gather(*case, seed=100 + i, per_slot=i % 2 == 0)


def _check_gather(mode, bits, dtype, seed, per_slot):
    x, qw, idx = _case(mode, bits, dtype, seed, per_slot=per_slot)
    y = _run(functools.partial(moe.gather_qmm, interpret=True), x, qw, idx)
    assert y.dtype == x.dtype and y.shape == (T, SLOTS, N)
    # float64 oracle
    w64 = _deq64(qw)[np.asarray(idx)]                                      # [T, k, N, K]
    x64 = np.asarray(x, np.float64)
    x64 = x64 if per_slot else np.broadcast_to(x64[:, None], (T, SLOTS, x64.shape[-1]))
    want = np.einsum("tjk,tjnk->tjn", x64, w64)
    got = np.asarray(y, np.float64)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL[dtype]
    # gather(x, qw, idx)[t, j] == qmm(x[t], qw[idx[t, j]]) bit for bit
    np.testing.assert_array_equal(np.asarray(y), np.asarray(_qmm_per_slot(x, qw, idx)))


@pytest.mark.parametrize("case", [("mxfp4", 4, jnp.float32), ("affine", 4, jnp.bfloat16)],
                         ids=_id)
def test_gather_transpose_false(case):
    mode, bits, dtype = case
    x, qw, idx = _case(mode, bits, dtype, 7, transpose=False, per_slot=dtype == jnp.float32)
    y = _run(functools.partial(moe.gather_qmm, transpose=False, interpret=True), x, qw, idx)
    w64 = _deq64(qw)[np.asarray(idx)]                                      # [T, k, K, N]
    x64 = np.asarray(x, np.float64)
    x64 = x64 if x.ndim == 3 else np.broadcast_to(x64[:, None], (T, SLOTS, x64.shape[-1]))
    want = np.einsum("tjk,tjkn->tjn", x64, w64)
    got = np.asarray(y, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL[dtype]
    np.testing.assert_array_equal(np.asarray(y),
                                  np.asarray(_qmm_per_slot(x, qw, idx, transpose=False)))


def test_split_k_config_stays_bitwise():
    x, qw, idx = _case("mxfp4", 4, jnp.float32, 3)
    cfg = configs.TABLE[("interpret", True, "gemv")].replace(split_k=3)
    y = _run(functools.partial(moe.gather_qmm, interpret=True, config=cfg), x, qw, idx)
    np.testing.assert_array_equal(np.asarray(y),
                                  np.asarray(_qmm_per_slot(x, qw, idx, config=cfg)))


def test_nvfp4_one_global_scale_per_expert():
    x, qw, idx = _case("nvfp4", 4, jnp.bfloat16, 4)
    gs = jnp.asarray([0.25, 0.5, 1.0, 2.0, 4.0], jnp.float32) * qw.global_scale
    qw = jq.QuantizedArray(qw.data, qw.scales, None, gs, mode="nvfp4", bits=4, group_size=16,
                           dtype=qw.dtype)
    y = _run(functools.partial(moe.gather_qmm, interpret=True), x, qw, idx)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(_qmm_per_slot(x, qw, idx)))
    want = np.einsum("tk,tjnk->tjn", np.asarray(x, np.float64), _deq64(qw)[np.asarray(idx)])
    got = np.asarray(y, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL[jnp.bfloat16]


def test_bad_ids_nan_rows_and_in_bounds_reads():
    """Ids -1, E, E+9 and -2**31: NaN rows, the other rows untouched. The kernel
    addresses expert e's rows as e*N + n in an [E*N, ...] view, so a missing guard
    would shift the row blocks that do not start at row 0 (interpret mode clamps
    or pads an out-of-range window): the raw kernel rows of bad ids must equal the
    qmm of expert 0 (what the guard addresses), block by block, bit for bit."""
    x, qw, _ = _case("mxfp4", 4, jnp.float32, 5)
    idx = jnp.asarray([[-1, 2], [E, 0], [E + 9, -2**31]], jnp.int32)
    y = np.asarray(_run(functools.partial(moe.gather_qmm, interpret=True), x, qw, idx))
    bad = ~((np.asarray(idx) >= 0) & (np.asarray(idx) < E))
    assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))
    per_slot = np.asarray(_qmm_per_slot(x, qw, idx))     # bad ids -> expert 0
    np.testing.assert_array_equal(y[~bad], per_slot[~bad])
    raw = _run(lambda x, qw, ids: moe.gather_raw(x, qw, ids, interpret=True), x, qw,
               moe._slot_ids(idx, E))
    np.testing.assert_array_equal(np.asarray(raw).reshape(T, SLOTS, N), per_slot)


def test_ids_of_any_integer_dtype_do_not_wrap():
    # Ids are clipped to [-1, E] before the int32 cast: a huge id stays bad.
    ids = moe._slot_ids(jnp.asarray([[2**31 - 1, -2**31]], jnp.int32), E)
    assert list(np.asarray(ids)) == [E, -1]
    ids = moe._slot_ids(jnp.asarray([[0, 4, 255]], jnp.uint8), E)
    assert list(np.asarray(ids)) == [0, 4, E]


def test_supports_and_registration():
    x, qw, idx = _case("mxfp4", 4, jnp.float32, 0)
    sd = jax.ShapeDtypeStruct
    assert moe.supports_gather(x, qw, idx, transpose=True, platform="cuda")
    assert moe.supports_gather(sd((T, SLOTS, x.shape[1]), x.dtype), qw, idx, transpose=True)
    assert not moe.supports_gather(sd(x.shape, jnp.float64), qw, idx, transpose=True)
    assert not moe.supports_gather(x, qw[0], idx, transpose=True)
    assert not moe.supports_gather(sd((T, 64), x.dtype), qw, idx, transpose=True)
    assert not moe.supports_gather(sd((70000, x.shape[1]), x.dtype), qw,
                                   sd((70000, 1), jnp.int32), transpose=True)
    from jaxquant import dispatch
    import jaxquant.pallas  # noqa: F401 - registers the kernels
    kernels = [k for k in dispatch._KERNELS.get("gather_qmm", ()) if k.backend == "pallas"]
    assert sorted(p for k in kernels for p in k.platforms) == ["cuda", "rocm"]


# ---------------------------------------------------------------------------
# A jitted top-k MoE layer is one XLA program: no host callbacks or transfers.

_HOST_TARGET = re.compile(r"callback|host|py_func|send|recv|infeed|outfeed", re.I)
_HOST_OPS = re.compile(r"=\s*[^=\n]*?\b(send|recv|send-done|recv-done|infeed|outfeed)\(")


def _host_traffic(hlo_text):
    targets = re.findall(r'custom_call_target="([^"]*)"', hlo_text)
    return [t for t in targets if _HOST_TARGET.search(t)] + _HOST_OPS.findall(hlo_text)


def moe_layer(x, router, q_gate, q_up, q_down, top_k):
    logits = (x @ router).astype(jnp.float32)
    weights, idx = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(weights, axis=-1).astype(x.dtype)
    a = jax.nn.silu(jq.gather_qmm(x, q_gate, idx)) * jq.gather_qmm(x, q_up, idx)
    y = jq.gather_qmm(a, q_down, idx)                       # x per slot
    return jnp.einsum("tk,tkn->tn", weights, y)


@pytest.mark.parametrize("backend", ["reference", None], ids=["reference", "auto"])
def test_moe_layer_is_one_program_without_host_sync(backend):
    e, d, f, t, top_k = 8, 64, 96, 4, 2
    key = jax.random.split(jax.random.key(0), 5)
    router = jax.random.normal(key[0], (d, e), jnp.float32)
    qs = [jq.quantize(0.1 * jax.random.normal(key[i + 1], s, jnp.float32), mode="mxfp4")
          for i, s in enumerate([(e, f, d), (e, f, d), (e, d, f)])]
    x = jax.random.normal(key[4], (t, d), jnp.float32)
    fn = jax.jit(moe_layer, static_argnums=5)
    with jq.backend(backend):
        compiled = fn.lower(x, router, *qs, top_k).compile()
        out = compiled(x, router, *qs)
    text = compiled.as_text()
    assert text.count("HloModule") == 1
    assert _host_traffic(text) == [], _host_traffic(text)
    assert np.all(np.isfinite(np.asarray(out)))
    # The detector is not vacuous: a host callback is seen.
    cb = jax.jit(lambda v: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(v.shape, v.dtype), v))
    assert _host_traffic(cb.lower(x).compile().as_text())


# The same layer lowered for the GPUs with the Pallas kernels (on this CPU-only
# machine: lowering_platforms, as tests/pallas_compile.py does): its StableHLO
# holds XLA ops and the three gather_qmm Triton kernels (jaxlib 0.10.2 emits each as a
# `__gpu$xla.gpu.triton` custom call), and nothing that moves data to or from the host.

_GPU_TRITON = "__gpu$xla.gpu.triton"
_HOST_OPS_MLIR = {"stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed"}


def _gpu_program_report(module):
    """(op names, custom-call targets, Triton kernels launched from main (through the
    calls), host-memory annotations) of a lowered StableHLO module."""
    from jax._src.lib.mlir import ir

    from tests import pallas_compile as cc

    funcs, names, targets = {}, set(), []

    def walk(op, visit):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    visit(child)
                    walk(child, visit)

    def collect(op):
        kind = op.operation.name        # (an OpView's .name can be its symbol)
        names.add(kind)
        if kind == "func.func":
            funcs[ir.StringAttr(op.attributes["sym_name"]).value] = op
        elif kind == "stablehlo.custom_call":
            targets.append(ir.StringAttr(op.attributes["call_target_name"]).value)

    walk(module.operation, collect)
    launched = []

    def launches(op):
        kind = op.operation.name
        if kind == "func.call":
            walk(funcs[ir.FlatSymbolRefAttr(op.attributes["callee"]).value], launches)
        elif (kind == "stablehlo.custom_call"
              and ir.StringAttr(op.attributes["call_target_name"]).value == _GPU_TRITON):
            launched.append(cc._from_custom_call(op).name)

    walk(funcs["main"], launches)
    text = str(module)
    host = re.findall(r'memory_kind = "[^"]*host[^"]*"|_xla_buffer_placement = "[^"]*host', text)
    return names, targets, launched, host


def _assert_device_only(names, targets, host):
    bad = sorted(n for n in names if n in _HOST_OPS_MLIR or not (
        n.startswith(("stablehlo.", "chlo.", "sdy.")) or n in ("func.func", "func.call",
                                                               "func.return")))
    assert bad == [], bad
    assert set(targets) <= {_GPU_TRITON}, sorted(set(targets))
    assert host == [], host


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_moe_layer_pallas_gpu_lowering_has_no_host_traffic(platform, monkeypatch):
    import jaxquant.pallas  # noqa: F401 - registers the Pallas lowerings
    from jaxquant import dispatch

    # The Pallas backend reports itself unavailable without a local GPU; lowering for a
    # GPU platform needs none.
    monkeypatch.setitem(dispatch._AVAILABILITY, "pallas", lambda: None)
    e, d, f, t, top_k = 8, 64, 96, 4, 2
    S = jax.ShapeDtypeStruct
    qs = [jax.eval_shape(lambda w: jq.quantize(w, mode="mxfp4"), S(s, jnp.bfloat16))
          for s in [(e, f, d), (e, f, d), (e, d, f)]]
    args = (S((t, d), jnp.bfloat16), S((d, e), jnp.bfloat16), *qs)
    with jq.backend("pallas"):
        try:
            lowered = jax.jit(moe_layer, static_argnums=5).trace(*args, top_k).lower(
                lowering_platforms=(platform,))
        except Exception as err:  # noqa: BLE001
            import jaxlib
            if tuple(int(v) for v in jaxlib.__version__.split(".")[:3]) <= (0, 10, 2):
                raise
            pytest.skip(f"jaxlib {jaxlib.__version__} compiles Triton kernels while lowering, "
                        f"which needs a GPU here ({type(err).__name__})")
    module = lowered.compiler_ir("stablehlo")
    names, targets, launched, host = _gpu_program_report(module)
    _assert_device_only(names, targets, host)
    # One program: one public entry; the router's top_k is in it, on the device.
    publics = [l for l in str(module).splitlines() if "func.func public" in l]
    assert len(publics) == 1, publics
    assert any("top_k" in n for n in names), sorted(names)
    # gate, up and down: three Triton launches of the gather kernel, no other kernel.
    assert len(launched) == 3, launched
    assert all(n == "kernel" or "gather" in n for n in launched), launched
    # The detector is not vacuous: a transfer to host memory is seen on this platform...
    to_host = jax.jit(lambda v: jax.device_put(v, jax.memory.Space.Host)).trace(args[0]).lower(
        lowering_platforms=(platform,))
    _, targets, _, host = _gpu_program_report(to_host.compiler_ir("stablehlo"))
    assert host and set(targets) - {_GPU_TRITON}
    # ...and so is a host callback (lowered for the CPU: a GPU callback's lowering needs a GPU).
    cb = jax.jit(lambda v: jax.pure_callback(np.sin, S(v.shape, v.dtype), v)).trace(
        S((4,), jnp.float32)).lower(lowering_platforms=("cpu",))
    names, targets, _, host = _gpu_program_report(cb.compiler_ir("stablehlo"))
    with pytest.raises(AssertionError):
        _assert_device_only(names, targets, host)


# ---------------------------------------------------------------------------
# ragged_qmm (prefill): qmm's GEMM over a tile schedule computed on the device.


_schedule = jax.jit(moe.ragged_schedule, static_argnums=(1, 2))


def test_ragged_schedule_covers_each_row_once():
    rng = np.random.default_rng(0)
    for rows, bm, e in ((50, 16, 4), (300, 32, 7), (16, 16, 3)):
        for _ in range(5):
            sizes = rng.integers(0, 2 * rows // e + 2, e)
            sizes[rng.integers(0, e)] = 0
            sched = np.asarray(_schedule(jnp.asarray(sizes, jnp.int32), rows, bm))
            assert sched.shape == (4, -(-rows // bm) + e - 1)
            ends = np.minimum(np.cumsum(sizes), rows)
            owner = np.full(rows, -1)
            for ex, m0, lo, hi in sched.T:
                assert m0 % bm == 0 and m0 <= lo <= hi <= m0 + bm
                if hi > lo:
                    assert np.all(owner[lo:hi] == -1)
                    owner[lo:hi] = ex
            want = np.searchsorted(ends, np.arange(rows), side="right")
            want = np.where(np.arange(rows) < ends[-1], want, -1)
            np.testing.assert_array_equal(owner, want)


def test_ragged_maps_run_without_a_loop():
    """The row-to-expert maps of ragged_qmm (the Pallas GEMM's schedule, the cuda_mma
    GEMV's slot ids) lower without a while loop: on a GPU each trip of one waits for the
    host (jnp.searchsorted's default method)."""
    sizes = jnp.asarray([3, 0, 9, 4], jnp.int32)
    for f in (lambda g: _schedule(g, 50, 16),
              lambda g: sorted_search(ragged_group_ends(g, 20), jnp.arange(20))):
        text = jax.jit(f).lower(sizes).as_text()
        assert "while" not in text
    ends = np.asarray(ragged_group_ends(sizes, 20))
    np.testing.assert_array_equal(sorted_search(jnp.asarray(ends), jnp.arange(20)),
                                  np.searchsorted(ends, np.arange(20), side="right"))


RAGGED = [("mxfp4", 4, jnp.bfloat16, 50, [7, 0, 30, 9]),        # skinny tiles, rows past sum
          ("affine", 4, jnp.float32, 200, [0, 110, 90]),          # large tiles, f32 (permuted x)
          ("mxfp4", 4, jnp.bfloat16, 140, [60, 75]),              # large tiles, interleaved
          ("nvfp4", 4, jnp.float16, 40, [25, 0, 30]),             # sum > T: truncated
          ("mxfp6_e3m2", 6, jnp.bfloat16, 60, [20, 15, 25]),
          ("mxfp8_e4m3", 8, jnp.float32, 48, [0, 30, 10, 8]),
          ("affine", 8, jnp.float16, 200, [100, 0, 100]),        # large tiles
          ("fp4", 4, jnp.bfloat16, 30, [10, 25])]                 # sum > T: truncated


@pytest.mark.parametrize("case", RAGGED, ids=lambda c: f"{c[0]}{c[1]}-{c[2].__name__}-T{c[3]}")
def test_ragged_qmm_vs_oracle(case):
    mode, bits, dtype, t, sizes = case
    rng = np.random.default_rng(t)
    e = len(sizes)
    group = 64 if mode == "affine" else jq.FORMATS[mode].group_sizes[0]
    k = _k(group)
    w = jnp.asarray(rng.standard_normal((e, N, k)), jnp.float32).astype(dtype)
    qw = jq.quantize(w, mode=mode, bits=bits if mode == "affine" else None)
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    cfg = moe._ragged_config("interpret", t, N, k, qw, x.dtype)
    assert cfg.block_m >= 32 if t > 64 * e else cfg.swap_ab          # the tile class meant
    y = _run(lambda x, qw, gs: moe.ragged_qmm(x, qw, gs, interpret=True), x, qw, gs)
    assert y.dtype == x.dtype and y.shape == (t, N)
    ends = np.minimum(np.cumsum(sizes), t)
    owner = np.searchsorted(ends, np.arange(t), side="right")
    live = np.arange(t) < ends[-1]
    w64 = _deq64(qw)[np.minimum(owner, e - 1)]                          # [T, N, K]
    want = np.where(live[:, None], np.einsum("tk,tnk->tn", np.asarray(x, np.float64), w64), 0)
    got = np.asarray(y, np.float64)
    assert np.all(got[~live] == 0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL[dtype]


# ---------------------------------------------------------------------------
# On a GPU: the compiled kernels at the models' shapes.

needs_gpu = skip_without_gpu("the Pallas MoE GPU tests (the tests above run the kernels "
                             "in interpret mode)")

GPU_TOL = {jnp.float32: 2e-3, jnp.float16: 4e-3, jnp.bfloat16: 1.5e-2}
# (name, E, top_k, K, N, T, mode kwargs, dtype)
GPU_CASES = [
    ("gptoss-decode1", 32, 4, 2880, 5760, 1, dict(mode="mxfp4"), jnp.bfloat16),
    ("gptoss-decode8", 32, 4, 2880, 5760, 8, dict(mode="mxfp4"), jnp.bfloat16),
    ("qwen3-gateup", 128, 8, 2048, 1536, 8, dict(mode="affine", bits=4, group_size=64),
     jnp.bfloat16),
    ("qwen3-down", 128, 8, 768, 2048, 4, dict(mode="nvfp4"), jnp.float16),
    ("mxfp6-f32", 16, 2, 1024, 1000, 3, dict(mode="mxfp6_e3m2"), jnp.float32),
]


def _gpu_case(e, top_k, k, n, t, qkw, dtype, seed=0, per_slot=False):
    kw, kx, ki = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(kw, (e, n, k), jnp.float32).astype(dtype)
    qw = jq.quantize(w, **qkw, layout="canonical")  # the Pallas kernels' layout
    x = jax.random.normal(kx, (t, top_k, k) if per_slot else (t, k), jnp.float32).astype(dtype)
    idx = jax.random.randint(ki, (t, top_k), 0, e, jnp.int32)
    return x, qw, idx


@jax.jit
def _exact(x, qw, idx):
    """float32 product with IEEE float32 dots (precision HIGHEST) of the selected experts'
    dequantize_reference: within ~1e-6 of the float64 product, far below the tolerances."""
    flat = idx.reshape(-1)
    w = dequantize_reference(qw[flat], jnp.float32)                     # [T*k, N, K]
    xs = x.astype(jnp.float32)
    xs = xs.reshape(flat.shape[0], -1) if x.ndim == 3 else jnp.repeat(xs, idx.shape[1], 0)
    y = jnp.einsum("sk,snk->sn", xs, w, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(*idx.shape, -1)


def _oracle(x, qw, idx):
    return np.asarray(_exact(x, qw, idx), np.float64)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_gather_vs_oracle_and_qmm_bitwise(case):
    name, e, top_k, k, n, t, qkw, dtype = case
    per_slot = name.endswith("down")
    x, qw, idx = _gpu_case(e, top_k, k, n, t, qkw, dtype, per_slot=per_slot)
    y = jax.jit(lambda x, qw, i: jq.gather_qmm(x, qw, i, backend="pallas"))(x, qw, idx)
    assert y.dtype == x.dtype and y.shape == (t, top_k, n)
    want = _oracle(x, qw, idx)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < GPU_TOL[dtype]
    # docs/ops.md: bit for bit the pallas qmm of the selected expert.
    ids = np.asarray(idx)
    one = jax.jit(lambda xv, q: jq.qmm(xv, q, backend="pallas"))
    for ti in range(t):
        for j in range(top_k):
            xv = x[ti, j] if per_slot else x[ti]
            np.testing.assert_array_equal(np.asarray(y[ti, j]),
                                          np.asarray(one(xv, qw[int(ids[ti, j])])))


@pytest.mark.gpu
@needs_gpu
def test_bad_ids_are_nan_rows():
    x, qw, _ = _gpu_case(32, 4, 2880, 5760, 2, dict(mode="mxfp4"), jnp.bfloat16)
    idx = jnp.asarray([[-1, 3, 32, 31], [0, 2**31 - 1, -2**31, 5]], jnp.int32)
    y = np.asarray(jax.jit(lambda x, qw, i: moe.gather_qmm(x, qw, i))(x, qw, idx)
                   .astype(jnp.float32))
    bad = ~((np.asarray(idx) >= 0) & (np.asarray(idx) < 32))
    assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))


@pytest.mark.gpu
@needs_gpu
def test_grad_vmap_and_transpose_false():
    x, qw, idx = _gpu_case(32, 4, 2048, 768, 4, dict(mode="mxfp4"), jnp.float32)
    f = lambda b: lambda x: jq.gather_qmm(x, qw, idx, backend=b).sum()
    g = jax.jit(jax.grad(f("pallas")))(x)
    g_ref = jax.jit(jax.grad(f("reference")))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=2e-3, atol=2e-3)
    xs = jnp.stack([x, -x])
    y = jax.jit(jax.vmap(lambda x: jq.gather_qmm(x, qw, idx, backend="pallas")))(xs)
    y0 = jax.jit(lambda x: jq.gather_qmm(x, qw, idx, backend="pallas"))(x)
    np.testing.assert_array_equal(np.asarray(y[0]), np.asarray(y0))


@pytest.mark.gpu
@needs_gpu
def test_moe_layer_pallas_vs_reference():
    e, d, f, t, top_k = 32, 2880, 5760, 8, 4
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    router = jax.random.normal(ks[0], (d, e), jnp.float32).astype(jnp.bfloat16) * 0.02
    canonical = dict(mode="mxfp4", layout="canonical")  # the Pallas kernels' layout
    qg, qu = (jq.quantize(jax.random.normal(k, (e, f, d), jnp.bfloat16) * 0.02, **canonical)
              for k in ks[1:3])
    qd = jq.quantize(jax.random.normal(ks[3], (e, d, f), jnp.bfloat16) * 0.02, **canonical)
    x = jax.random.normal(ks[4], (t, d), jnp.bfloat16)

    def layer(x, router, qg, qu, qd, backend):
        w, idx = jax.lax.top_k((x @ router).astype(jnp.float32), top_k)
        w = jax.nn.softmax(w, axis=-1).astype(x.dtype)
        a = (jax.nn.silu(jq.gather_qmm(x, qg, idx, backend=backend))
             * jq.gather_qmm(x, qu, idx, backend=backend))
        return jnp.einsum("tk,tkn->tn", w, jq.gather_qmm(a, qd, idx, backend=backend))

    run = jax.jit(layer, static_argnums=5)
    y = np.asarray(run(x, router, qg, qu, qd, "pallas").astype(jnp.float32))
    r = np.asarray(run(x, router, qg, qu, qd, "reference").astype(jnp.float32))
    assert np.linalg.norm(y - r) / np.linalg.norm(r) < 2e-2


# ---------------------------------------------------------------------------
# ragged_qmm (prefill): rows sorted by expert, group sizes on the device.

GPU_RAGGED = [("gptoss-prefill", 32, 2880, 5760, 4096, dict(mode="mxfp4"),  # big tiles
               jnp.bfloat16),
              ("qwen3-prefill", 128, 2048, 768, 4096, dict(mode="affine", bits=4, group_size=64),
               jnp.bfloat16),
              ("nvfp4-f32", 8, 1024, 1000, 300, dict(mode="nvfp4"), jnp.float32)]


@jax.jit
def _ragged_exact(x, qw, sizes):
    w = jnp.swapaxes(dequantize_reference(qw, jnp.float32), 1, 2)
    return jax.lax.ragged_dot(x.astype(jnp.float32), w, sizes,
                              precision=jax.lax.Precision.HIGHEST)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_RAGGED, ids=lambda c: c[0])
def test_ragged_vs_exact(case):
    name, e, k, n, rows, qkw, dtype = case
    kw, kx, ks = jax.random.split(jax.random.PRNGKey(2), 3)
    qw = jq.quantize(jax.random.normal(kw, (e, n, k), jnp.float32).astype(dtype), **qkw,
                     layout="canonical")
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(dtype)
    # Uneven groups, some empty, the last rows in no group (they must come out zero).
    p = jax.random.dirichlet(ks, jnp.full((e,), 0.3))
    sizes = np.floor(np.asarray(p) * (rows - 37)).astype(np.int32)
    sizes[1] = 0
    sizes = jnp.asarray(sizes)
    y = jax.jit(lambda x, qw, g: jq.ragged_qmm(x, qw, g, backend="pallas"))(x, qw, sizes)
    assert y.dtype == x.dtype and y.shape == (rows, n)
    got = np.asarray(y.astype(jnp.float32), np.float64)
    want = np.asarray(_ragged_exact(x, qw, sizes), np.float64)
    total = int(np.sum(np.asarray(sizes)))
    assert np.all(got[total:] == 0) and np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < GPU_TOL[dtype]
