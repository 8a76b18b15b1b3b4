"""The sharded cases of tests/test_sharding.py, run in a subprocess with 8 host
devices (the device count is fixed when JAX starts). Prints one JSON object:
per case, the max |sharded - unsharded| error, the collectives in the compiled
HLO, and the warnings raised. Run: python -m tests.sharding_cases
(JAXQUANT_SHARDING_CASES=ops: the ops' cases alone, not the models')"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxquant as jq  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")
MESH = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tp"))


def rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def put(a, spec):
    return jax.device_put(a, NamedSharding(MESH, spec))


def put_q(qw, data_spec, scales_spec=None):
    """qw with data (and scales, biases) placed on the mesh."""
    scales_spec = data_spec if scales_spec is None else scales_spec
    gs = qw.global_scale
    return jq.QuantizedArray(put(qw.data, data_spec), put(qw.scales, scales_spec),
                             None if qw.biases is None else put(qw.biases, scales_spec),
                             None if gs is None else put(gs, P()), mode=qw.mode, bits=qw.bits,
                             group_size=qw.group_size, dtype=qw.dtype, layout=qw.layout)


def collectives(text):
    """The collectives in a compiled program's text, and the jaxquant FFI targets."""
    found = {}
    for name in COLLECTIVES:
        # instructions, e.g. "%all-reduce.3 = f32[8,64] all-reduce(...)"; starts count too
        found[name] = len(re.findall(rf"= [^=]*? {name}(?:-start)?\(", text))
    ffi = sorted(set(re.findall(r'custom_call_target="(jaxquant[^"]*)"', text)))
    return found, ffi


def err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    same_nan = bool(np.array_equal(np.isnan(a), np.isnan(b)))
    d = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    return float(np.max(d)) if same_nan else float("inf")


def case(fn, args, sharded_args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = jax.jit(fn)(*args)
        # compiled once, run and read (the program is the tests' largest cost)
        compiled = jax.jit(fn).lower(*sharded_args).compile()
        got = compiled(*sharded_args)
        found, ffi = collectives(compiled.as_text())
    leaves_w, leaves_g = jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)
    return {"err": max(err(w, g) for w, g in zip(leaves_w, leaves_g)),
            "scale": max(float(jnp.max(jnp.abs(jnp.nan_to_num(w)))) for w in leaves_w),
            "collectives": found, "ffi": ffi,
            "out_spec": [str(getattr(g.sharding, "spec", None)) for g in leaves_g],
            "warnings": [str(w.message) for w in caught if "jaxquant" in str(w.message)]}


