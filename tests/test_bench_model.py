"""`python -m jaxquant bench model` on the CPU with the tiny configs: the table and
its columns, the weight-read bytes, the torch peer computing the same function as
jaxquant.models, the profile parser on a real CPU trace and on a synthetic GPU
one, and --mesh / --xla-flags in a subprocess with 2 fake CPU devices."""

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxquant import bench, demo, models
from jaxquant.bench import harness
from jaxquant.bench import model as bench_model
from jaxquant.bench import profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--prompt", "4", "--tokens", "3", "--iters", "1"]


def _tables(lines):
    """Each markdown table in lines: (header cells, [row cells])."""
    out, cur = [], None
    for line in lines + [""]:
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cur is None:
                cur = (cells, [])
            else:
                cur[1].append(dict(zip(cur[0], cells)))
        elif line.startswith("|---"):
            continue
        elif cur is not None:
            out.append(cur)
            cur = None
    return out


@pytest.mark.slow
def test_table_on_cpu_with_the_peer(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(harness, "copy_bandwidth", lambda *a, **k: pytest.fail("timed on CPU"))
    copied = []   # the CPU's bound: a host copy of each row's step bytes
    monkeypatch.setattr(harness, "cpu_copy_bandwidth",
                        lambda nbytes, *a, **k: copied.append(nbytes) or 1e10)
    lines = []
    assert bench.main(["model", "--configs", "tiny-dense", "--modes", "bf16,affine4",
                       "--batch", "1,2", "--prefill", "8", "--peer", "torch",
                       "--peer-batch", "1,2", *TINY], out=lines.append) == 0
    header, rows = _tables(lines)[-1]
    assert header == ["config", "impl", "mode", "batch", "decode tok/s", "% of bound",
                      "bound tok/s", "vs float", "prefill tok/s", "prefill vs float",
                      "first token ms", "weights read/step", "Δlogits"]
    assert any(l.startswith("# CPU: bound = a host copy") for l in lines)
    got = {(r["config"], r["impl"], r["mode"], r["batch"]): r for r in rows}
    want = {("tiny-dense", "jaxquant", m, b) for m in ("bf16", "affine4") for b in ("1", "2")}
    want |= {("tiny-dense", bench_model.PEER_IMPL, "bf16", b) for b in ("1", "2")}
    assert set(got) == want
    for key, r in got.items():
        assert float(r["decode tok/s"]) > 0, key
        assert (r["prefill tok/s"] != "") == (r["batch"] == "1"), key
        # the first token's time: jaxquant's prefill rows (the peer's prefill has no head
        # at one position)
        first = r["batch"] == "1" and key[1] == "jaxquant"
        assert (r["first token ms"] != "") == first, key
        assert not first or float(r["first token ms"]) > 0, key
    # the quantized model and the bf16 peer against jaxquant's bf16 logits
    assert 0 < float(got["tiny-dense", "jaxquant", "affine4", "1"]["Δlogits"][:-1]) < 60
    assert float(got["tiny-dense", bench_model.PEER_IMPL, "bf16", "2"]["Δlogits"][:-1]) < 3
    assert got["tiny-dense", "jaxquant", "bf16", "1"]["Δlogits"] == ""
    # the bound: each row's step bytes at the copy rate of that many bytes
    for key, r in got.items():
        assert r["bound tok/s"] != "" and r["% of bound"].endswith("%"), key
    assert copied and min(copied) > 0
    # what quantizing buys: each quantized row against bf16's of its batch, the peer not
    for b in ("1", "2"):
        q, f = got["tiny-dense", "jaxquant", "affine4", b], got["tiny-dense", "jaxquant", "bf16", b]
        want = float(q["decode tok/s"]) / float(f["decode tok/s"])
        assert float(q["vs float"][:-1]) == pytest.approx(want, rel=0.05), b
        assert f["vs float"] == "" and got["tiny-dense", bench_model.PEER_IMPL, "bf16", b][
            "vs float"] == ""
    assert got["tiny-dense", "jaxquant", "affine4", "1"]["prefill vs float"].endswith("x")
    assert any("torch int4 peer skipped: " in l and "CUDA" in l for l in lines)


@pytest.mark.full  # ~12 s of CPU; test_bench.py's a8 rows cover the bench's a8 path
def test_prefill_a8_rows(monkeypatch):
    """--prefill-a8: a prefill-only row per mode and 8-bit type, its logits against the
    float run's (the MoE config: experts stay 4-bit, the dense matrices go 8-bit)."""
    monkeypatch.setattr(harness, "copy_bandwidth", lambda *a, **k: pytest.fail("timed on CPU"))
    lines = []
    assert bench.main(["model", "--configs", "tiny", "--modes", "float32,mxfp4", "--batch", "1",
                       "--prefill", "8", "--peer", "none", "--dtype", "float32",
                       "--prefill-a8", "int8,float8_e4m3fn", *TINY], out=lines.append) == 0
    header, rows = _tables(lines)[-1]
    got = {(r["impl"], r["mode"]): r for r in rows}
    for mode in ("float32", "mxfp4"):
        for dtype in ("int8", "float8_e4m3fn"):
            r = got[f"jaxquant, prefill a8 {dtype}", mode]
            assert r["decode tok/s"] == "" and float(r["prefill tok/s"]) > 0
            # 8-bit activations move the logits (float32: int8 1.2%, FP8 5.6%); on the
            # mxfp4 weights they add little to the weights' own error (40% in this tiny
            # random model)
            base = float(got["jaxquant", mode]["Δlogits"][:-1] or 0)
            assert 0 < float(r["Δlogits"][:-1]) < base + (5 if dtype == "int8" else 15), r
        assert float(got["jaxquant", mode]["decode tok/s"]) > 0


def test_matmul_flops_per_token_counts_the_weight_products():
    # 2 x the elements of every matrix a token multiplies: each layer's 2-D weights, the
    # k/E share of its experts, the head
    for name in ("tiny-dense", "tiny"):
        cfg = demo.preset(name, "float32")
        params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
        layers = params["layers"]
        layers = layers if isinstance(layers, (list, tuple)) else [
            jax.tree_util.tree_map(lambda a: a[i], layers) for i in range(cfg.num_layers)]
        macs = params["lm_head"].size
        for layer in layers:
            for key, w in layer.items():
                if key.startswith("e_") and w.ndim == 3:
                    macs += w.size * cfg.experts_per_token / cfg.num_experts
                elif w.ndim == 2 and not key.startswith("e_"):
                    macs += w.size
        assert bench_model.matmul_flops_per_token(cfg) == 2 * macs, name


def test_prefill_share_of_the_gemm_column():
    # 1000 tok/s at 4e11 FLOPs a token: 50% of an 8e14 FLOP/s GEMM. Its bound: 512 tokens
    # take 0.256 s of FLOPs at the GEMM's rate; their 1e12 bytes at 2e12 B/s take 0.5 s,
    # against 0.512 s measured: 98% of the bound. The second row's bytes take 0.1 s: its
    # bound is the FLOPs' 0.256 s, 50%.
    rows = [{"config": "c", "impl": "jaxquant", "mode": "bf16", "batch": 1, "decode_tps": 10.0,
             "step_bytes": 1e9, "prefill_tps": 1000.0, "prefill_flops": 4e14,
             "prefill_tokens": 512, "prefill_bytes": 1e12},
            {"config": "c", "impl": "jaxquant", "mode": "mxfp4", "batch": 1,
             "decode_tps": 20.0, "step_bytes": 1e9, "prefill_tps": 1000.0,
             "prefill_flops": 4e14, "prefill_tokens": 512, "prefill_bytes": 2e11},
            {"config": "c", "impl": "jaxquant", "mode": "bf16", "batch": 8, "decode_tps": 70.0,
             "step_bytes": 1e9}]
    lines = []
    bench_model.print_rows(rows, 2e12, lines.append, [], gemm_flops=8e14)
    header, got = _tables(lines)[-1]
    assert header[5:11] == ["% of bound", "bound tok/s", "vs float", "prefill tok/s",
                            "prefill % of GEMM", "prefill % of bound"]
    assert [r["prefill % of GEMM"] for r in got] == ["50%", "50%", ""]
    assert [r["prefill % of bound"] for r in got] == ["98%", "50%", ""]
    lines.clear()
    bench_model.print_rows(rows, 2e12, lines.append, [])  # no GEMM timed: no column
    assert "prefill % of GEMM" not in _tables(lines)[-1][0]
    assert "prefill % of bound" not in _tables(lines)[-1][0]


def test_dense_matmul_flops_on_cpu():
    assert harness.dense_matmul_flops(n=128, iters=1) > 0


def test_step_bytes():
    for name in ("tiny-dense", "tiny"):
        cfg = demo.preset(name, "float32")
        params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
        total = models.weight_bytes(params)
        row = models.weight_bytes(params["embed"]) / cfg.vocab_size
        experts = sum(models.weight_bytes(w) for k, w in params["layers"].items()
                      if k.startswith("e_"))
        assert experts > 0 if cfg.moe else experts == 0
        for b in (1, 8):
            share = 1 - (1 - cfg.experts_per_token / cfg.num_experts) ** b if cfg.moe else 1
            want = total - models.weight_bytes(params["embed"]) + b * row \
                - experts * (1 - share)
            assert bench_model.step_bytes(cfg, params, b) == pytest.approx(want)
        if cfg.moe:   # batch 1 reads k of E experts
            one = bench_model.step_bytes(cfg, params, 1)
            assert one == pytest.approx(total - models.weight_bytes(params["embed"]) + row
                                        - experts * (1 - cfg.experts_per_token
                                                     / cfg.num_experts))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_peer_computes_jaxquants_function(dtype, tol):
    pytest.importorskip("torch")
    from jaxquant.bench import torch_peer

    cfg = demo.preset("tiny-dense", dtype)
    params = models.init_params(cfg, jax.random.key(3))
    prompt = jax.random.randint(jax.random.key(4), (2, 6), 0, cfg.vocab_size, jnp.int32)
    logits, cache, token = models.prefill(cfg, params, prompt, 12)
    tokens, _, _ = models.decode(cfg, params, cache, token, 6, 6)
    peer = torch_peer.Peer(cfg, params)
    peer.setup(2, 12)
    p_logits, p_token = peer.prefill(prompt)
    ref = np.asarray(logits, np.float64)
    err = np.max(np.abs(p_logits.numpy() - ref)) / np.max(np.abs(ref))
    assert err < tol
    if dtype == "float32":   # greedy tokens agree where the arithmetic does
        np.testing.assert_array_equal(p_token.numpy()[:, 0], np.asarray(token))
        np.testing.assert_array_equal(peer.decode(p_token, 6, 6).numpy(), np.asarray(tokens))
    # the bytes a step reads: the same weights as jaxquant's
    assert peer.step_bytes(2) == bench_model.step_bytes(cfg, params, 2)
    # the same from the models' other forms: per-layer dicts, fused or apart
    other = _other_form(cfg, params)
    assert bench_model.step_bytes(cfg, other, 2) == bench_model.step_bytes(cfg, params, 2)
    peer = torch_peer.Peer(cfg, other)
    peer.setup(2, 12)
    assert np.max(np.abs(peer.prefill(prompt)[0].numpy() - ref)) / np.max(np.abs(ref)) < tol


def _other_form(cfg, params):
    """params as one dict per layer, with q/k/v and gate/up fused if they were apart
    (wqkv: q, k, v rows; w_gate_up: gate, up rows) and apart if they were fused."""
    layers = params["layers"]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = []
    for i in range(next(iter(layers.values())).shape[0]):
        p = {k: v[i] for k, v in layers.items()}
        if "wq" in p:
            p["wqkv"] = jnp.concatenate([p.pop("wq"), p.pop("wk"), p.pop("wv")])
            p["w_gate_up"] = jnp.concatenate([p.pop("w_gate"), p.pop("w_up")])
        else:
            p["wq"], p["wk"], p["wv"] = jnp.split(p.pop("wqkv"), [q, q + kv])
            p["w_gate"], p["w_up"] = jnp.split(p.pop("w_gate_up"), 2)
        out.append(p)
    return dict(params, layers=tuple(out))

def test_peer_refuses_what_it_does_not_build():
    pytest.importorskip("torch")
    from jaxquant.bench import torch_peer

    assert "gpt_oss" in torch_peer.unavailable(demo.preset("tiny"))
    assert torch_peer.unavailable(demo.preset("tiny-dense")) is None
    assert "CUDA" in torch_peer.int4_unavailable("cpu")
    with pytest.raises(ValueError, match="dense Llama"):
        torch_peer.Peer(demo.preset("tiny"), {})


@pytest.mark.slow
def test_profile_of_a_cpu_decode(tmp_path):
    cfg = demo.preset("tiny", "float32")
    params = models.quantize_params(models.init_params(cfg, jax.random.key(0)), "affine4")
    prompt = jnp.zeros((1, 4), jnp.int32)
    r = bench_model.decode_run(cfg, params, prompt, 3, {}, 1, profile_dir=str(tmp_path))
    b = r["profile"]
    assert b.kind == "cpu" and b.steps == 3 and b.layers == cfg.num_layers
    assert b.kernels == pytest.approx(sum(n for n, _ in b.by_class.values()))
    assert 0 < b.busy_us <= b.span_us
    for cls in ("copies", "attention", "qmm", "moe glue"):
        assert b.by_class[cls][0] > 0, cls      # the scan slices its layer's weights: copies
    assert b.copy_bytes > 0
    assert not any(name.startswith("while") for _, name, _, _ in b.top)
    lines = []
    profile.print_breakdown(b, lines.append, "tiny affine4")
    text = "\n".join(lines)
    assert "per layer" in text and "| qmm |" in text and "# COPIES:" in text


@pytest.mark.slow
def test_profile_of_a_cpu_prefill(tmp_path):
    cfg = demo.preset("tiny-dense", "float32")
    params = models.quantize_params(models.init_params(cfg, jax.random.key(0)), "affine4")
    p = bench_model.prefill_run(cfg, params, 8, {}, 1, profile_dir=str(tmp_path))
    assert p["prefill_tps"] > 0
    b = p["profile"]
    assert b.kind == "cpu" and b.steps == 1 and b.layers == cfg.num_layers
    assert b.by_class["qmm"][0] > 0 and b.by_class["attention"][0] > 0
    lines = []
    profile.print_breakdown(b, lines.append, "tiny-dense affine4 prefill", what="prefill")
    text = "\n".join(lines)
    assert "1 prefill traced; per prefill:" in text and "| class | per prefill |" in text
    assert bench_model.prefill_run(cfg, params, 8, {}, 1).keys() == {"prefill_tps",
                                                                    "first_token_s"}


def _perfetto(path, events):
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
             "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_profile_parser_on_a_gpu_trace(tmp_path):
    """Kernels on a stream, with memcpys and gaps; host events and other modules left out."""
    def k(name, ts, dur, op="", module="jit_decode_steps", tid=7):
        args = {"hlo_op": op, "hlo_module": module} if op else {}
        return {"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [k("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 10, "custom-call.1"),
              k("loop_dynamic_slice_fusion", 12, 3, "wrapped_dynamic-slice.2"),
              k("MemcpyDtoD", 15, 5),
              k("void jaxquant::qmv_mma<4>(...)", 25, 20, "ffi_call.3"),
              k("add_rsqrt_fusion_1", 44, 2),           # no hlo_op: found by kernel name
              k("other_module_kernel", 50, 100, "fusion.9", module="jit_other"),
              k("XLA op summary", 0, 60, "custom-call.1", tid=9),
              {"ph": "X", "pid": 1, "tid": 3, "name": "host", "ts": 0, "dur": 99, "args": {}}]
    path = tmp_path / "perfetto_trace.json.gz"
    _perfetto(path, events)
    found, kind = profile.device_events(profile.trace_file(str(tmp_path)), "jit_decode_steps")
    assert kind == "gpu" and [e.name for e in found][0].startswith("sm90")
    assert len(found) == 5
    hlo = "\n".join([
        '  %custom-call.1 = bf16[1,4096]{1,0} custom-call(%a), custom_call_target="__cublas$gemm"',
        '  %wrapped_dynamic-slice.2 = u32[1,4096,512]{2,1,0} fusion(%b), kind=kLoop',
        '  %ffi_call.3 = bf16[1,1,4096]{2,1,0} custom-call(%c), custom_call_target="jaxquant_qmv"',
        '  %add_rsqrt_fusion.1 = f32[1,1]{1,0} fusion(%d), kind=kLoop'])
    b = profile.breakdown(found, profile.hlo_index(hlo), steps=1, layers=2, kind=kind)
    assert b.span_us == 46 and b.busy_us == 39 and b.gaps == 2   # [0,10] [12,20] [25,46]
    assert {c: n for c, (n, _) in b.by_class.items() if n} == {
        "dense mm": 1, "copies": 2, "qmm": 1, "norms": 1}
    assert b.by_class["copies"][1] == 8
    assert b.copy_bytes == 4096 * 512 * 4       # the memcpy's size is not in the HLO


