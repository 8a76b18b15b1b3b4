"""Load Hugging Face-layout checkpoint directories (config.json + *.safetensors)
into the decoder's parameters (docs/models.md).

Families: Llama / Mistral / Qwen2 / Qwen3 (dense), Qwen3-MoE, Mixtral and gpt-oss.
- Float (bf16/fp16/fp32) matrices are quantized on load to `mode` (a
  `jaxquant.models.MODES` name or jq.quantize arguments), layer by layer; with
  mode=None they stay float.
- gpt-oss's MXFP4 experts (`*_blocks` uint8 [E, N, K/32, 16], `*_scales` uint8
  [E, N, K/32]) are imported as they are through `jq.io.from_gpt_oss`: no
  dequantize-requantize round trip, whatever `mode` is.
- MLX-quantized checkpoints (mlx-lm's: config.json has "quantization"
  {"bits", "group_size"[, "mode"]}; a matrix is `{name}.weight` uint32 +
  `.scales` (+ `.biases`)) are imported through `jq.io.from_mlx_tensors`, the
  quantized embedding too; per-layer overrides in "quantization" are honoured.
- q/k/v and gate/up are fused on load (rows concatenated before quantizing:
  the same codes as each part's own), and gpt-oss's gate/up rows, interleaved
  in the checkpoint, are reordered gate rows first, then up rows (exact).
- Quantized matrices come back in the default device's fastest kernel layout
  (`layout`, as jq.prepack: "canonical" to opt out).
- GPTQ, AWQ and compressed-tensors checkpoints (config.json's
  "quantization_config" with quant_method "gptq", "awq" or "compressed-tensors")
  keep their quantized matrices as they are, imported exactly through
  `jq.io.from_gptq` / `from_awq` / `from_compressed_tensors` (`hf_quantized_matrix`;
  docs/checkpoints.md); act-order GPTQ matrices become `PermutedMatrix`.
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxquant as jq
from jaxquant.io import CheckpointError
from jaxquant.io.safetensors import SafetensorsFile
from jaxquant.models import parallel
from jaxquant.models.config import Config, from_hf
from jaxquant.models.layers import PermutedMatrix
from jaxquant.models.layerwise import MixedLayers, build_layers, release_on_failure
from jaxquant.models.loader_checks import check_layer_count, check_shapes, layer_shapes
from jaxquant.models.params import (MATRICES, default_per_layer, fuse_layer, fuse_params,
                                    mixed_formats, prepack_matrix, prepack_params, quantize_args,
                                    quantize_matrix, stack_layers, unstack_layers)
from jaxquant.quantized_array import QuantizedArray

ATTENTION = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj"}
BIASES = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
          "bv": "self_attn.v_proj.bias", "bo": "self_attn.o_proj.bias"}
DENSE = {"w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
#: An MoE family's expert block: (the block's module, the router's module inside it, each
#: expert's gate / up / down module). Experts are `{block}.experts.{e}.{module}`.
EXPERTS = {
    "qwen3_moe": ("mlp", "gate", {"e_gate": "gate_proj", "e_up": "up_proj",
                                  "e_down": "down_proj"}),
    "mixtral": ("block_sparse_moe", "gate", {"e_gate": "w1", "e_up": "w3", "e_down": "w2"}),
}
#: mlx-lm stacks every expert of a block into `{block}.switch_mlp.{name}` ([E, N, K]).
SWITCH_MLP = {"e_gate": "gate_proj", "e_up": "up_proj", "e_down": "down_proj"}


#: Tensors a checkpoint may hold that are no weights (buffers older exports saved).
NOT_WEIGHTS = re.compile(r".*\.rotary_emb\.inv_freq$")
INDEX = "model.safetensors.index.json"


def _json(path: str):
    """A JSON file's contents; CheckpointError naming the file if it is no JSON."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) > MAX_JSON:
        raise CheckpointError(f"{path}: larger than {MAX_JSON} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


#: The largest config.json / index file read.
MAX_JSON = 64 << 20


class _Tensors:
    """The tensors of every *.safetensors file in a directory, each file's header
    checked (jq.io.safetensors.SafetensorsFile), read lazily by name; remembers which
    names were read, so that load can refuse the ones nothing used."""

    def __init__(self, path):
        self.dir = os.fspath(path)
        files = sorted(glob.glob(os.path.join(self.dir, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files")
        self._where = {}
        for file in files:
            st = SafetensorsFile(file)
            for name in st.names():
                if name in self._where:
                    raise CheckpointError(f"{file}: tensor {name!r} is also in "
                                          f"{self._where[name].path} (one file per name)")
                self._where[name] = st
        self._check_index()
        self.used = set()

    def _check_index(self):
        """model.safetensors.index.json, where present: a weight_map of tensor -> file
        inside the directory, agreeing with the files' own headers."""
        index = os.path.join(self.dir, INDEX)
        if not os.path.exists(index):
            return
        doc = _json(index)
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index}: needs a 'weight_map' object of tensor name -> file")
        for name, file in wmap.items():
            if os.path.basename(file) != file or file in ("", ".", ".."):
                raise CheckpointError(f"{index}: weight_map[{name!r}] = {file!r:.80} is not a "
                                      f"file inside the checkpoint directory")
            st = self._where.get(name)
            if st is None or os.path.basename(st.path) != file:
                raise CheckpointError(f"{index}: weight_map puts {name!r} in {file!r}; it is "
                                      f"{'in ' + st.path if st else 'in no file'}")
        unlisted = sorted(set(self._where) - set(wmap))
        if unlisted:
            raise CheckpointError(f"{index}: weight_map does not list {unlisted[:4]} (in "
                                  f"{self._where[unlisted[0]].path})")

    def __contains__(self, name):
        return name in self._where

    def _entry(self, name):
        if name not in self._where:
            near = sorted(k for k in self._where if k.rsplit(".", 2)[0] in name)[:8]
            raise CheckpointError(f"{self.dir}: the checkpoint has no tensor {name!r} (similar: "
                                  f"{near})")
        self.used.add(name)
        return self._where[name]

    def __getitem__(self, name) -> np.ndarray:
        return self._entry(name).get(name)

    def check_float(self, name) -> None:
        """A float weight is refused (CheckpointError) unless stored with a float dtype."""
        st = self._entry(name)
        if st.dtype(name) not in FLOAT_DTYPES:
            raise CheckpointError(f"{st.path}: tensor {name!r} is a float weight but is stored "
                                  f"as {st.dtype(name)}")

    def floating(self, name) -> np.ndarray:
        self.check_float(name)
        return self._where[name].get(name)

    def where(self, prefix) -> str:
        """The file holding a `{prefix}.*` tensor (the directory if none)."""
        for name, st in self._where.items():
            if name.startswith(prefix + "."):
                return st.path
        return self.dir

    def keys(self):
        return self._where.keys()

    def part(self, name, index) -> np.ndarray:
        """tensor[index] (a tuple of slices), read from the file without the rest."""
        return self._entry(name).part(name, index)

    def shape(self, name) -> tuple:
        return self._entry(name).shape(name)

    def check_all_used(self):
        unused = sorted(n for n in self._where if n not in self.used and not NOT_WEIGHTS.match(n))
        if unused:
            raise CheckpointError(f"{self._where[unused[0]].path}: tensors the config does not "
                                  f"use: {unused[:6]}{' ...' if len(unused) > 6 else ''} "
                                  f"({len(unused)}; a layer count or a tie_word_embeddings that "
                                  f"disagrees with the weights?)")


FLOAT_DTYPES = (np.dtype("<f8"), np.dtype("<f4"), np.dtype("<f2"), np.dtype(ml_dtypes.bfloat16))


def read_config(path) -> tuple[dict, str]:
    """(config.json as a dict, its path); CheckpointError naming the file unless it is
    a JSON object."""
    file = os.path.join(os.fspath(path), "config.json")
    hf = _json(file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: must be a JSON object; got {type(hf).__name__}")
    return hf, file


def _checked(tensors, prefix, fn, *args, **kw):
    """fn(*args, **kw), its complaints about module `prefix`'s data (the importers'
    ValueError / TypeError / KeyError) as one CheckpointError naming its file."""
    try:
        return fn(*args, **kw)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{tensors.where(prefix)}: {prefix}: {e}") from e


def load(path, mode=None, *, dtype="bfloat16", lm_head: bool = True, layout: str | None = None,
         fuse: bool = True, per_layer: bool | None = None, mesh=None):
    """(Config, params) from a checkpoint directory (or a single .gguf file:
    models.gguf_checkpoint). mode: quantize float matrices on load (None keeps
    them float); dtype: the activation / float weight dtype;
    layout: the kernel layout of the quantized matrices (None: the default
    device's fastest, as jq.prepack; "canonical" keeps the exchange layout);
    fuse: q/k/v and gate/up as one matrix each (models.fuse_params);
    per_layer: the layers as separate buffers, read one at a time (None: the
    default device's fastest form, models.params.default_per_layer, or
    per-layer buffers where a matrix's format differs between layers, as in
    mlx_lm's mixed-bit recipes); stacked (False), a matrix must have one format
    in every layer.

    mesh: a ("tp", "ep") mesh (parallel.make_mesh): the params come back placed
    as parallel.shard_params places them (the same values), read a layer at a
    time. The attention and dense-MLP matrices, float or MLX-quantized, are read
    slice by slice: each device's block of rows (or whole groups of K) straight
    from the file (jax.make_array_from_callback over safetensors' get_slice), then
    quantized where they sit (`mode`); q/k/v and gate/up stay separate parts when
    "tp" has several devices. The other tensors (norms, biases, embeddings, the
    experts, GPTQ / AWQ / compressed-tensors matrices) are read whole, one
    layer's at a time, and placed."""
    if os.fspath(path).endswith(".gguf"):
        from jaxquant.models import gguf_checkpoint
        cfg, params = gguf_checkpoint.load(path, mode, dtype=dtype, lm_head=lm_head)
        if fuse:
            params = fuse_params(params)
        if default_per_layer() if per_layer is None else per_layer:
            params = unstack_layers(params)
        return cfg, prepack_params(params, layout)
    hf, file = read_config(path)
    try:
        cfg = from_hf(hf, dtype=dtype)
    except ValueError as e:
        msg = str(e)
        raise CheckpointError(os.path.join(os.fspath(path), msg) if msg.startswith("config.json")
                              else f"{file}: {msg}") from None
    tensors = _Tensors(path)
    check_layer_count(os.fspath(path), tensors.keys(), r"model\.layers\.(\d+)\.", cfg)
    quant = _Quantizer(mode, hf.get("quantization"), dtype, hf.get("quantization_config"), file,
                       layout)
    if mesh is not None:
        return cfg, _load_sharded(cfg, tensors, quant, mesh, lm_head=lm_head, layout=layout,
                                  fuse=fuse, per_layer=per_layer)
    # a layer at a time: read, fused, quantized, in `layout`, then written into the
    # result (stacked: in place), so the device holds the model and one layer's temporaries
    def convert(i, _):
        return {k: prepack_matrix(v, layout) for k, v in _layer(cfg, tensors, quant, i, fuse).items()}

    try:
        layers = build_layers(cfg.num_layers, convert,
                              default_per_layer() if per_layer is None else per_layer)
    except MixedLayers:
        if per_layer is not None:
            raise
        # a matrix's format differs between layers (mlx_lm's mixed-bit recipes): the
        # default form is then per-layer buffers, the one form that runs them
        layers = build_layers(cfg.num_layers, convert, True)
    params = {"layers": layers}
    try:
        params.update(_outer(cfg, tensors, quant))
        if not cfg.tie_embeddings:
            head = params["lm_head"]
            params["lm_head"] = prepack_matrix(quant.quantize(head) if lm_head else head, layout)
        tensors.check_all_used()
    except BaseException as e:
        release_on_failure(e, params)
        params = layers = None
        raise
    return cfg, params


def _outer(cfg, tensors, quant) -> dict:
    """The embedding, final norm and (untied) head, as stored, their shapes checked."""
    out = {"embed": quant.matrix(tensors, "model.embed_tokens"),
           "final_norm": quant.float(tensors, "model.norm.weight")}
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_embeddings:
        out["lm_head"] = quant.matrix(tensors, "lm_head")
        shapes["lm_head"] = shapes["embed"]
    else:
        check_tied_head(tensors)
    check_shapes(quant.config_file, out, shapes)
    return out


def check_tied_head(tensors, rows: int = 4096) -> None:
    """Some exporters store `lm_head.*` beside the embedding of a tied model; transformers
    then ties (ignores the copy). The copy is accepted, and counted as used, where it
    equals the embedding bit for bit (compared `rows` rows at a time, so a large
    vocabulary costs no whole second copy); a different head means the config and the
    weights disagree, and check_all_used refuses it."""
    heads = [n for n in tensors.keys() if n.startswith("lm_head.")]
    if not all(same_tensor(tensors, name, "model.embed_tokens." + name[len("lm_head."):], rows)
               for name in heads):
        tensors.used.difference_update(heads)  # reading them marked them: unmark


def same_tensor(tensors, a: str, b: str, rows: int) -> bool:
    if b not in tensors or tensors.shape(a) != tensors.shape(b):
        return False
    shape = tensors.shape(a)
    for r in range(0, max(shape[0], 1) if shape else 1, rows):
        index = (slice(r, r + rows),) if shape else ()
        x, y = tensors.part(a, index), tensors.part(b, index)
        if x.dtype != y.dtype or x.tobytes() != y.tobytes():
            return False
    return True


class _Quantizer:
    def __init__(self, mode, mlx_quant, dtype, hf_quant=None, config_file="config.json",
                 layout=None):
        # jq.quantize straight into the layout load returns: no repack after
        self.kw = None if mode in (None, "bf16") else dict(quantize_args(mode), layout=layout)
        self.mlx = mlx_quant
        self.dtype = jnp.dtype(dtype)
        self.config_file = config_file
        method = (hf_quant or {}).get("quant_method")
        self.hf_quant = hf_quant if method in HF_QUANT_METHODS else None

    def array(self, a):
        return jnp.asarray(np.asarray(a), self.dtype)

    def float(self, tensors, name):
        """The float tensor `name` in dtype (refused unless stored as a float)."""
        return self.array(tensors.floating(name))

    def mlx_args(self, prefix):
        q = self.mlx
        own = q.get(prefix) if isinstance(q, dict) else None
        if isinstance(own, dict):
            q = own
        if not isinstance(q, dict) or not all(k in q for k in ("bits", "group_size")):
            raise CheckpointError(f"{self.config_file}: 'quantization' needs 'bits' and "
                                  f"'group_size' (for {prefix})")
        return dict(bits=q["bits"], group_size=q["group_size"], mode=q.get("mode", "affine"))

    def matrix(self, tensors, prefix):
        """`{prefix}.weight` [N, K] (or MLX's quantized triple) -> float array (as
        stored), QuantizedArray (MLX's, GPTQ's, AWQ's, compressed-tensors') or
        PermutedMatrix (act-order GPTQ)."""
        if self.hf_quant is not None:
            w = _checked(tensors, prefix, hf_quantized_matrix, tensors, prefix, self.hf_quant,
                         self.dtype)
            if w is not None:
                return w
        if f"{prefix}.scales" in tensors:
            if self.mlx is None:
                raise CheckpointError(f"{tensors.where(prefix)}: {prefix}.scales is in the "
                                      f"checkpoint but config.json has no 'quantization' entry "
                                      f"(an MLX checkpoint's)")
            names = [f"{prefix}.{p}" for p in ("weight", "scales", "biases")
                     if f"{prefix}.{p}" in tensors]
            return _checked(tensors, prefix, jq.io.from_mlx_tensors,
                            {n: tensors[n] for n in names}, prefix, dtype=self.dtype,
                            **self.mlx_args(prefix))
        return self.float(tensors, f"{prefix}.weight")

    def quantize(self, w):
        """A float matrix [N, K] or expert stack [E, N, K] quantized to `mode` (as
        jq.quantize); QuantizedArrays, PermutedMatrix and mode=None leave it as it is."""
        if self.kw is None or isinstance(w, (QuantizedArray, PermutedMatrix)):
            return w
        return quantize_matrix(w, self.kw) if w.ndim == 2 else jq.quantize(w, **self.kw)


def _layer(cfg: Config, tensors, quant: _Quantizer, i: int, fuse: bool, matrix=None) -> dict:
    """Layer i's weights; matrix(key, prefix): the attention and dense-MLP matrices
    (default: quant.matrix, read whole). A ValueError about the tensors' data (a
    shape numpy cannot swap or split, say) becomes a CheckpointError naming the
    checkpoint."""
    try:
        return _read_layer(cfg, tensors, quant, i, fuse, matrix)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{tensors.dir}: layer {i}: {e}") from e


def _read_layer(cfg: Config, tensors, quant: _Quantizer, i: int, fuse: bool, matrix=None) -> dict:
    pre = f"model.layers.{i}."
    matrix = matrix or (lambda key, prefix: quant.matrix(tensors, prefix))
    p = {"attn_norm": quant.float(tensors, pre + "input_layernorm.weight"),
         "mlp_norm": quant.float(tensors, pre + "post_attention_layernorm.weight")}
    for key, name in ATTENTION.items():
        p[key] = matrix(key, pre + name)
    if cfg.attention_bias:
        for key, name in BIASES.items():
            if pre + name in tensors:
                p[key] = quant.float(tensors, pre + name)
    if cfg.qk_norm:
        p["q_norm"] = quant.float(tensors, pre + "self_attn.q_norm.weight")
        p["k_norm"] = quant.float(tensors, pre + "self_attn.k_norm.weight")
    if cfg.family == "gpt_oss":
        p.update(_gpt_oss_mlp(tensors, quant, pre))
    elif cfg.family in EXPERTS:
        p.update(_experts_mlp(cfg, tensors, quant, pre))
    else:
        for key, name in DENSE.items():
            p[key] = matrix(key, pre + name)
    check_shapes(quant.config_file, p, layer_shapes(cfg), f"layer {i}: ")
    if fuse:  # before quantizing: a fused matrix gets the codes its parts would
        p = fuse_layer(p)
    return {k: quant.quantize(v) if k in MATRICES else v for k, v in p.items()}


def _halves(a, axis):
    """Rows interleaved gate, up, gate, up, ... (gpt-oss's gate_up_proj) reordered
    gate rows first, then up rows: the decoder's one convention."""
    n = a.shape[axis]
    order = np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])
    return jnp.take(a, order, axis=axis)


def _gpt_oss_mlp(tensors, quant, pre):
    e = pre + "mlp.experts."
    p = {"sinks": quant.float(tensors, pre + "self_attn.sinks"),
         "router": quant.float(tensors, pre + "mlp.router.weight"),
         "router_bias": quant.float(tensors, pre + "mlp.router.bias"),
         "e_gate_up_bias": _halves(quant.float(tensors, e + "gate_up_proj_bias"), -1),
         "e_down_bias": quant.float(tensors, e + "down_proj_bias")}
    for key, name in (("e_gate_up", "gate_up_proj"), ("e_down", "down_proj")):
        if e + name + "_blocks" in tensors:  # MXFP4 as shipped: imported bit for bit
            p[key] = _checked(tensors, e + name, jq.io.from_gpt_oss, tensors[e + name + "_blocks"],
                              tensors[e + name + "_scales"], dtype=quant.dtype)
            p[key] = jax.tree_util.tree_map(jnp.asarray, p[key])
        else:  # a bf16 export: transformers keeps these as x @ W, [E, K, N]
            p[key] = quant.array(np.swapaxes(tensors.floating(e + name), -1, -2))
    qw = p["e_gate_up"]  # canonical rows are independent: reordering them is exact
    p["e_gate_up"] = (_halves(qw, -2) if not isinstance(qw, QuantizedArray) else
                      QuantizedArray(_halves(qw.data, -2), _halves(qw.scales, -2), None, None,
                                     mode=qw.mode, bits=qw.bits, group_size=qw.group_size,
                                     dtype=qw.dtype))
    return p


def _experts_mlp(cfg, tensors, quant, pre):
    """The router and the expert stacks [E, N, K] of an EXPERTS family's layer: float
    experts stacked (then quantized to `mode`), GPTQ / AWQ / compressed-tensors experts
    imported as one quantized stack, mlx-lm's stacked switch_mlp as it is."""
    block, router, names = EXPERTS[cfg.family]
    p = {"router": _router(tensors, quant, f"{pre}{block}.{router}")}
    for key, name in names.items():
        switch = f"{pre}{block}.switch_mlp.{SWITCH_MLP[key]}"
        if switch + ".weight" in tensors:
            p[key] = quant.matrix(tensors, switch)
            continue
        prefixes = [f"{pre}{block}.experts.{j}.{name}" for j in range(cfg.num_experts)]
        if quant.hf_quant is not None:
            stack = _quantized_experts(tensors, prefixes, quant)
            if stack is not None:
                p[key] = stack
                continue
        p[key] = quant.array(np.stack([tensors.floating(e + ".weight") for e in prefixes]))
    return p


def _router(tensors, quant, prefix):
    """A router's weight [E, D], float. mlx-lm quantizes routers (Qwen3-MoE's at 8
    bits, Mixtral's with every other linear): those are dequantized to float32, the
    dtype the routing runs in (exact: no rounding to `dtype` first)."""
    if f"{prefix}.scales" not in tensors:
        return quant.float(tensors, f"{prefix}.weight")
    w = quant.matrix(tensors, prefix)
    return jq.dequantize(jax.tree_util.tree_map(jnp.asarray, w), dtype=jnp.float32)


def _quantized_experts(tensors, prefixes, quant):
    """GPTQ / AWQ / compressed-tensors experts (one module per expert) -> one quantized
    stack [E, N, K], or None where the checkpoint keeps them float. Every expert must
    have one format; act-order permutations must be the identity (gather_qmm reads
    each token's expert in place, with no per-expert permutation of x)."""
    parts = [hf_quantized_matrix(tensors, e, quant.hf_quant, quant.dtype) for e in prefixes]
    if all(w is None for w in parts):
        return None
    if any(w is None for w in parts):
        raise ValueError(f"{prefixes[0].rsplit('.', 2)[0]}: some experts are quantized and "
                         f"some float; an expert stack needs one format")
    for e, w in zip(prefixes, parts):
        if isinstance(w, PermutedMatrix):
            if not np.array_equal(np.asarray(w.perm), np.arange(w.perm.shape[-1])):
                raise ValueError(f"{e}: act-order experts (a permutation of K per expert) are "
                                 f"not supported; the expert kernels read x unpermuted")
    parts = [w.matrix if isinstance(w, PermutedMatrix) else w for w in parts]
    kinds = {(w.mode, w.bits, w.group_size, w.scales.dtype, w.shape) for w in parts}
    if len(kinds) > 1:
        raise ValueError(f"{prefixes[0].rsplit('.', 2)[0]}: the experts are quantized "
                         f"differently ({sorted(map(str, kinds))[:3]}); a stack needs one "
                         f"format")
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *parts)


def _load_sharded(cfg, tensors, quant, mesh, *, lm_head, layout, fuse, per_layer):
    """load(..., mesh=mesh)'s params (its docstring)."""
    parts = mesh.shape[parallel.TP] > 1  # tp splits q/k/v and gate/up: keep the parts

    def matrix(key, prefix):
        spec = parallel.SPECS.get(key, (None,))[1:]
        if quant.hf_quant is None and f"{prefix}.scales" not in tensors:
            return _float_from_slices(tensors, f"{prefix}.weight", mesh, spec, quant.dtype)
        if quant.hf_quant is None:
            return _mlx_from_slices(tensors, prefix, quant, mesh, spec)
        return quant.matrix(tensors, prefix)  # read whole; placed below

    layers = []
    for i in range(cfg.num_layers):
        p = _layer(cfg, tensors, quant, i, fuse and not parts, matrix)
        p = prepack_params({"layers": (p,)}, layout)["layers"][0]
        p = parallel.mesh_layouts(mesh, p, stacked=False)[0]  # K splits: the split layout
        layers.append(parallel.put_sharded(mesh, p, parallel.layer_specs(p, mesh)))
    params = {"layers": tuple(layers), **_outer(cfg, tensors, quant)}
    if not cfg.tie_embeddings:
        head = params["lm_head"]
        params["lm_head"] = prepack_params({"layers": (), "lm_head": quant.quantize(head)
                                            if lm_head else head}, layout)["lm_head"]
    tensors.check_all_used()
    stacked = not (default_per_layer() if per_layer is None else per_layer)
    if stacked and (per_layer is not None or not mixed_formats(params["layers"])):
        params = stack_layers(params)
    return parallel.shard_params(cfg, params, mesh)  # the rest placed; the layers stay


def _float_from_slices(tensors, name, mesh, spec, dtype):
    """tensor `name` as a jax.Array on `mesh` (spec, as parallel places it), each
    device's block read from the file on its own."""
    from jax.sharding import NamedSharding  # noqa: PLC0415

    tensors.check_float(name)
    shape = tensors.shape(name)
    sharding = NamedSharding(mesh, parallel.named_spec(mesh, jax.ShapeDtypeStruct(shape, dtype), spec))
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.asarray(tensors.part(name, index), dtype))