def main():
    out = {}
    n, k = 256, 512
    x = rand(1, (8, k))
    for mode, bits in (("affine", 4), ("mxfp4", 4), ("nvfp4", 4)):
        qw = jq.quantize(rand(0, (n, k)), mode=mode, bits=bits)
        # column-parallel: qw on N; x's rows on the data axis
        out[f"qmm_col_{mode}"] = case(jq.qmm, (x, qw), (put(x, P("data")),
                                                        put_q(qw, P("tp", None))))
        # row-parallel: qw and x on K
        out[f"qmm_row_{mode}"] = case(jq.qmm, (x, qw), (put(x, P("data", "tp")),
                                                        put_q(qw, P(None, "tp"))))
    # the GPUs' kernel layouts (data: built and sharded on any device): N splits on
    # whole row tiles as prepacked; K splits in the split layout (K blocks, each
    # prepacked), whose device blocks are the base layout the kernels read
    for mode, layout, kl in (("affine", "cuda_mma", k), ("mxfp4", "cuda_mma", k),
                             ("nvfp4", "cuda_mma", k), ("mxfp4", "cdna4", 4 * k)):
        xl = rand(1, (8, kl))
        qc = jq.quantize(rand(0, (n, kl)), mode=mode, bits=4)
        qp = jq.prepack(qc, layout)
        out[f"qmm_col_{layout}_{mode}"] = case(jq.qmm, (xl, qp), (put(xl, P("data")),
                                                                  put_q(qp, P("tp", None))))
        qk = jq.prepack(qc, jq.layouts.split_layout(layout, 4))
        out[f"qmm_row_{layout}_{mode}"] = case(jq.qmm, (xl, qp), (put(xl, P("data", "tp")),
                                                                  put_q(qk, P(None, "tp"))))
    # a kernel layout K-split as prepacked whole: its blocks are not the layout's
    # blocks, so K is gathered (a warning names the split layout to place it in)
    qp = jq.prepack(jq.quantize(rand(0, (n, k)), mode="affine", bits=4), "cuda_mma")
    out["qmm_row_cuda_mma_unsplit_gathered"] = case(
        jq.qmm, (x, qp), (put(x, P("data", "tp")), put_q(qp, P(None, "tp"))))
    qw = jq.quantize(rand(0, (n, k)), mode="affine", bits=4)
    # batched activations [B, S, K] on the data axis, weights column-parallel
    xb = rand(2, (4, 3, k))
    out["qmm_batch_col"] = case(jq.qmm, (xb, qw), (put(xb, P("data")), put_q(qw, P("tp", None))))
    # K split inside a group: K=96 has 3 groups of 32, split 4 ways -> gathered, with a warning
    q96 = jq.quantize(rand(3, (64, 96)), mode="mxfp4")
    x96 = rand(4, (8, 96))
    out["qmm_row_misaligned"] = case(jq.qmm, (x96, q96), (put(x96, P(None, "tp")),
                                                          put_q(q96, P(None, "tp"), P())))
    # one quantization group along K (a size-1 factor Shardy must not see in a compound)
    q64 = jq.quantize(rand(12, (64, 64)), mode="affine", bits=4, group_size=64)
    x64 = rand(13, (8, 64))
    out["qmm_col_one_group"] = case(jq.qmm, (x64, q64), (put(x64, P()), put_q(q64, P("tp", None))))
    # the x-gradient (qmm with transpose=False per shard) of a column-parallel layer
    loss = lambda x, qw: jnp.sum(jq.qmm(x, qw) ** 2)
    out["qmm_col_grad"] = case(jax.grad(loss), (x, qw), (put(x, P("data")),
                                                         put_q(qw, P("tp", None))))
    # the ffi GEMV kernel is kept per shard (CPU): M=8 rows, column-parallel
    if "ffi" in jq.available_backends():
        f = lambda x, qw: jq.qmm(x, qw, backend="ffi")
        out["qmm_col_ffi"] = case(f, (x, qw), (put(x, P()), put_q(qw, P("tp", None))))

    # expert parallel: 8 experts over tp (4), tokens on data
    e, t, slots, n_e, k_e = 8, 8, 2, 64, 128
    qe = jq.quantize(rand(5, (e, n_e, k_e)), mode="mxfp4")
    xt = rand(6, (t, k_e))
    idx = jax.random.randint(jax.random.key(7), (t, slots), 0, e).at[3, 1].set(e)  # one bad
    out["gather_ep"] = case(jq.gather_qmm, (xt, qe, idx),
                            (put(xt, P("data")), put_q(qe, P("tp")), put(idx, P("data"))))
    # the same in the kernel layouts: experts on tp; within them N, or K (split layout)
    qe_mma = jq.prepack(qe, "cuda_mma")
    out["gather_ep_cuda_mma"] = case(jq.gather_qmm, (xt, qe_mma, idx),
                                     (put(xt, P("data")), put_q(qe_mma, P("tp")),
                                      put(idx, P("data"))))
    qe_k2 = jq.prepack(qe, "cuda_mma/k2")
    out["gather_ep_row_cuda_mma"] = case(jq.gather_qmm, (xt, qe_mma, idx),
                                         (put(xt, P(None, "data")),
                                          put_q(qe_k2, P("tp", None, "data")), put(idx, P())))
    # expert parallel and row-parallel within each expert (experts on tp, K on data)
    out["gather_ep_row"] = case(jq.gather_qmm, (xt, qe, idx),
                                (put(xt, P(None, "data")), put_q(qe, P("tp", None, "data")),
                                 put(idx, P())))
    # gather_qmm_swiglu: tokens split; experts do not (the activation follows the
    # whole sum): tp-sharded experts are gathered, with a warning
    be = rand(8, (e, n_e))
    gsw = lambda x, q, i, b: jq.gather_qmm_swiglu(x, q, i, bias=b, activation="gpt_oss",
                                                  limit=7.0)
    out["gather_qmm_swiglu_tokens"] = case(gsw, (xt, qe, idx, be),
                                           (put(xt, P("data")), put_q(qe, P()),
                                            put(idx, P("data")), put(be, P())))
    out["gather_qmm_swiglu_ep_gathered"] = case(gsw, (xt, qe, idx, be),
                                                (put(xt, P("data")), put_q(qe, P("tp")),
                                                 put(idx, P("data")), put(be, P("tp"))))
    # float experts (gather_matmul): expert parallel (one all-reduce), and split on N
    we = rand(5, (e, n_e, k_e))
    out["gather_matmul_ep"] = case(jq.gather_matmul, (xt, we, idx),
                                   (put(xt, P("data")), put(we, P("tp")), put(idx, P("data"))))
    out["gather_matmul_col"] = case(jq.gather_matmul, (xt, we, idx),
                                    (put(xt, P("data")), put(we, P(None, "tp")),
                                     put(idx, P("data"))))
    sizes = jnp.array([3, 0, 5, 1, 0, 2, 4, 1], jnp.int32)  # 16 rows of 20 used
    xr = rand(8, (20, k_e))
    out["ragged_ep"] = case(jq.ragged_qmm, (xr, qe, sizes),
                            (put(xr, P()), put_q(qe, P("tp")), put(sizes, P())))
    out["ragged_ep_col_cuda_mma"] = case(jq.ragged_qmm, (xr, qe_mma, sizes),
                                         (put(xr, P()), put_q(qe_mma, P("tp", "data")),
                                          put(sizes, P())))
    out["ragged_ep_col"] = case(jq.ragged_qmm, (xr, qe, sizes),
                                (put(xr, P()), put_q(qe, P("tp", "data")), put(sizes, P())))
    # traced sizes with a negative one and a sum past T (30 of 20): 0, cut at T, no wrap
    bad = jnp.array([5, -1, 4, 2, 6, 0, 6, 7], jnp.int32)
    out["ragged_ep_bad_sizes"] = case(jq.ragged_qmm, (xr, qe, bad),
                                      (put(xr, P()), put_q(qe, P("tp")), put(bad, P())))

    # float experts (ragged_matmul): expert parallel (one all-reduce), and split on N
    out["ragged_matmul_ep"] = case(jq.ragged_matmul, (xr, we, bad),
                                   (put(xr, P()), put(we, P("tp")), put(bad, P())))
    out["ragged_matmul_col"] = case(jq.ragged_matmul, (xr, we, sizes),
                                    (put(xr, P()), put(we, P(None, "tp")), put(sizes, P())))

    # norms on rows
    h = rand(9, (16, 256))
    r = rand(10, (16, 256))
    wn = rand(11, (256,))
    out["rms_norm_rows"] = case(jq.rms_norm, (h, wn), (put(h, P(("data", "tp"))), put(wn, P())))
    out["add_rms_norm_rows"] = case(jq.add_rms_norm, (h, r, wn),
                                    (put(h, P("data")), put(r, P("data")), put(wn, P())))
    out["gated_rms_norm_rows"] = case(jq.gated_rms_norm, (h, r, wn),
                                      (put(h, P("data")), put(r, P("data")), put(wn, P())))
    out["dequantize_col"] = case(jq.dequantize, (qw,), (put_q(qw, P("tp", None)),))

    # fused decode ops: rms_norm_qmm column-parallel; qmm_swiglu on rows (its N, gate
    # rows then up rows, does not split: a tp-sharded qw is gathered, with a warning)
    wk = rand(14, (k,))
    out["rms_norm_qmm_col"] = case(lambda x, w, q: jq.rms_norm_qmm(x, w, q), (x, wk, qw),
                                   (put(x, P("data")), put(wk, P()), put_q(qw, P("tp", None))))
    glu = lambda x, q: jq.qmm_swiglu(x, q, activation="gpt_oss", limit=7.0)
    out["qmm_swiglu_rows"] = case(glu, (x, qw), (put(x, P(("data", "tp"))), put_q(qw, P())))
    out["qmm_swiglu_col_gathered"] = case(glu, (x, qw), (put(x, P("data")),
                                                         put_q(qw, P("tp", None))))
    # rms_norm_qmm_swiglu: rows only, as qmm_swiglu; qmm_add: column-parallel with its
    # addend split as the output, and its K does not split (a row-parallel qw is
    # gathered, with a warning: each shard would add the addend to a partial sum)
    nglu = lambda x, w, q: jq.rms_norm_qmm_swiglu(x, w, q, activation="gpt_oss", limit=7.0)
    out["rms_norm_qmm_swiglu_rows"] = case(nglu, (x, wk, qw), (put(x, P(("data", "tp"))),
                                                               put(wk, P()), put_q(qw, P())))
    ra = rand(15, (x.shape[0], qw.shape[0]))
    out["qmm_add_col"] = case(jq.qmm_add, (x, qw, ra), (put(x, P("data")),
                                                        put_q(qw, P("tp", None)),
                                                        put(ra, P("data", "tp"))))
    out["qmm_add_row_gathered"] = case(jq.qmm_add, (x, qw, ra),
                                       (put(x, P(None, "tp")), put_q(qw, P(None, "tp")),
                                        put(ra, P())))
    # decode attention: batch on data, kv heads (and their query heads, sinks) on tp
    qa, ka, va = rand(14, (4, 2, 16, 32)), rand(15, (4, 24, 8, 32)), rand(16, (4, 24, 8, 32))
    pa = jnp.broadcast_to(jnp.arange(18, 20, dtype=jnp.int32), (4, 2))
    sa, wa = rand(17, (16,)), jnp.int32(5)
    att = lambda q, k, v, p, w, s: jq.decode_attention(q, k, v, p, window=w, sinks=s)
    heads = P("data", None, "tp")
    out["decode_attention_heads"] = case(
        att, (qa, ka, va, pa, wa, sa),
        (put(qa, heads), put(ka, heads), put(va, heads), put(pa, P("data")), put(wa, P()),
         put(sa, P("tp"))))
    # the same over a stack of 3 layers' caches and a layer index
    kl, vl = jnp.stack([ka, -ka, ka * 2]), jnp.stack([va, va * 2, -va])
    att_l = lambda q, k, v, p, w, s: jq.decode_attention(q, k, v, p, window=w, sinks=s,
                                                         layer=jnp.int32(1))
    stacked = P(None, "data", None, "tp")
    out["decode_attention_stacked"] = case(
        att_l, (qa, kl, vl, pa, wa, sa),
        (put(qa, heads), put(kl, stacked), put(vl, stacked), put(pa, P("data")), put(wa, P()),
         put(sa, P("tp"))))

    # qmm_a8 (plain XLA ops): x's rows on data, w's rows (codes and scales) on tp
    for code_type in ("float8_e4m3fn", "int8"):
        rq = jq.quantize_rows(rand(14, (n, k)), code_type)
        placed = jq.RowQuantizedArray(put(rq.codes, P("tp", None)), put(rq.scales, P("tp")))
        out[f"qmm_a8_col_{code_type}"] = case(jq.qmm_a8, (x, rq), (put(x, P("data")), placed))

    # inside shard_map the ops run per shard on the local blocks
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # jax < 0.7
        from jax.experimental.shard_map import shard_map  # noqa: PLC0415
    qs = put_q(qw, P("tp", None))
    spec_q = jax.tree_util.tree_map(lambda _: P("tp", None), qs)
    per_shard = shard_map(lambda x, q: jq.qmm(x, q), mesh=MESH, in_specs=(P("data"), spec_q),
                          out_specs=P("data", "tp"))
    out["shard_map_qmm"] = case(per_shard, (put(x, P("data")), qs), (put(x, P("data")), qs))
    out["shard_map_qmm"]["err"] = err(jax.jit(per_shard)(put(x, P("data")), qs), jq.qmm(x, qw))
    if os.environ.get("JAXQUANT_SHARDING_CASES") != "ops":  # ops only: .ci/run's 3.12 leg
        out.update(model_cases())
    json.dump(out, sys.stdout)


