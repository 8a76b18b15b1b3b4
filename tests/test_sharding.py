"""Sharding of the primitives under jit (jaxquant/sharding.py): on 8 host devices
in a subprocess (tests/sharding_cases.py), each sharded case against the same op
unsharded, and the compiled HLO's collectives: none for column-parallel qmm,
norms on rows and dequantize; exactly one all-reduce for row-parallel qmm and
expert-parallel gather_qmm / gather_matmul / ragged_qmm / ragged_matmul; no all-gather unless K is split inside
a quantization group (then a warning says so)."""

import fcntl
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import FULL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One work unit under pytest-xdist's `--dist loadgroup` (CI): the module fixture's
# subprocess (about 80 s of a core) then runs once, not once per worker.
pytestmark = [pytest.mark.xdist_group("sharding"), pytest.mark.slow]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    # The subprocess runs once per pytest run even where xdist hands this module's tests
    # to several workers: the first writes its output beside the workers' temp folders
    # (one parent per run), under a lock; the others read it.
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "sharding_cases.json"
    with open(shared / "sharding_cases.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            if not FULL:  # the sharded models' cases (~40 s of a core): the full matrix
                env["JAXQUANT_SHARDING_CASES"] = "ops"
            proc = subprocess.run([sys.executable, "-m", "tests.sharding_cases"], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            out.write_text(proc.stdout)
    return json.loads(out.read_text())


def _check(case, *, tol, collectives):
    assert case["err"] <= tol * max(case["scale"], 1.0), case
    found = {k: v for k, v in case["collectives"].items() if v}
    assert found == collectives, case


KERNEL_LAYOUTS = [("cuda_mma", "affine"), ("cuda_mma", "mxfp4"), ("cuda_mma", "nvfp4"),
                  ("cdna4", "mxfp4")]
NO_COLLECTIVES = [f"qmm_col_{m}" for m in ("affine", "mxfp4", "nvfp4")] + [
    f"qmm_col_{layout}_{m}" for layout, m in KERNEL_LAYOUTS] + [
    "qmm_batch_col", "qmm_col_one_group", "rms_norm_rows", "add_rms_norm_rows", "gated_rms_norm_rows",
    "dequantize_col", "shard_map_qmm", "rms_norm_qmm_col", "qmm_swiglu_rows",
    "rms_norm_qmm_swiglu_rows", "qmm_add_col",
    "gather_qmm_swiglu_tokens",
    "decode_attention_heads", "decode_attention_stacked",
    "gather_matmul_col", "ragged_matmul_col", "qmm_a8_col_float8_e4m3fn", "qmm_a8_col_int8"]


@pytest.mark.parametrize("name", NO_COLLECTIVES)
def test_no_collective(cases, name):
    _check(cases[name], tol=1e-6, collectives={})
    assert not cases[name]["warnings"]


@pytest.mark.parametrize("name", [f"qmm_row_{m}" for m in ("affine", "mxfp4", "nvfp4")]
                         + [f"qmm_row_{layout}_{m}" for layout, m in KERNEL_LAYOUTS]
                         + ["gather_ep", "gather_ep_row", "gather_matmul_ep",
                            "gather_ep_cuda_mma", "gather_ep_row_cuda_mma",
                            "ragged_ep", "ragged_ep_col", "ragged_ep_col_cuda_mma",
                            "ragged_ep_bad_sizes", "ragged_matmul_ep",
                            "qmm_col_grad"])
def test_one_all_reduce(cases, name):
    # partial sums in another order: float32 rounding over K=512
    _check(cases[name], tol=1e-6 * 64, collectives={"all-reduce": 1})
    assert not cases[name]["warnings"]


def test_column_parallel_output_stays_split(cases):
    assert cases["qmm_col_affine"]["out_spec"] == ["P('data', 'tp')"]
    assert cases["qmm_batch_col"]["out_spec"] == ["P('data', None, 'tp')"]
    assert cases["rms_norm_rows"]["out_spec"] == ["P(('data', 'tp'),)"]
    assert cases["decode_attention_heads"]["out_spec"] == ["P('data', None, 'tp')"]
    assert cases["qmm_a8_col_int8"]["out_spec"] == ["P('data', 'tp')"]


def test_fused_ops_split_as_documented(cases):
    # rms_norm_qmm: column-parallel like qmm; qmm_swiglu: rows only (docs/fused.md)
    assert cases["rms_norm_qmm_col"]["out_spec"] == ["P('data', 'tp')"]
    assert cases["qmm_swiglu_rows"]["out_spec"] == ["P(('data', 'tp'),)"]
    case = cases["qmm_swiglu_col_gathered"]
    assert case["err"] <= 1e-6 * case["scale"] and case["collectives"]["all-gather"] >= 1
    assert any("qmm_swiglu" in w and "'r'" in w for w in case["warnings"]), case
    # qmm_add: column-parallel with the addend; K does not split
    assert cases["qmm_add_col"]["out_spec"] == ["P('data', 'tp')"]
    assert cases["rms_norm_qmm_swiglu_rows"]["out_spec"] == ["P(('data', 'tp'),)"]
    case = cases["qmm_add_row_gathered"]
    assert case["err"] <= 1e-6 * case["scale"] and case["collectives"]["all-gather"] >= 1
    assert any("qmm_add" in w and "'g'" in w for w in case["warnings"]), case
    # gather_qmm_swiglu: tokens only; experts on tp are gathered
    assert cases["gather_qmm_swiglu_tokens"]["out_spec"] == ["P('data',)"]
    case = cases["gather_qmm_swiglu_ep_gathered"]
    assert case["err"] <= 1e-6 * case["scale"] and case["collectives"]["all-gather"] >= 1
    assert any("gather_qmm_swiglu" in w and "'e'" in w for w in case["warnings"]), case


def test_k_split_inside_a_group_is_gathered_with_a_warning(cases):
    case = cases["qmm_row_misaligned"]
    assert case["err"] <= 1e-6 * case["scale"]
    assert case["collectives"]["all-gather"] >= 1
    assert any("quantization-group boundaries" in w for w in case["warnings"]), case


def test_unsplit_kernel_layout_k_is_gathered_with_a_warning(cases):
    """A kernel layout prepacked whole and split on K: a device's columns are not
    its K block in the layout, so K is gathered (correct), and the warning names
    the split layout to place the weight in."""
    case = cases["qmm_row_cuda_mma_unsplit_gathered"]
    assert case["err"] <= 1e-6 * 64 * case["scale"], case
    assert case["collectives"]["all-gather"] >= 1, case
    assert any("'cuda_mma/k4'" in w for w in case["warnings"]), case


def test_kernels_kept_per_shard(cases):
    if "qmm_col_ffi" not in cases:
        pytest.skip("the ffi CPU library is not built here")
    # the partitioned program still calls the native GEMV, on the local [N/4, K] block
    assert cases["qmm_col_ffi"]["ffi"], cases["qmm_col_ffi"]
    _check(cases["qmm_col_ffi"], tol=1e-6, collectives={})


# The sharded models (tests/sharding_cases.py's model_cases, on the layouts the GPUs use):
# CI's full matrix, whose subprocess computes them (JAXQUANT_TEST_FULL=1)
@pytest.mark.full
def test_model_tp_ep(cases):
    """The gpt-oss-style decoder (MXFP4 experts) on a 2 x 4 (tp x ep) mesh: the same
    logits as on one device, prefill and decode, and no all-gather of packed weights
    or scales anywhere in the compiled prefill."""
    case = cases["model_gpt_oss"]
    assert case["err"] <= 1e-5 * case["scale"], case
    assert case["decode_err"] <= 1e-5 * case["scale"], case
    assert case["decode_same_tokens"], case
    assert case["weight_gathers"] == [], case
    assert case["all_reduces"] >= 1, case
    # tp splits the fused matrices back into their parts (each split on tp)
    assert {"wq", "wk", "wv", "bq", "e_gate", "e_up", "e_gate_bias"} <= set(case["keys"])
    assert "wqkv" not in case["keys"] and "e_gate_up" not in case["keys"]
    # the experts of all layers flattened would not stay split on ep: off on a mesh
    assert case["experts_by_layer"] is False


@pytest.mark.full
def test_model_ep_keeps_fused_matrices(cases):
    case = cases["model_gpt_oss_ep"]
    assert {"wqkv", "bqkv", "e_gate_up", "e_gate_up_bias"} <= set(case["keys"])
    assert case["err"] <= 1e-5 * case["scale"], case
    assert case["weight_gathers"] == [], case
    assert case["experts_by_layer"] is False


@pytest.mark.full
@pytest.mark.parametrize("name", ["ep_bf16_1x4", "ep_mxfp4_2x2", "ep_mxfp4_2x2_cuda_mma"])
def test_expert_parallel_moves_activations_only(cases, name):
    """models.prefill / decode with mesh= (parallel.expert_parallel_moe): the tokens
    of one device, and no all-gather in the compiled steps bigger than a few
    activations (an expert's gate/up block is 16384 elements); one all-reduce per
    layer body for the experts (+ one per tp-split block)."""
    case = cases[name]
    assert case["same_tokens"], case
    assert case["err"] <= 1e-2 * case["scale"] and case["decode_err"] <= 1e-2 * case["scale"], case
    for step in ("prefill", "decode"):
        assert all(n <= 64 for n in case["gathers"][step]), case
        assert case["all_reduces"][step] >= 1, case
    # parallel.init_params: the same arrays, placed the same, as shard_params of the unsharded
    assert case["init_err"] == 0.0 and case["init_same_tree"], case


@pytest.mark.full
@pytest.mark.parametrize("layout", ["canonical", "cuda_mma"])
def test_tensor_parallel_dense_one_all_reduce_per_block(cases, layout):
    """A dense model's decode step on tp=2, per-layer buffers, affine4, in the canonical
    layout and the CUDA default kernel layout (cuda_mma, forced here: the layout is
    data): the tokens of one device, one all-reduce per block (attention's wo, the
    MLP's down: 2 per layer), no weight all-gather, no warning; row-parallel
    matrices placed in the split layout; parallel.init_params places the same."""
    case = cases[f"tp_dense_decode_{layout}"]
    assert case["per_layer"] and case["same_tokens"], case
    assert case["all_reduces"] == 2 * case["layers"], case
    assert all(n < case["weight_elements"] for n in case["gathers"]), case
    assert case["warnings"] == [], case
    assert case["split"] > 0, case
    want = ["canonical"] if layout == "canonical" else ["cuda_mma", "cuda_mma/k2"]
    assert case["layouts"] == want, case
    assert case["init_same_placement"] and case["init_same_tree"], case
    # the same values, up to float32 rounding of the float weights drawn under jit
    assert case["init_err"] <= 1e-6, case


@pytest.mark.full
@pytest.mark.parametrize("name", ["load_bf16", "load_affine4", "load_mlx"])
def test_checkpoint_load_on_a_mesh(cases, name):
    """checkpoint.load(..., mesh=) (each device's slices read from the file, quantized
    where they sit) gives shard_params(load(...)): the same arrays, the same placement,
    split ones among them, the same greedy tokens."""
    case = cases[name]
    assert case["same_tree"] and case["same_placement"] and case["same_tokens"], case
    assert case["stream_tokens"], case
    assert case["err"] == 0.0 and case["split"] > 0, case
    assert case["linears_read_whole"] == [], case  # q/k/v/o, gate/up/down: slices only
