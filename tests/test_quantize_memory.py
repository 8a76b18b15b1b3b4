"""models.quantize_params and checkpoint.load(mode=...) in bounded device memory
(docs/models.md, "Memory while quantizing"): the arrays alive while they run are at
most the input, the quantized output and one layer's temporaries, never a second copy
of a stack; when they fail part way (an out-of-memory error), the arrays they made
are all released and only the caller's input is left. Measured with jax.live_arrays()
(the device buffers Python holds; XLA's own temporaries inside one jitted call are one
layer's and do not show here), sampled at every layer and by a thread polling
throughout. The GPU measurement of gpt-oss-20b: tools/gpu/quantize_memory.py."""

import gc
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import models
from jaxquant.models import checkpoint, params as model_params

LAYERS = 12
# The most layers' float bytes allowed alive beyond the input and the output. One
# layer's slices, fused and quantized parts measure 1.7-1.8 layers here (every Python
# call and return sampled); in the README's single-process run of the whole suite the
# polling thread once saw 3.5. A stack fused or quantized whole, the failure this
# guards against, adds LAYERS layers: half of that still tells the two apart.
PEAK_LAYERS = LAYERS // 2


def _hold_live_arrays():
    """Every array alive now, held so none of them is freed while a test measures:
    the suite's earlier tests leave arrays that the collector frees at any moment,
    which moved a plain total of live bytes by megabytes in either direction."""
    gc.collect()
    return {id(a): a for a in jax.live_arrays()}


def _new_bytes(held):
    """The bytes of the live arrays made since `held` was taken."""
    return sum(a.nbytes for a in jax.live_arrays() if id(a) not in held and not a.is_deleted())


class _Peak:
    """The largest _new_bytes() seen: at every sample() and by a thread polling while
    the block runs (a short switch interval lets it in between the main thread's
    dispatches)."""

    def __init__(self, held):
        self.held, self.peak, self._stop = held, 0, threading.Event()

    def sample(self):
        self.peak = max(self.peak, _new_bytes(self.held))

    def _poll(self):
        while not self._stop.is_set():
            self.sample()

    def __enter__(self):
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._interval)
        self.sample()


def _cfg():
    return models.Config(family="llama", vocab_size=64, hidden_size=128, num_layers=LAYERS,
                         num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)


def _separate_params():
    """Stacked float32 layers with q/k/v and gate/up as separate matrices (a fused
    copy of a whole stack is what quantize_params must not make)."""
    cfg = _cfg()
    params = models.unfuse_params(cfg, models.init_params(cfg, jax.random.key(0),
                                                          jnp.float32, per_layer=False))
    return cfg, jax.block_until_ready(params)


def _one_layer_bytes(params):
    return models.device_bytes(params["layers"]) // LAYERS


@pytest.mark.parametrize("per_layer", [False, pytest.param(True, marks=pytest.mark.full)])
def test_quantize_params_holds_the_output_and_one_layer(per_layer, monkeypatch):
    cfg, params = _separate_params()
    want = models.quantize_params(params, "affine4", per_layer=per_layer)
    out_bytes = models.device_bytes(want, params)    # the embedding and the norms are params' own
    del want
    held = _hold_live_arrays()
    layer = _one_layer_bytes(params)
    peak = _Peak(held)
    real = model_params.quantize_layer
    calls = []

    def sampled(*a, **kw):
        peak.sample()
        out = real(*a, **kw)
        peak.sample()
        calls.append(1)
        return out

    monkeypatch.setattr(model_params, "quantize_layer", sampled)
    with peak:
        got = models.quantize_params(params, "affine4", per_layer=per_layer)
        jax.block_until_ready(got)
    assert len(calls) == LAYERS
    # the output and one layer's slices and fused / quantized parts (PEAK_LAYERS)
    assert peak.peak <= out_bytes + PEAK_LAYERS * layer, (peak.peak, out_bytes, layer)
    assert _new_bytes(held) == models.device_bytes(got, params) == out_bytes   # nothing else left
    np.testing.assert_array_equal(                            # and the same values
        models.forward(cfg, got, jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None],
                       models.init_cache(cfg, 1, 4))[0],
        models.forward(cfg, models.quantize_params(params, "affine4", per_layer=not per_layer),
                       jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None],
                       models.init_cache(cfg, 1, 4))[0])