def model_cases():
    """The decoder (jaxquant.models) on a 2 x 4 (tp x ep) mesh against one device
    (fused matrices split into their parts for tp), and on 1 x 4 (fused kept)."""
    from jaxquant import models
    from jaxquant.models import parallel
    from jaxquant.models.decoder import resolve_experts_by_layer

    out = {}
    # gpt-oss-style: attention tensor-parallel, experts expert- and tensor-parallel
    cfg = models.Config(family="gpt_oss", vocab_size=256, hidden_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8,
                        experts_per_token=2, moe_intermediate_size=64, attention_bias=True,
                        layer_windows=(4, 0), dtype="float32")
    params = models.quantize_params(models.init_params(cfg, jax.random.key(0)), "mxfp4")
    prompt = jax.random.randint(jax.random.key(1), (2, 20), 0, cfg.vocab_size)
    run = jax.jit(lambda p, t: models.prefill(cfg, p, t, 24))
    (want, cache_w, tok) = run(params, prompt)
    for name, (tp, ep) in (("model_gpt_oss", (2, 4)), ("model_gpt_oss_ep", (1, 4))):
        sharded = parallel.shard_params(cfg, params, parallel.make_mesh(tp, ep))
        compiled = run.lower(sharded, prompt).compile()
        got, cache_g, _ = compiled(sharded, prompt)
        text = compiled.as_text()
        # packed weights are uint32, MX scales uint8: no all-gather may produce either
        gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
        case = {"err": err(got, want), "scale": float(jnp.max(jnp.abs(want))),
                "weight_gathers": [g for g in gathers
                                   if g.startswith(("u32", "u8", "(u32", "(u8"))],
                "all_gathers": len(gathers),
                "all_reduces": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)),
                "keys": sorted(sharded["layers"]),
                "experts_by_layer": resolve_experts_by_layer(cfg, sharded["layers"], None)}
        if tp > 1:  # decode (gather_qmm for the experts) sharded as well
            dec = jax.jit(lambda p, c, t: models.decode(cfg, p, c, t, 20, 2)[:2])
            (tw, lw), (tg, lg) = dec(params, cache_w, tok), dec(sharded, cache_g, tok)
            case["decode_err"] = err(lg, lw)
            case["decode_same_tokens"] = bool(jnp.all(tw == tg))
        out[name] = case
    out.update(expert_parallel_cases())
    out.update(tensor_parallel_cases())
    out.update(checkpoint_cases())
    return out


