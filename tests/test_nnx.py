"""jaxquant.nnx: Flax NNX modules quantized in place (docs/nnx.md).

Each quantized layer must compute what the float layer computes with its kernel
replaced by the dequantized weight (jq.qmm == x @ dequantize(qw).T to rounding),
under nnx.jit and through nnx.split / merge, for flax's own nnx.Linear,
nnx.LinearGeneral (inside nnx.MultiHeadAttention) and nnx.Einsum."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="jaxquant.nnx needs flax (pip install flax)")

import jaxquant as jq  # noqa: E402
import jaxquant.nnx as jqnnx  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MLP(nnx.Module):
    def __init__(self, d, hidden, rngs):
        self.up = nnx.Linear(d, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    """A pre-norm transformer block of flax's own modules (attention + MLP)."""

    def __init__(self, d, heads, hidden, rngs):
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False,
                                           rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = MLP(d, hidden, rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _float_twin(model):
    """A copy of `model` whose quantized layers are float layers holding the
    dequantized kernels: what the quantized model must compute."""
    graphdef, state = nnx.split(model)
    twin = nnx.merge(graphdef, state)
    for path, node in list(nnx.iter_graph(twin)):
        if isinstance(node, jqnnx.QuantizedEinsum):
            layer = nnx.Einsum(node.spec.replace("...", "..."), node.kernel_shape,
                               None if node.bias is None else node.bias[...].shape,
                               rngs=nnx.Rngs(0))
            layer.kernel[...] = node.dequantized_kernel(jnp.float32)
            if node.bias is not None:
                layer.bias[...] = node.bias[...]
            parent = twin
            for p in path[:-1]:
                parent = parent[p] if isinstance(p, int) else getattr(parent, p)
            setattr(parent, path[-1], layer)
    return twin


def _x(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("mode,kw", [("affine", dict(bits=4, group_size=32)), ("mxfp4", {}),
                                     ("nvfp4", {}), ("mxfp8", {})])
def test_mlp_matches_dequantized_float_model(mode, kw):
    model = MLP(64, 96, nnx.Rngs(0))
    x = _x((3, 5, 64))
    y_float = model(x)
    paths = jqnnx.quantize(model, mode, **kw)
    assert sorted(paths) == [("down",), ("up",)]
    assert isinstance(model.up, jqnnx.QuantizedEinsum)
    assert isinstance(model.up.qweight.get_value(), jq.QuantizedArray)
    want_mode = {"mxfp8": "mxfp8_e4m3"}.get(mode, mode)
    assert model.up.qweight.get_value().mode == want_mode
    y = model(x)
    want = _float_twin(model)(x)
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)
    # and quantization changed the function only by the format's error
    rel = float(jnp.linalg.norm(y - y_float) / jnp.linalg.norm(y_float))
    assert 0 < rel < 0.25


@pytest.mark.slow
def test_transformer_block_under_nnx_jit_and_split_merge():
    model = Block(64, 4, 128, nnx.Rngs(0))
    x = _x((2, 7, 64))
    paths = jqnnx.quantize(model, "mxfp4")
    # q/k/v/out of the attention (LinearGeneral) and the MLP (Linear)
    assert {p[-1] for p in paths} == {"query", "key", "value", "out", "up", "down"}
    want = _float_twin(model)(x)

    @nnx.jit
    def run(m, x):
        return m(x)

    np.testing.assert_allclose(run(model, x), want, rtol=3e-5, atol=3e-5)
    graphdef, state = nnx.split(model)
    leaves = jax.tree_util.tree_leaves(state)
    assert any(a.dtype == jnp.uint32 for a in leaves)  # packed data in the state
    again = nnx.merge(graphdef, state)
    np.testing.assert_allclose(again(x), want, rtol=3e-5, atol=3e-5)

    @jax.jit
    def pure(state, x):  # the functional API: state in, output out
        return nnx.merge(graphdef, state)(x)

    np.testing.assert_allclose(pure(state, x), want, rtol=3e-5, atol=3e-5)


def test_einsum_with_batch_axis_and_bias():
    # heads (N) is a batch axis of the weight: one [D, H] matrix per head
    layer_holder = nnx.Dict({"proj": nnx.Einsum("btnh,nhd->btnd", (4, 32, 16), (4, 16),
                                                rngs=nnx.Rngs(0))})
    layer_holder["proj"].bias[...] = _x((4, 16), seed=3)
    x = _x((2, 3, 4, 32))
    jqnnx.quantize(layer_holder, "affine", bits=8, group_size=32)
    q = layer_holder["proj"]
    assert q.qweight.get_value().shape == (4, 16, 32)  # [heads, D, H]
    want = _float_twin(layer_holder)["proj"](x)
    np.testing.assert_allclose(q(x), want, rtol=2e-5, atol=2e-5)


def test_filter_selects_layers():
    model = MLP(64, 64, nnx.Rngs(0))
    paths = jqnnx.quantize(model, "mxfp4", filter=lambda path, m: path[-1] == "down")
    assert paths == [("down",)]
    assert isinstance(model.up, nnx.Linear) and isinstance(model.down, jqnnx.QuantizedEinsum)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model must be a flax.nnx.Module"):
        jqnnx.quantize({"w": 1}, "mxfp4")
    with pytest.raises(TypeError, match="filter must be callable"):
        jqnnx.quantize(MLP(64, 64, nnx.Rngs(0)), "mxfp4", filter="up")
    with pytest.raises(ValueError, match="layer up: .*multiple of group_size"):
        jqnnx.quantize(MLP(48, 64, nnx.Rngs(0)), "mxfp4")  # K = 48, groups of 32
    with pytest.raises(ValueError, match="mode="):
        jqnnx.quantize(MLP(64, 64, nnx.Rngs(0)), "int3")
    gen = nnx.Dict({"g": nnx.LinearGeneral(64, 8, axis=0, rngs=nnx.Rngs(0))})
    with pytest.raises(ValueError, match="axis=.*not supported"):
        jqnnx.quantize(gen, "mxfp4")


SHARDED = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from flax import nnx
import jaxquant as jq, jaxquant.nnx as jqnnx

mesh = jax.make_mesh((4,), ("model",))
with jax.set_mesh(mesh):
    layer = nnx.Dict({"up": nnx.Linear(128, 256, rngs=nnx.Rngs(0), kernel_init=
        nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")))})
    x = jax.random.normal(jax.random.key(1), (2, 128))
    jqnnx.quantize(layer, "mxfp4")
    qw = layer["up"].qweight.get_value()
    print(tuple(qw.data.sharding.spec), tuple(qw.scales.sharding.spec))
    y = nnx.jit(lambda m, x: m["up"](x))(layer, x)
    want = x @ jq.dequantize(qw, dtype=jnp.float32).T + layer["up"].bias[...]
    print(float(jnp.max(jnp.abs(y - want))))
"""


def test_sharded_kernel_keeps_its_sharding():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    # kernel [K, N] split on N over "model" -> qw [N, K] split on its first axis
    assert lines[0] == "('model', None) ('model', None)", lines
    assert float(lines[1]) < 1e-4
