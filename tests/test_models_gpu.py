"""jaxquant.models on an NVIDIA GPU with jaxquant's CUDA library: what the
defaults give there (per-layer buffers, the cuda_mma layout) runs the model to
the tokens of the stacked, canonical form; jq.prepack of a stacked expert
weight stays within its memory bound. Skips without a CUDA GPU and library
(the lead runs it on the H100: pytest -q tests/test_models_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import models
from jaxquant.quantized_array import QuantizedArray
from tests.common import cuda_library


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_library(),
                                 reason="needs an NVIDIA GPU and the CUDA library")]

CFG = models.Config(family="gpt_oss", vocab_size=512, hidden_size=256, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8,
                    experts_per_token=2, moe_intermediate_size=256, attention_bias=True,
                    layer_windows=(4, 0, 4), sliding_window=4)
DENSE = models.Config(family="llama", vocab_size=512, hidden_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)


@pytest.mark.parametrize("cfg,mode", [(DENSE, "affine4"), (CFG, "mxfp4"), (DENSE, "bf16")])
def test_defaults_on_cuda(cfg, mode):
    params = models.init_params(cfg, jax.random.key(0))
    assert isinstance(params["layers"], tuple)  # per-layer buffers on a GPU
    if mode != "bf16":
        fast = models.quantize_params(params, mode)
        quantized = [a for a in jax.tree_util.tree_leaves(
            fast, is_leaf=lambda a: isinstance(a, QuantizedArray)) if isinstance(a, QuantizedArray)]
        assert quantized and {a.layout for a in quantized} == {"cuda_mma"}
        slow = models.quantize_params(models.stack_layers(params), mode, layout="canonical",
                                      per_layer=False)
    else:
        fast, slow = params, models.stack_layers(params)
    prompt = jax.random.randint(jax.random.key(1), (1, 16), 0, cfg.vocab_size)
    gen = jax.jit(models.generate, static_argnums=(0, 3))
    logits = jax.jit(lambda p: models.prefill(cfg, p, prompt, 24)[0])
    want = logits(slow)
    np.testing.assert_allclose(logits(fast), want, rtol=0.05,
                               atol=0.05 * float(jnp.max(jnp.abs(want))))
    agree = np.mean(np.asarray(gen(cfg, fast, prompt, 8)) == np.asarray(gen(cfg, slow, prompt, 8)))
    assert agree >= 0.75, agree  # bf16 activations: another kernel may flip a late token


def test_prepack_of_a_stacked_expert_weight_in_bounded_memory():
    w = jax.random.normal(jax.random.key(2), (4, 8, 1024, 1024), jnp.bfloat16)
    qw = jq.quantize(w, mode="mxfp4", layout="canonical")  # what prepack converts
    del w
    own = sum(a.nbytes for a in jax.tree_util.tree_leaves(qw))
    m = jax.jit(lambda q: jq.prepack(q, layout="cuda_mma")).lower(qw).compile().memory_analysis()
    assert m.temp_size_in_bytes <= 0.25 * own, m.temp_size_in_bytes / own
    assert m.output_size_in_bytes <= 1.001 * own
