"""The llama.cpp peer of `bench qmm` (jaxquant/bench/llamacpp_peer.py).

Without ggml: the blocks built from jaxquant's bits decode to the float64 oracle's
values of the same QuantizedArray (so "same bits" holds), and bad inputs are refused.
With the llama_cpp package (not installed by CI; those tests skip naming the install):
ggml's product, in the buffer llama.cpp picks and in the plain CPU buffer, on 1 and 2
threads, against the float64 product of the weights decoded here from ggml's block
definitions: exact up to float32 accumulation where x is already an 8-bit grid (ggml's
rounding of x to Q8 blocks changes nothing), within the bound of that rounding
elsewhere; and `bench qmm --peer llamacpp` prints its table.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant.bench import llamacpp_peer as lp
from tests import oracle
from tests.common import deq64, quantize_for, rand

WHY = lp.unavailable()
needs_ggml = pytest.mark.skipif(WHY is not None, reason=f"llama.cpp peer: {WHY}")

SAME_BITS = [name for name, b in lp.BLOCKS.items() if b.same_bits]
MODE_OF = {"Q4_1": ("affine", 4), "MXFP4": ("mxfp4", 4), "IQ4_NL": ("iq4nl", 4)}


def _weights(n, k, seed):
    """float16 weights with what a block must carry: a zero group, a constant group, a
    group of large values, one of tiny ones, and mixed magnitudes across rows."""
    w = np.asarray(rand(seed, (n, k)), np.float32) * np.logspace(-3, 1, n)[:, None]
    w[0, :32] = 0
    w[1, 32:64] = 0.75
    w[2, :32] *= 1000
    w[3, 64:96] *= 1e-3
    return jnp.asarray(w.astype(np.float16))


# An independent decoder of the ggml blocks (ggml-common.h's block structs, ggml-quants.c's
# dequantize_row_*), written here from those definitions: byte j of a block's 4-bit
# payload holds element j (low nibble) and element j + 16 (high nibble).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def decode64(name, raw):
    n = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "IQ4_NL": 18, "MXFP4": 17}[name]
    b = raw.reshape(n, -1, size)

    def f16(i):
        return np.ascontiguousarray(b[..., i:i + 2]).view("<f2").astype(np.float64)

    if name == "Q8_0":
        return (b[..., 2:].view(np.int8) * f16(0)).reshape(n, -1)
    qs = b[..., size - 16:]
    codes = np.concatenate([qs & 15, qs >> 4], -1)
    if name == "Q4_0":
        v = (codes.astype(np.float64) - 8) * f16(0)
    elif name == "Q4_1":
        v = codes * f16(0) + f16(2)
    elif name == "IQ4_NL":
        v = np.asarray(oracle.CODEBOOKS["iq4nl"], np.float64)[codes] * f16(0)
    else:
        e = b[..., 0:1].astype(np.int64)
        v = np.where(e == 255, np.nan, E2M1[codes] * np.ldexp(1.0, e - 127))
    return v.reshape(n, -1)


@pytest.mark.parametrize("name", SAME_BITS)
def test_same_bits_blocks_hold_the_oracle_values(name):
    mode, bits = MODE_OF[name]
    qw = quantize_for(mode, bits, _weights(24, 256, 3), group_size=32)
    blocks = lp.blocks_from_jaxquant(lp.BLOCKS[name], qw)
    assert blocks.dtype == np.uint8
    assert blocks.shape == (24, 8 * {"Q4_1": 20, "MXFP4": 17, "IQ4_NL": 18}[name])
    np.testing.assert_array_equal(decode64(name, blocks), deq64(qw))
    np.testing.assert_array_equal(lp.dequantize64(lp.BLOCKS[name], blocks, 256),
                                  deq64(qw).astype(np.float32))


def test_mxfp4_scale_codes_0_and_255():
    """E8M0 code 0 is 2^-127 (kept, not flushed) and 255 is NaN, in ggml's block as in
    jaxquant's array."""
    qw = quantize_for("mxfp4", 4, _weights(4, 64, 4), group_size=32)
    scales = np.asarray(qw.scales).copy()
    scales[0, 0], scales[1, 1] = 0, 255
    qw = qw.replace(scales=jnp.asarray(scales))
    got = decode64("MXFP4", lp.blocks_from_jaxquant(lp.BLOCKS["MXFP4"], qw))
    np.testing.assert_array_equal(got, deq64(qw))
    assert np.isnan(got[1, 32:64]).all() and np.isfinite(got[0]).all()