def checkpoint_cases():
    """models.checkpoint.load(..., mesh=) of a tiny Llama checkpoint (bf16, quantized
    to affine4 on load; and MLX affine4 with 2 groups along K) on a 2 x 2 mesh:
    every array (gathered) and its placement against shard_params of the unsharded
    load, and the greedy tokens."""
    import pathlib  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from jaxquant import models
    from jaxquant.models import checkpoint, parallel
    from tests.test_models import LLAMA, _dense_mlps, _hf_common, _write

    rng = np.random.default_rng(5)
    t = _hf_common(rng, LLAMA)
    _dense_mlps(rng, t)
    mlx = {}
    for name, a in t.items():
        if name.endswith(".weight") and a.ndim == 2 and "embed" not in name:
            mlx.update(jq.io.to_mlx_tensors(jq.quantize(jnp.asarray(a), mode="affine", bits=4,
                                                        group_size=32), name[:-len(".weight")]))
        else:
            mlx[name] = a
    mesh = parallel.make_mesh(2, 2)
    prompt = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % LLAMA["vocab_size"]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config, tensors, mode in (
                ("bf16", LLAMA, t, None), ("affine4", LLAMA, t, "affine4"),
                ("mlx", dict(LLAMA, quantization={"group_size": 32, "bits": 4}), mlx, None)):
            path = pathlib.Path(tmp) / name
            _write(path, config, tensors)
            cfg, want = checkpoint.load(path, mode, dtype="float32", per_layer=True)
            want = parallel.shard_params(cfg, want, mesh)
            whole, read = checkpoint._Tensors.__getitem__, []
            checkpoint._Tensors.__getitem__ = lambda self, n: read.append(n) or whole(self, n)
            try:  # which tensors are read whole (not slice by slice)
                _, got = checkpoint.load(path, mode, dtype="float32", per_layer=True, mesh=mesh)
            finally:
                checkpoint._Tensors.__getitem__ = whole
            lw, lg = jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)
            gen = jax.jit(lambda p: models.generate(cfg, p, prompt, 4))
            out[f"load_{name}"] = {
                "same_tree": jax.tree_util.tree_structure(want) == jax.tree_util.tree_structure(got),
                "err": max(err(a, b) for a, b in zip(lw, lg)),
                "same_placement": all(a.sharding.is_equivalent_to(b.sharding, a.ndim)
                                      for a, b in zip(lw, lg)),
                "split": sum(not b.sharding.is_fully_replicated for b in lg),
                "linears_read_whole": sorted(n for n in read if "_proj." in n),
                "same_tokens": bool(jnp.all(gen(want) == gen(got))),
                # models.stream on the placed weights: generate's tokens, block by block
                "stream_tokens": bool(np.array_equal(
                    np.concatenate(list(models.stream(cfg, got, prompt, 4, block=2)), 1),
                    gen(got)))}
    return out