def test_profile_of_a_mesh_takes_the_first_gpu(tmp_path):
    """A sharded step's trace has every GPU's streams: only GPU 0's kernels count (in
    device order: GPU 10 is not before GPU 2), its all-reduce as a collective."""
    meta = [{"ph": "M", "pid": p, "name": "process_name", "args": {"name": f"/device:GPU:{d}"}}
            for p, d in ((3, 10), (4, 2), (5, 0))]
    meta += [{"ph": "M", "pid": p, "tid": 7, "name": "thread_name",
              "args": {"name": "Stream #7(Compute)"}} for p in (3, 4, 5)]
    events = [{"ph": "X", "pid": p, "tid": 7, "name": name, "ts": ts, "dur": 5,
               "args": {"hlo_op": op, "hlo_module": "jit_decode_steps"}}
              for p in (3, 4, 5)
              for name, ts, op in (("void jaxquant::qmv_mma<4>(...)", 0, "ffi_call.3"),
                                   ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 6,
                                    "all-reduce-start.1"),
                                   ("loop_add_fusion", 12, "add_fusion.2"))]
    with gzip.open(tmp_path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    found, kind = profile.device_events(profile.trace_file(str(tmp_path)), "jit_decode_steps")
    assert kind == "gpu" and len(found) == 3
    hlo = "\n".join([
        '  %ffi_call.3 = bf16[1,1,4096]{2,1,0} custom-call(%c), custom_call_target="jaxquant_qmv"',
        '  %all-reduce-start.1 = bf16[1,4096]{1,0} all-reduce-start(%c), to_apply=%add',
        '  %add_fusion.2 = bf16[1,4096]{1,0} fusion(%d, %e), kind=kLoop'])
    b = profile.breakdown(found, profile.hlo_index(hlo), steps=1, layers=1, kind=kind)
    assert {c: n for c, (n, _) in b.by_class.items() if n} == {
        "qmm": 1, "collectives": 1, "other": 1}


@pytest.mark.parametrize("kernel, op, cls", [
    ("MemcpyDtoD", "", "copies"),
    ("ncclDevKernel_AllGather_RING_LL", "", "collectives"),
    ("psum_57_0_fusion_1", "", "collectives"),
    ("sm90_xmma_gemm_bf16", "", "dense mm"),
    ("nvjet_hsh_64x8_64x16", "", "dense mm"),
    ("void qmv_mma_kernel<4, 64>", "", "qmm"),
    ("jq_gather_matmul_bfloat16__1", "", "dense mm"),   # float experts, the float GEMV
    ("jq_gather_qmm_bfloat16", "", "qmm"),
    ("rms_norm_kernel", "", "norms"),
    ("flash_fwd_kernel", "", "attention"),
    ("loop_add_fusion", "", "other"),
])
def test_classify_kernels_the_hlo_does_not_name(kernel, op, cls):
    assert profile.classify(kernel, op, None) == cls


def test_profile_classes_name_the_models_functions():
    """The classes go by the decoder's function names: they must exist there."""
    import ast
    import inspect

    from jaxquant.models import decoder, layers, moe

    defined = {n.name for m in (decoder, layers, moe) for n in ast.walk(ast.parse(inspect.getsource(m)))
               if isinstance(n, ast.FunctionDef)}
    assert profile._ATTENTION_FUNCS <= defined
    assert {"route", "moe_mlp", "expert_gather", "expert_ragged"} <= defined


def _two_cpu_devices_env():
    """A subprocess's environment with 2 host CPU devices (and the tests' XLA options)."""
    return dict(os.environ, XLA_FLAGS=os.environ.get("JAXQUANT_TEST_XLA_FLAGS", "")
                + " --xla_force_host_platform_device_count=2",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


# a subprocess (eight seconds of CPU): CI's full matrix (tests/conftest.py)
@pytest.mark.full
@pytest.mark.slow
def test_mesh_and_xla_flags_variants_in_a_subprocess():
    env = _two_cpu_devices_env()
    argv = [sys.executable, "-m", "jaxquant", "bench", "model", "--configs", "tiny-dense",
            "--modes", "bf16", "--batch", "1", "--prefill", "0", "--peer", "none",
            "--mesh", "2x1,4x1", "--xla-flags=--xla_cpu_enable_fast_math=false", *TINY]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    tables = _tables(lines)
    (header, rows), (vheader, vrows) = tables[-2], tables[-1]
    assert header[-3:] == ["vs 1 device", "vs best 1 device", "prefill vs best 1 device"]
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {"jaxquant", "jaxquant 2x1"}
    assert by_impl["jaxquant 2x1"]["vs 1 device"].endswith("x")
    # one mode: the best one-device run is that mode's
    assert by_impl["jaxquant 2x1"]["vs best 1 device"] == by_impl["jaxquant 2x1"]["vs 1 device"]
    assert float(by_impl["jaxquant 2x1"]["decode tok/s"]) > 0
    assert any("mesh 4x1 not run: it needs 4 devices, 2 here" in l for l in lines)
    assert vheader[:5] == ["config", "mode", "batch", "XLA_FLAGS", "decode tok/s"]
    assert len(vrows) == 1 and "xla_cpu_enable_fast_math" in vrows[0]["XLA_FLAGS"]
    assert float(vrows[0]["decode tok/s"]) > 0 and vrows[0]["vs this process"].endswith("x")


# a subprocess of a minute of CPU: CI's full matrix (tests/conftest.py), not the README's run
@pytest.mark.full
@pytest.mark.slow
def test_sharded_init_on_an_expert_parallel_mesh_in_a_subprocess():
    """--init sharded (parallel.init_params: no host copy) with --mesh 1x2 on a MoE
    config, in the CUDA default kernel layout (--layout cuda_mma: the layout is data):
    a row per mode on one device and on the mesh, and a one-device row in this
    device's default layout for the quantized mode; the mesh's bf16 logits those of
    one device (the same weights drawn placed; expert parallel sums exactly here)."""
    env = _two_cpu_devices_env()
    argv = [sys.executable, "-m", "jaxquant", "bench", "model", "--configs", "tiny",
            "--modes", "bf16,mxfp4", "--batch", "1", "--prefill", "8", "--peer", "none",
            "--init", "sharded", "--mesh", "1x2", "--layout", "cuda_mma", *TINY]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    header, rows = _tables(p.stdout.splitlines())[-1]
    assert header[-3:] == ["vs 1 device", "vs best 1 device", "prefill vs best 1 device"]
    got = {(r["impl"], r["mode"]) for r in rows if float(r["decode tok/s"]) > 0}
    assert got == {(i, m) for i in ("jaxquant", "jaxquant 1x2") for m in ("bf16", "mxfp4")} | {
        ("jaxquant default layout", "mxfp4")}, rows
    assert all(r["vs best 1 device"].endswith("x") and r["prefill vs best 1 device"].endswith("x")
               for r in rows if r["impl"] == "jaxquant 1x2"), rows
    assert all(float(r["first token ms"]) > 0 for r in rows if r["impl"] == "jaxquant 1x2"), rows
    by = {(r["impl"], r["mode"]): r for r in rows}
    assert by[("jaxquant 1x2", "bf16")]["Δlogits"] == "0.00%", rows
    assert by[("jaxquant 1x2", "mxfp4")]["Δlogits"] == by[("jaxquant", "mxfp4")]["Δlogits"], rows


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and jax.devices()[0].platform == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not _torch_cuda(), reason="needs torch with CUDA and JAX on the same GPU")
def test_peer_on_cuda_bf16_and_int4():
    """On the GPU: the bf16 peer on the JAX arrays (DLPack views) agrees with jaxquant;
    the int4 peer (gpt-fast's _weight_int4pack_mm) is near the bf16 one."""
    from jaxquant.bench import torch_peer

    cfg = demo.preset("small-dense")
    params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size, jnp.int32)
    logits, _, _ = models.prefill(cfg, params, prompt, 24)
    ref = np.asarray(logits, np.float64)
    got = {}
    for int4 in (False, True):
        peer = torch_peer.Peer(cfg, params, int4=int4, compile_mode="default")
        peer.setup(2, 24)
        p_logits, token = peer.prefill(prompt)
        got[int4] = p_logits.double().cpu().numpy()
        assert peer.decode(token, 16, 8).shape == (2, 8)
        if int4:   # packed weights: about a quarter of the bf16 bytes
            assert peer.step_bytes(2) < 0.35 * bench_model.step_bytes(cfg, params, 2)
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(got[False] - ref)) / scale < 3e-2
    assert np.max(np.abs(got[True] - got[False])) / scale < 0.3