@pytest.mark.parametrize("per_layer", [False, True])
def test_a_failure_part_way_leaves_nothing_held(per_layer, monkeypatch):
    _, params = _separate_params()
    held = _hold_live_arrays()
    real = model_params.quantize_layer
    calls = []

    def out_of_memory_at_layer_5(*a, **kw):
        out = real(*a, **kw)   # this layer's arrays exist when it fails
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (simulated)")
        return out

    monkeypatch.setattr(model_params, "quantize_layer", out_of_memory_at_layer_5)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED") as e:
        models.quantize_params(params, "mxfp4", per_layer=per_layer)
    assert len(calls) == 6
    assert e.value is not None and _new_bytes(held) == 0   # the error held, not its arrays
    assert all(not a.is_deleted() for a in jax.tree_util.tree_leaves(params))  # the input's


def _write_checkpoint(path, cfg):
    rng = np.random.default_rng(0)
    d, hq, hkv, hd, inter = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size)
    w = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)
    t = {"model.embed_tokens.weight": w(cfg.vocab_size, d), "model.norm.weight": 1 + w(d),
         "lm_head.weight": w(cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        t.update({pre + "input_layernorm.weight": 1 + w(d),
                  pre + "post_attention_layernorm.weight": 1 + w(d),
                  pre + "self_attn.q_proj.weight": w(hq * hd, d),
                  pre + "self_attn.k_proj.weight": w(hkv * hd, d),
                  pre + "self_attn.v_proj.weight": w(hkv * hd, d),
                  pre + "self_attn.o_proj.weight": w(d, hq * hd),
                  pre + "mlp.gate_proj.weight": w(inter, d),
                  pre + "mlp.up_proj.weight": w(inter, d),
                  pre + "mlp.down_proj.weight": w(d, inter)})
    path.mkdir()
    (path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": %d, "hidden_size": %d, "num_hidden_layers": %d,'
        ' "num_attention_heads": %d, "num_key_value_heads": %d, "head_dim": %d,'
        ' "intermediate_size": %d, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,'
        ' "tie_word_embeddings": false}' % (cfg.vocab_size, d, cfg.num_layers, hq, hkv, hd, inter))
    jq.io.save_safetensors(path / "model.safetensors", t)
    return sum(a.nbytes for n, a in t.items() if n.startswith("model.layers.0."))


@pytest.mark.parametrize("per_layer", [False, True])
def test_checkpoint_load_holds_the_output_and_one_layer(per_layer, tmp_path, monkeypatch):
    pytest.importorskip("safetensors", reason="checkpoint.load reads safetensors files")
    layer = _write_checkpoint(tmp_path / "ckpt", _cfg())
    _, want = checkpoint.load(tmp_path / "ckpt", "affine4", dtype="float32",
                              per_layer=per_layer)
    out_bytes = models.device_bytes(want)
    del want
    held = _hold_live_arrays()
    peak = _Peak(held)
    real = checkpoint.prepack_matrix
    calls = []

    def sampled(*a, **kw):
        peak.sample()
        calls.append(1)
        if calls == [1] * 10 and fail:
            raise MemoryError("out of memory (simulated)")
        return real(*a, **kw)

    monkeypatch.setattr(checkpoint, "prepack_matrix", sampled)
    fail = False
    with peak:
        _, got = checkpoint.load(tmp_path / "ckpt", "affine4", dtype="float32",
                                 per_layer=per_layer)
        jax.block_until_ready(got)
    assert peak.peak <= out_bytes + PEAK_LAYERS * layer, (peak.peak, out_bytes, layer)
    assert _new_bytes(held) == models.device_bytes(got) == out_bytes
    del got
    fail, calls[:] = True, []
    with pytest.raises(MemoryError) as e:       # in layer 1 (5 matrices a layer, fused)
        checkpoint.load(tmp_path / "ckpt", "affine4", dtype="float32", per_layer=per_layer)
    assert e.value is not None and _new_bytes(held) == 0