def gathers(text):
    """Element counts of the compiled program's all-gathers' results."""
    counts = []
    for shapes in re.findall(r"= (\(?[^=]*?\)?) all-gather(?:-start)?\(", text):
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", shapes):
            counts.append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return counts


def count(text, name):
    return len(re.findall(rf"= [^=]*? {name}(?:-start)?\(", text))


def expert_parallel_cases():
    """The MoE decoder with mesh= (parallel.expert_parallel_moe) on 1 x 4 and 2 x 2
    meshes, bf16 and MXFP4 experts, prefill (ragged) and decode (gather): the
    tokens of one device and the all-gathers of the compiled steps (none may be
    near an expert's size); parallel.init_params against shard_params."""
    from jaxquant import models
    from jaxquant.models import parallel

    cfg = models.Config(family="gpt_oss", vocab_size=256, hidden_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8,
                        experts_per_token=2, moe_intermediate_size=64, attention_bias=True,
                        layer_windows=(4, 0), dtype="bfloat16")
    base = models.init_params(cfg, jax.random.key(0), per_layer=False)
    prompt = jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size)  # 160 pairs
    out = {}
    for mode, (tp, ep), per_layer, layout in ((None, (1, 4), False, None),
                                              ("mxfp4", (2, 2), True, "canonical"),
                                              ("mxfp4", (2, 2), True, "cuda_mma")):
        params = base if mode is None else models.quantize_params(base, mode,
                                                                  per_layer=per_layer,
                                                                  layout=layout)
        mesh = parallel.make_mesh(tp, ep)
        pre = jax.jit(lambda p, t, m: models.prefill(cfg, p, t, 44, mesh=m), static_argnums=2)
        dec = jax.jit(lambda p, c, t, m: models.decode(cfg, p, c, t, 40, 3, mesh=m)[:2],
                      static_argnums=3)
        logits_w, cache_w, tok_w = pre(params, prompt, None)
        tokens_w, last_w = dec(params, cache_w, tok_w, None)
        sharded = parallel.shard_params(cfg, params, mesh)
        pre_g = pre.lower(sharded, prompt, mesh).compile()
        logits_g, cache_g, tok_g = pre_g(sharded, prompt)
        cache_g = parallel.shard_cache(cfg, cache_g, mesh)
        dec_g = dec.lower(sharded, cache_g, tok_g, mesh).compile()
        tokens_g, last_g = dec_g(sharded, cache_g, tok_g)
        texts = {"prefill": pre_g.as_text(), "decode": dec_g.as_text()}
        inited = parallel.init_params(cfg, jax.random.key(0), mesh, mode, per_layer=per_layer,
                                      layout=layout)
        init_err = max(err(a, b) for a, b in zip(
            jax.tree_util.tree_leaves(inited), jax.tree_util.tree_leaves(sharded)))
        name = f"ep_{mode or 'bf16'}_{tp}x{ep}" + ("_cuda_mma" if layout == "cuda_mma" else "")
        out[name] = {"err": err(logits_g, logits_w), "decode_err": err(last_g, last_w),
                     "scale": float(jnp.max(jnp.abs(logits_w.astype(jnp.float32)))),
                     "same_tokens": bool(jnp.all(tokens_g == tokens_w)
                                         and jnp.all(tok_g == tok_w)),
                     "gathers": {k: gathers(t) for k, t in texts.items()},
                     "all_reduces": {k: count(t, "all-reduce") for k, t in texts.items()},
                     "expert_elements": 2 * cfg.moe_intermediate_size * cfg.hidden_size,
                     "init_err": init_err, "init_same_tree": jax.tree_util.tree_structure(
                         inited) == jax.tree_util.tree_structure(sharded)}
    return out