def test_bad_inputs_are_refused():
    w = _weights(8, 64, 5)
    q4 = quantize_for("affine", 4, w, group_size=32)
    with pytest.raises(ValueError, match="Q4_0 is not built from jaxquant"):
        lp.blocks_from_jaxquant(lp.BLOCKS["Q4_0"], q4)
    with pytest.raises(ValueError, match="group_size=32"):
        lp.blocks_from_jaxquant(lp.BLOCKS["Q4_1"], quantize_for("affine", 4, w, group_size=64))
    with pytest.raises(ValueError, match="bits=4"):
        lp.blocks_from_jaxquant(lp.BLOCKS["Q4_1"], quantize_for("affine", 8, w, group_size=32))
    with pytest.raises(ValueError, match="mxfp4"):
        lp.blocks_from_jaxquant(lp.BLOCKS["Q4_1"], quantize_for("mxfp4", 4, w))
    with pytest.raises(ValueError, match="2-D"):
        lp.blocks_from_jaxquant(lp.BLOCKS["MXFP4"],
                                quantize_for("mxfp4", 4, w.reshape(2, 4, 64)))
    # bfloat16 scales that float16 does not hold: not the same bits as a Q4_1 block
    big = quantize_for("affine", 4, jnp.asarray(np.asarray(w, np.float32) * 1e6,
                                                jnp.bfloat16), group_size=32)
    with pytest.raises(ValueError, match="float16"):
        lp.blocks_from_jaxquant(lp.BLOCKS["Q4_1"], big)


def test_absent_package_is_one_line(monkeypatch, capsys):
    from jaxquant import bench

    monkeypatch.setattr(lp, "unavailable", lambda: "no llama_cpp here: " + lp.INSTALL)
    with pytest.raises(SystemExit) as e:
        bench.main(["qmm", "--shapes", "1,64,32", "--peer", "llamacpp"], out=lambda *a: None)
    msg = str(e.value.code)
    assert "--peer llamacpp" in msg and "pip install llama-cpp-python" in msg
    assert "\n" not in msg


# ---------------------------------------------------------------------------
# ggml's product.


def _ggml_blocks(name, w, seed):
    b = lp.BLOCKS[name]
    if b.same_bits:
        mode, bits = MODE_OF[name]
        qw = quantize_for(mode, bits, w, group_size=32)
        blocks = lp.blocks_from_jaxquant(b, qw)
        return blocks, deq64(qw)
    blocks = lp.quantize(b, np.asarray(w, np.float32))
    return blocks, decode64(name, blocks)