def _mlx_from_slices(tensors, prefix, quant, mesh, spec):
    """An MLX-quantized matrix as a QuantizedArray on `mesh` (spec, as parallel
    places it: rows, or whole groups of K), each device reading its rows / groups of
    the packed weight, scales and biases (jq.io.from_mlx_tensors on the slices)."""
    from jax.sharding import NamedSharding  # noqa: PLC0415


    names = [f"{prefix}.{p}" for p in ("weight", "scales", "biases")
             if f"{prefix}.{p}" in tensors]
    first_row = {n: tensors.part(n, (slice(0, 1),)) for n in names}
    args = quant.mlx_args(prefix)
    one = jq.io.from_mlx_tensors(first_row, prefix, dtype=quant.dtype, **args)
    n_rows, words = tensors.shape(f"{prefix}.weight")
    groups = tensors.shape(f"{prefix}.scales")[-1]
    logical = QuantizedArray.tree_unflatten(one.tree_flatten()[1], [
        None if c is None else jax.ShapeDtypeStruct((n_rows,) + tuple(c.shape[1:-1])
                                                    + (words if j == 0 else groups,), c.dtype)
        for j, c in enumerate(one.tree_flatten()[0])])
    specs = parallel.matrix_specs(mesh, logical, spec)

    def child(j, index):
        rows, cols = index[0], index[-1]
        per = words // groups if j == 0 else 1  # the child's columns per group
        g = slice(None if cols.start is None else cols.start // per,
                  None if cols.stop is None else cols.stop // per)
        part = {n: tensors.part(n, (rows, slice(g.start and g.start * (words // groups),
                                                g.stop and g.stop * (words // groups)))
                                if n.endswith(".weight") else (rows, g)) for n in names}
        qw = jq.io.from_mlx_tensors(part, prefix, dtype=quant.dtype, **args)
        return np.asarray(qw.tree_flatten()[0][j])

    children = [None if c is None else jax.make_array_from_callback(
        c.shape, NamedSharding(mesh, s), lambda index, j=j: child(j, index))
        for j, (c, s) in enumerate(zip(logical.tree_flatten()[0], specs.tree_flatten()[0]))]
    return QuantizedArray.tree_unflatten(logical.tree_flatten()[1], children)


HF_QUANT_METHODS = ("gptq", "awq", "compressed-tensors")
_CT_PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
             "weight_global_scale", "weight_g_idx")


def hf_quantized_matrix(tensors, prefix, quant_config, dtype):
    """Module `prefix` of a GPTQ / AWQ / compressed-tensors checkpoint, imported
    exactly (docs/checkpoints.md): a QuantizedArray, a PermutedMatrix (act-order
    GPTQ), or None where the checkpoint keeps that module in float."""
    method = quant_config["quant_method"]
    if method == "compressed-tensors":
        if f"{prefix}.weight_packed" not in tensors and f"{prefix}.weight_scale" not in tensors:
            return None
        own = {f"{prefix}.{p}": tensors[f"{prefix}.{p}"] for p in _CT_PARTS
               if f"{prefix}.{p}" in tensors}
        if f"{prefix}.weight_g_idx" not in own:
            return _on_device(jq.io.from_compressed_tensors(own, prefix, quant_config,
                                                            dtype=dtype))
        # group act-order: a permutation of K, as act-order GPTQ's (identity where the
        # groups are contiguous, so every matrix of the checkpoint stacks and fuses alike)
        qw, perm = jq.io.from_compressed_tensors_act_order(own, prefix, quant_config,
                                                           dtype=dtype)
        perm = np.arange(qw.shape[-1], dtype=np.int32) if perm is None else perm
        return PermutedMatrix(_on_device(qw), jnp.asarray(perm))
    if f"{prefix}.qweight" not in tensors:
        return None
    parts = [tensors[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales")]
    bits = int(quant_config.get("bits", quant_config.get("w_bit", 4)))
    if method == "awq":
        version = str(quant_config.get("version", "gemm")).lower()
        if version != "gemm" or not quant_config.get("zero_point", True):
            raise ValueError(f"AWQ version={version!r}, zero_point="
                             f"{quant_config.get('zero_point')!r}: only AutoAWQ's GEMM packing "
                             f"with zero points is supported")
        return _on_device(jq.io.from_awq(*parts, bits=bits, dtype=dtype))
    if quant_config.get("dynamic"):
        raise ValueError("GPTQ 'dynamic' per-module overrides are not supported")
    g_idx = tensors[f"{prefix}.g_idx"] if f"{prefix}.g_idx" in tensors else None
    fmt = quant_config.get("checkpoint_format") or quant_config.get("format") or "gptq"
    qw, perm = jq.io.from_gptq(*parts, g_idx, bits=bits, checkpoint_format=fmt, dtype=dtype)
    qw = _on_device(qw)
    if perm is None and not quant_config.get("desc_act"):
        return qw
    # act-order: every matrix carries a permutation (identity where its groups are
    # contiguous), so the layers stack alike and q/k/v (gate/up), whose permutations
    # are one where they share their input's statistics, fuse
    perm = np.arange(qw.shape[-1], dtype=np.int32) if perm is None else perm
    return PermutedMatrix(qw, jnp.asarray(perm))


def _on_device(qw):
    return jax.tree_util.tree_map(jnp.asarray, qw)


__all__ = ["hf_quantized_matrix", "load"]