def tensor_parallel_cases():
    """A dense decoder, per-layer buffers, affine4, on a tp=2 mesh, in the canonical
    layout and in the CUDA GPUs' default kernel layout (cuda_mma): the compiled
    decode step's all-reduces and all-gathers, and the tokens of one device;
    parallel.init_params against shard_params."""
    from jaxquant import models
    from jaxquant.models import parallel

    cfg = models.Config(family="llama", vocab_size=256, hidden_size=128, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                        dtype="float32")
    base = models.init_params(cfg, jax.random.key(2), per_layer=True)
    out = {}
    for layout in ("canonical", "cuda_mma"):
        params = models.quantize_params(base, "affine4", per_layer=True, layout=layout)
        mesh = parallel.make_mesh(2, 1)
        prompt = jax.random.randint(jax.random.key(3), (1, 8), 0, cfg.vocab_size)
        pre = jax.jit(lambda p, t: models.prefill(cfg, p, t, 12))
        step = jax.jit(lambda p, c, t: models.decode(cfg, p, c, t, 8, 1)[:2])
        _, cache_w, tok_w = pre(params, prompt)
        want, _ = step(params, cache_w, tok_w)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sharded = parallel.shard_params(cfg, params, mesh)
            _, cache_g, tok_g = pre(sharded, prompt)
            cache_g = parallel.shard_cache(cfg, cache_g, mesh)
            compiled = step.lower(sharded, cache_g, tok_g).compile()
            got, _ = compiled(sharded, cache_g, tok_g)
        text = compiled.as_text()
        inited = parallel.init_params(cfg, jax.random.key(2), mesh, "affine4", per_layer=True,
                                      layout=layout)
        placed = lambda t: [(str(a.sharding.spec), a.dtype.name)
                            for a in jax.tree_util.tree_leaves(t)]
        out[f"tp_dense_decode_{layout}"] = {
            "layers": cfg.num_layers, "all_reduces": count(text, "all-reduce"),
            "gathers": gathers(text), "same_tokens": bool(jnp.all(got == want)),
            "weight_elements": cfg.hidden_size * cfg.head_dim,
            "per_layer": all(isinstance(p, dict) for p in sharded["layers"]),
            "layouts": sorted({v.layout for v in jax.tree_util.tree_leaves(
                sharded["layers"], is_leaf=lambda a: isinstance(a, jq.QuantizedArray))
                if isinstance(v, jq.QuantizedArray)}),
            "split": sum(not a.sharding.is_fully_replicated
                         for a in jax.tree_util.tree_leaves(sharded["layers"])),
            "init_same_placement": placed(inited["layers"]) == placed(sharded["layers"]),
            "init_err": max(err(a, b) for a, b in zip(jax.tree_util.tree_leaves(inited),
                                                      jax.tree_util.tree_leaves(sharded))),
            "init_same_tree": jax.tree_util.tree_structure(inited)
            == jax.tree_util.tree_structure(sharded),
            "warnings": [str(w.message) for w in caught if "jaxquant" in str(w.message)]}
    return out


if __name__ == "__main__":
    main()