def test_forward_kw_reaches_the_child_unchanged():
    """--forward-kw values are Python literals (strings otherwise) and the XLA_FLAGS
    subprocesses get them back as they were parsed."""
    kw = bench_model._forward_kw("experts_by_layer=True, layer_loop=scan,n=3")
    assert kw == {"experts_by_layer": True, "layer_loop": "scan", "n": 3}
    args = bench.parser(cpu=True).parse_args(["model", "--forward-kw", "experts_by_layer=True,"
                                              "layer_loop=scan", "--layers", "1"])
    args.modes = ("bf16",)
    child = bench.parser(cpu=True).parse_args(["model", *bench_model._child_argv(args)])
    assert child.forward_kw == {"experts_by_layer": True, "layer_loop": "scan"}
    assert (child.layers, child.prefill, child.peer, child.json) == (1, 0, "none", True)


def test_classify_float_expert_products_as_dense_mm():
    """The float GEMV and float experts (Pallas custom calls named jq_gather_matmul_*)
    read bf16 weights: dense mm, not jaxquant's quantized products."""
    hlo = "\n".join([
        '  %custom-call.5 = bf16[1,5760]{1,0} custom-call(%x, %w, %i), '
        'custom_call_target="__gpu$xla.gpu.triton", backend_config={name="jq_gather_matmul_bfloat16"}',
        '  %custom-call.6 = bf16[1,5760]{1,0} custom-call(%x, %w, %i), '
        'custom_call_target="__gpu$xla.gpu.triton", backend_config={name="jq_gather_qmm_bfloat16"}'])
    index = profile.hlo_index(hlo)
    assert profile.classify("jq_gather_matmul_bfloat16", "custom-call.5",
                            index["custom-call.5"]) == "dense mm"
    assert profile.classify("jq_gather_qmm_bfloat16", "custom-call.6",
                            index["custom-call.6"]) == "qmm"