def _x_on_q8_grid(m, k, seed):
    """Integers in [-60, 60] with one +-127 per block of 32: ggml's Q8 rounding of x (d =
    amax/127 = 1) is exact, and a block's sum stays within float16's integers."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-60, 61, (m, k)).astype(np.float32)
    x[:, ::32] = 127 * rng.choice([-1, 1], (m, k // 32))
    return x


@needs_ggml
@pytest.mark.parametrize("plain", [False, True], ids=["llama.cpp's buffer", "plain CPU"])
@pytest.mark.parametrize("name", list(lp.BLOCKS))
def test_ggml_product_is_the_float64_product(name, plain):
    n, k, copies = 64, 256, 2
    ws = [_ggml_blocks(name, _weights(n, k, 10 + i), i) for i in range(copies)]
    for m in (1, 3, 8):
        with lp.Product(lp.BLOCKS[name], [b for b, _ in ws], m, plain=plain) as p:
            assert p.buffer == "CPU" if plain else p.buffer
            # AMX's tile kernels (M > 1) fault on this project's machine: never used there
            assert m == 1 or p.buffer not in lp.TILE_BUFFERS
            assert set(p.skipped) <= (set() if m == 1 or plain else set(lp.TILE_BUFFERS))
            assert p.weight_bytes == sum(b.nbytes for b, _ in ws[:1])
            for threads in (1, 2):
                p.set_threads(threads)
                # x on the Q8 grid: only float32 accumulation separates ggml from float64
                x = _x_on_q8_grid(m, k, m)
                p.set_x(x)
                p.run()
                for y, (_, w64) in zip(p.outputs(), ws):
                    want = x.astype(np.float64) @ w64.T
                    mag = np.abs(x.astype(np.float64)) @ np.abs(w64).T
                    bound = 4 * (k // 32) * 2.0**-24 * mag + 1e-30
                    assert np.all(np.abs(y - want) <= bound), (
                        name, m, threads, np.max(np.abs(y - want) / bound))
                # random x: ggml's rounding of x to 8 bits per 32, about d/2 an element
                x = np.asarray(rand(20 + m, (m, k)), np.float32)
                p.set_x(x)
                p.run()
                xb = np.abs(x.astype(np.float64)).reshape(m, k // 32, 32)
                d = np.repeat(xb.max(-1) / 127, 32, -1)          # [m, k]
                for y, (_, w64) in zip(p.outputs(), ws):
                    want = x.astype(np.float64) @ w64.T
                    # |x' - x| <= d (1/2 + 127 * 2^-11): the rounding and d in float16;
                    # Q8_1's block sum in float16 feeds Q4_1's m term
                    bound = 0.6 * d @ np.abs(w64).T + 1e-5 * (np.abs(x) @ np.abs(w64).T)
                    if name == "Q4_1":
                        bound += 2.0**-9 * (np.abs(x) @ np.abs(w64).T)
                    assert np.all(np.abs(y - want) <= bound), (
                        name, m, threads, np.max(np.abs(y - want) / bound))
            p.release_threads()


@needs_ggml
def test_ggml_refuses_bad_weights():
    b = lp.BLOCKS["Q4_1"]
    good = np.zeros((32, 4 * 20), np.uint8)
    for bad in ([good, np.zeros((32, 5 * 20), np.uint8)], [np.zeros((32, 4 * 18), np.uint8)],
                [good.view(np.int8)], [np.zeros((32, 0), np.uint8)]):
        with pytest.raises(ValueError, match="Q4_1 blocks"):
            lp.Product(b, bad, 1)
    for bad in ([], [good[0]]):
        with pytest.raises(ValueError, match="at least one"):
            lp.Product(b, bad, 1)
    for m in (0, 1.0, True):
        with pytest.raises(ValueError, match="positive int"):
            lp.Product(b, [good], m)
    with lp.Product(b, [good], 2) as p:
        with pytest.raises(ValueError, match=r"x must be \[2, 128\]"):
            p.set_x(np.zeros((1, 128), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        lp.quantize(lp.BLOCKS["Q8_0"], np.zeros((4, 40), np.float32))


@needs_ggml
def test_bench_qmm_prints_the_peer_table():
    from jaxquant import bench

    lines = []
    assert bench.main(["qmm", "--shapes", "1,256,64", "--modes", "affine4,affine8,mxfp4",
                       "--peers", "ffi", "--peer", "llamacpp", "--iters", "1",
                       "--target-ms", "0.1"], out=lines.append) == 0
    header = next(i for i, l in enumerate(lines) if lp.RATIO in l)
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines[header + 2:]
            if l.startswith("| ")]
    impls = {(r[1], r[2].split(",")[0].split(" (")[0]) for r in rows}
    for fmt, peer in (("affine4 g32", "llama.cpp Q4_1"), ("affine4 g32", "llama.cpp Q4_0"),
                      ("affine8 g32", "llama.cpp Q8_0"), ("mxfp4", "llama.cpp MXFP4")):
        assert (fmt, peer) in impls and (fmt, lp.JAXQUANT_IMPL) in impls, (fmt, peer, impls)
    for r in rows:   # every row timed and checked; the peers' rows carry the ratio
        assert float(r[3]) > 0 and r[5].endswith("%") and float(r[7]) < 2e-2, r
        assert r[6].endswith("x") == r[2].startswith("llama.cpp"), r
    assert any(l.startswith("# llama.cpp: ggml_mul_mat") for l in lines)
