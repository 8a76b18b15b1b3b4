"""Load a single GGUF file (llama.cpp) into the decoder's parameters
(`models.checkpoint.load("model.gguf")` dispatches here; docs/checkpoints.md).

Architectures (`general.architecture`): llama (also Mistral's GGUFs, and
Mixtral's: llama with `llama.expert_count` and stacked expert tensors
ffn_{gate,up,down}_exps, as convert_hf_to_gguf writes them), qwen2, qwen3,
qwen3moe, gpt-oss. The GGUF metadata gives the Config; tensors are read
through `jq.io.from_gguf_tensor`, layer by layer, and stay in their quantized
form (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K as exact affine group-32 arrays,
Q2_K/Q6_K as affine group 16, Q3_K as fp4 group 16, MXFP4 as mxfp4, IQ4_NL/IQ4_XS
as iq4nl); float
tensors (F32/F16/BF16) are cast to `dtype`, or quantized to `mode` when one is
given, like a float checkpoint's.

What llama.cpp's converter (convert_hf_to_gguf.py) changed is undone exactly:
- llama: Q and K rows were permuted for ggml's adjacent-pair rope (`permute`:
  within each head, row s*hd/2 + i moved to 2i + s); the inverse row
  permutation is applied to the quantized rows (a permutation of whole rows,
  so exact) and the decoder's half-split rope sees Hugging Face's order.
  qwen2/qwen3/qwen3moe/gpt-oss use ggml's NEOX rope and were not permuted.
- gpt-oss: `gate_up_proj` (gate and up interleaved on rows) was split into
  ffn_gate_exps / ffn_up_exps; they load as e_gate / e_up (+ e_gate_bias /
  e_up_bias), which `checkpoint.load` fuses into e_gate_up (gate rows, then up
  rows: the decoder's order) like every other pair.

A matrix's layers are stacked for lax.scan, so they need one format. Where a
file mixes types across layers (llama.cpp's Q4_K_M puts some layers' ffn_down
and attn_v in Q6_K): affine layers of different widths or groups are widened
to the widest bits and split to the smallest group (codes unchanged, each
group's float32 scale and bias repeated over its pieces: exact), so a
Q4_K_M file loads with no float matrix; any other mix (fp4 beside affine)
makes that matrix float (`dtype`) in every layer, or `mode` if given.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant.io import gguf as io_gguf
from jaxquant.io import CheckpointError
from jaxquant.models.config import MAX_LAYERS, MAX_SIZE, MOE_FAMILIES, Config
from jaxquant.models.loader_checks import check_layer_count, check_shapes, layer_shapes
from jaxquant.models.params import quantize_args, quantize_matrix
from jaxquant.quantized_array import QuantizedArray

ARCHITECTURES = {"llama": "llama", "qwen2": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                 "gpt-oss": "gpt_oss"}
ATTENTION = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output"}
BIASES = {"bq": "attn_q", "bk": "attn_k", "bv": "attn_v", "bo": "attn_output"}
DENSE = {"w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


class GGUFFile:
    """A GGUF file's metadata (scalars and arrays by key) and tensors by name, read
    through `jq.io.gguf.open_reader` (bounded and checked); remembers which tensors
    were read, so that load can refuse the ones nothing used."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.reader = io_gguf.open_reader(self.path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.used = set()

    def get(self, key, default=None):
        return self.reader.fields.get(key, default)

    def __getitem__(self, key):
        if key not in self.reader.fields:
            raise CheckpointError(f"{self.path}: the GGUF metadata has no {key!r}")
        return self.reader.fields[key]

    def __contains__(self, name):
        return name in self.tensors

    def int(self, key, default=None, lo=1, hi=MAX_SIZE) -> int:
        """An integer metadata value in [lo, hi] (required when default is None)."""
        value = self[key] if default is None else self.get(key, default)
        if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                or not lo <= value <= hi):
            raise CheckpointError(f"{self.path}: metadata {key}={value!r:.80} must be an "
                                  f"integer in [{lo}, {hi}]")
        return int(value)

    def number(self, key, default, positive=True) -> float:
        """A finite number (> 0 if positive, else >= 0) as the decimal it was written from."""
        value = self.get(key, default)
        if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number))
                or not np.isfinite(value) or value < 0 or (positive and value == 0)):
            raise CheckpointError(f"{self.path}: metadata {key}={value!r:.80} must be a finite "
                                  f"number {'> 0' if positive else '>= 0'}")
        return _decimal(value)

    def string(self, key, default=None) -> str:
        value = self[key] if default is None else self.get(key, default)
        if not isinstance(value, str):
            raise CheckpointError(f"{self.path}: metadata {key}={value!r:.80} must be a string")
        return value

    def tensor(self, name, dtype=None):
        """`jq.io.from_gguf_tensor` of the tensor `name` (QuantizedArray or float numpy)."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        self.used.add(name)
        return io_gguf.from_gguf(self.reader, name, dtype=dtype)

    def check_all_used(self):
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            raise CheckpointError(f"{self.path}: tensors the metadata does not use: "
                                  f"{unused[:6]}{' ...' if len(unused) > 6 else ''} "
                                  f"({len(unused)}; a block_count that disagrees with the "
                                  f"weights?)")


def config_from_gguf(f: GGUFFile, dtype: str = "bfloat16") -> Config:
    """The decoder's Config from GGUF metadata ({arch}.block_count, ...), each value
    type- and range-checked, the layer count against the tensors present."""
    arch = f.string("general.architecture")
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise CheckpointError(f"{f.path}: general.architecture={arch!r} is not supported; "
                              f"expected one of {sorted(ARCHITECTURES)}")
    if arch == "llama" and f.get("llama.expert_count") not in (None, 0):
        family = "mixtral"  # llama.cpp stores Mixtral as llama with experts
        if "blk.0.ffn_gate_exps.weight" not in f:
            raise CheckpointError(f"{f.path}: llama.expert_count is set but there is no "
                                  f"'blk.0.ffn_gate_exps.weight': one tensor per expert "
                                  f"(ffn_gate.E, an older llama.cpp layout) is not supported; "
                                  f"convert the model again")
    heads, hidden = f.int(f"{arch}.attention.head_count"), f.int(f"{arch}.embedding_length")
    layers = f.int(f"{arch}.block_count", hi=MAX_LAYERS)
    check_layer_count(f.path, f.tensors, r"blk\.(\d+)\.", _Layers(layers))
    if f"{arch}.attention.key_length" not in f.reader.fields and hidden % heads:
        raise CheckpointError(f"{f.path}: {arch}.attention.head_count={heads} does not divide "
                              f"{arch}.embedding_length={hidden} (and there is no key_length)")
    if "token_embd.weight" not in f:
        raise CheckpointError(f"{f.path}: no tensor 'token_embd.weight'")
    kw = dict(family=family, vocab_size=_rows(f, "token_embd.weight"),
              hidden_size=hidden, num_layers=layers, num_heads=heads,
              num_kv_heads=f.int(f"{arch}.attention.head_count_kv", heads),
              head_dim=f.int(f"{arch}.attention.key_length", hidden // heads),
              intermediate_size=f.int(f"{arch}.feed_forward_length", 0, lo=0),
              rms_eps=f.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, positive=False),
              rope_theta=f.number(f"{arch}.rope.freq_base", 10000.0),
              rope_scaling=_rope_scaling(f, arch),
              tie_embeddings="output.weight" not in f,
              attention_bias="blk.0.attn_q.bias" in f,
              qk_norm="blk.0.attn_q_norm.weight" in f, dtype=dtype)
    if "rope_freqs.weight" in f:  # Llama 3's scaling, baked into per-frequency divisors
        kw["rope_freq_factors"] = tuple(float(v) for v in np.asarray(
            f.tensor("rope_freqs.weight"), np.float64).reshape(-1))
    if family in MOE_FAMILIES:
        norm = f.get(f"{arch}.expert_weights_norm", True)
        if not isinstance(norm, (bool, np.bool_)):
            raise CheckpointError(f"{f.path}: metadata {arch}.expert_weights_norm={norm!r:.80} "
                                  f"must be a bool")
        experts = f.int(f"{arch}.expert_count")
        # Mixtral's converter writes the experts' size as feed_forward_length only
        ffn = f"{arch}.expert_feed_forward_length"
        kw.update(num_experts=experts,
                  experts_per_token=f.int(f"{arch}.expert_used_count", hi=experts),
                  moe_intermediate_size=f.int(ffn if family != "mixtral" or ffn in f.reader.fields
                                              else f"{arch}.feed_forward_length"),
                  norm_topk_prob=bool(norm))
    if family == "gpt_oss":
        window = f.int(f"{arch}.attention.sliding_window", 0, lo=0)
        # llama.cpp's gpt-oss: sliding window on even layers (swa pattern 2), as HF's layer_types
        kw.update(sliding_window=window, layer_windows=tuple(window if i % 2 == 0 else 0
                                                             for i in range(layers)))
    try:
        return Config(**kw)
    except ValueError as e:
        raise CheckpointError(f"{f.path}: {e}") from None


class _Layers:
    """The one field check_layer_count reads, before a Config exists."""

    def __init__(self, n):
        self.num_layers = n


def _decimal(x) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not
    9.999999747378752e-06): the value the config it was converted from had."""
    return float(str(np.float32(x)))


def _rows(f: GGUFFile, name: str) -> int:
    return int(f.tensors[name].shape[-1])  # GGUF dims are reversed: the last is the row count


def _rope_scaling(f: GGUFFile, arch: str) -> tuple:
    """Hugging Face's rope_scaling from {arch}.rope.scaling.*."""
    pre = f"{arch}.rope.scaling."
    kind = f.get(pre + "type")
    if kind in (None, "none"):
        return ()
    if kind not in ("linear", "yarn"):
        raise CheckpointError(f"{f.path}: metadata {pre}type={kind!r:.80} is not supported "
                              f"('none', 'linear' or 'yarn')")
    rs = {"rope_type": kind, "factor": f.number(pre + "factor", 1.0)}
    if arch == "gpt-oss":  # its config.json's YaRN keeps the fractional correction range
        rs["truncate"] = False
    if f.get(pre + "original_context_length") is not None:
        rs["original_max_position_embeddings"] = f.int(pre + "original_context_length")
    for key in ("beta_fast", "beta_slow"):
        if f.get(pre + f"yarn_{key}") is not None:
            rs[key] = f.number(pre + f"yarn_{key}", None)
    return tuple(sorted(rs.items()))


# ---------------------------------------------------------------------------
# Row operations on float arrays and canonical QuantizedArrays (numpy children).


def _take_rows(w, index, axis=-2):
    """w with its rows (axis -2 of a matrix, -1 of a vector) reordered by `index`
    (exact: whole rows move)."""
    if isinstance(w, QuantizedArray):
        pick = lambda c: None if c is None else np.take(np.asarray(c), index, axis=-2)  # noqa: E731
        return w.replace(data=pick(w.data), scales=pick(w.scales), biases=pick(w.biases))
    return np.take(w, index, axis=axis)


def unpermute_rope_rows(w, n_head: int):
    """The inverse of convert_hf_to_gguf's `permute(w, n_head, n_head)`: within each
    head, GGUF row 2i + s goes back to row s*hd/2 + i."""
    n = w.shape[-2]
    hd = n // n_head
    index = np.arange(n).reshape(n_head, hd // 2, 2).swapaxes(1, 2).reshape(-1)
    return _take_rows(w, index)


def _widen(qw: QuantizedArray, bits: int, group_size: int) -> QuantizedArray:
    """An affine array at more bits and a smaller group (one that divides its own):
    the same codes, each group's float32 scale and bias repeated over its pieces
    (exact)."""
    codes = io_gguf.unpack_codes(np.asarray(qw.data), qw.bits)
    pieces = qw.group_size // group_size
    terms = [np.repeat(np.asarray(a, np.float32), pieces, axis=-1) for a in (qw.scales, qw.biases)]
    return QuantizedArray(io_gguf.pack_codes(codes, bits), *terms, mode="affine", bits=bits,
                          group_size=group_size, dtype=qw.dtype)


def _dequantize(w):
    if not isinstance(w, QuantizedArray):
        return w
    import jaxquant as jq
    return np.asarray(jq.dequantize(jax.tree_util.tree_map(jnp.asarray, w), dtype=jnp.float32))


def _one_format(parts: list, name: str) -> list:
    """Make a matrix's per-layer parts stackable (see the module docstring)."""
    kinds = {(p.mode, p.bits, p.group_size) if isinstance(p, QuantizedArray) else None
             for p in parts}
    if len(kinds) == 1:
        return parts
    if None not in kinds and {k[0] for k in kinds} == {"affine"}:
        # power-of-two groups: the smallest divides every other
        bits, group = max(k[1] for k in kinds), min(k[2] for k in kinds)
        return [p if (p.bits, p.group_size) == (bits, group) else _widen(p, bits, group)
                for p in parts]
    return [_dequantize(p) for p in parts]


# ---------------------------------------------------------------------------
# Loading.


class _Loader:
    def __init__(self, f: GGUFFile, cfg: Config, mode):
        self.f, self.cfg = f, cfg
        self.dtype = jnp.dtype(cfg.dtype)
        self.kw = None if mode in (None, "bf16") else quantize_args(mode)
        self.shapes = layer_shapes(cfg)

    def vector(self, name):
        w = self.f.tensor(name)
        if isinstance(w, QuantizedArray):
            raise CheckpointError(f"{self.f.path}: tensor {name!r} must be stored as a float "
                                  f"type (F32, F16 or BF16)")
        return np.asarray(w, np.float32)

    def matrix(self, name):
        """A matrix as stored: QuantizedArray (numpy children) or float32 numpy."""
        w = self.f.tensor(name, dtype=self.dtype)
        return w if isinstance(w, QuantizedArray) else np.asarray(w, np.float32)

    def device(self, w, quantize=True):
        """To the device: quantized as it is, float in dtype (or quantized to mode)."""
        if isinstance(w, QuantizedArray):
            return jax.tree_util.tree_map(jnp.asarray, w)
        w = jnp.asarray(w, self.dtype)
        return quantize_matrix(w, self.kw) if quantize and self.kw and w.ndim >= 2 else w

    def layer(self, i: int) -> dict:
        cfg, f, pre = self.cfg, self.f, f"blk.{i}."
        p = {"attn_norm": self.vector(pre + "attn_norm.weight"),
             "mlp_norm": self.vector(pre + ("post_attention_norm.weight"
                                            if cfg.family == "gpt_oss" else "ffn_norm.weight"))}
        for key, name in ATTENTION.items():
            p[key] = self.matrix(pre + name + ".weight")
        for key, name in BIASES.items():
            if pre + name + ".bias" in f:
                p[key] = self.vector(pre + name + ".bias")
        if cfg.qk_norm:
            p["q_norm"] = self.vector(pre + "attn_q_norm.weight")
            p["k_norm"] = self.vector(pre + "attn_k_norm.weight")
        if cfg.family == "gpt_oss":
            sinks = pre + "attn_sinks.weight"
            p["sinks"] = self.vector(sinks if sinks in f else pre + "attn_sinks")
            p["router"] = self.vector(pre + "ffn_gate_inp.weight")
            p["router_bias"] = self.vector(pre + "ffn_gate_inp.bias")
            p["e_gate"] = self.matrix(pre + "ffn_gate_exps.weight")
            p["e_up"] = self.matrix(pre + "ffn_up_exps.weight")
            p["e_gate_bias"] = self.vector(pre + "ffn_gate_exps.bias")
            p["e_up_bias"] = self.vector(pre + "ffn_up_exps.bias")
            p["e_down"] = self.matrix(pre + "ffn_down_exps.weight")
            p["e_down_bias"] = self.vector(pre + "ffn_down_exps.bias")
        elif cfg.moe:
            p["router"] = self.vector(pre + "ffn_gate_inp.weight")
            for key, name in (("e_gate", "ffn_gate_exps"), ("e_up", "ffn_up_exps"),
                              ("e_down", "ffn_down_exps")):
                p[key] = self.matrix(pre + name + ".weight")
        else:
            for key, name in DENSE.items():
                p[key] = self.matrix(pre + name + ".weight")
        check_shapes(f.path, p, self.shapes, f"layer {i}: ")
        if f["general.architecture"] == "llama":
            p["wq"] = unpermute_rope_rows(p["wq"], cfg.num_heads)
            p["wk"] = unpermute_rope_rows(p["wk"], cfg.num_kv_heads)
        return p


def load(path, mode=None, *, dtype="bfloat16", lm_head: bool = True):
    """(Config, params) from a .gguf file. mode: quantize the float matrices
    (F16/F32/BF16) on load; quantized GGUF tensors stay as they are."""
    f = GGUFFile(path)
    cfg = config_from_gguf(f, dtype=dtype)
    ld = _Loader(f, cfg, mode)
    layers = [ld.layer(i) for i in range(cfg.num_layers)]
    stacked = {}
    for key in list(layers[0]):
        parts = _one_format([lay[key] for lay in layers], key)
        parts = [ld.device(p) for p in parts]
        stacked[key] = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *parts)
        for lay in layers:  # host copies go as soon as the stack is on the device
            del lay[key]
    outer = {"embed": ld.matrix("token_embd.weight"), "final_norm": ld.vector("output_norm.weight")}
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_embeddings:
        outer["lm_head"] = ld.matrix("output.weight")
        shapes["lm_head"] = shapes["embed"]
    check_shapes(f.path, outer, shapes)
    f.check_all_used()
    params = {"layers": stacked,
              "embed": ld.device(outer["embed"], quantize=False),
              "final_norm": ld.device(outer["final_norm"])}
    if not cfg.tie_embeddings:
        params["lm_head"] = ld.device(outer["lm_head"], quantize=lm_head)
    return cfg, params


# ---------------------------------------------------------------------------
# Tokenizer.


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet inverted: printable char -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class GGUFTokenizer:
    """Decoding (ids -> text) with a GGUF file's own vocabulary (tokenizer.ggml.*):
    "gpt2" byte-level BPE (llama 3, qwen2/3, gpt-oss) and "llama" SentencePiece
    pieces (U+2581 for spaces, <0xNN> byte tokens). Control tokens are skipped.
    Encoding text needs the BPE merges and the model's pre-tokenizer regex, which
    this class does not implement."""

    CONTROL = 3  # llama.cpp's token type LLAMA_TOKEN_TYPE_CONTROL

    def __init__(self, f: GGUFFile):
        self.model = f.get("tokenizer.ggml.model")
        if self.model not in ("gpt2", "llama"):
            raise ValueError(f"tokenizer.ggml.model={self.model!r}: decoding supports 'gpt2' "
                             f"and 'llama'")
        self.tokens = f["tokenizer.ggml.tokens"]
        if not isinstance(self.tokens, list) or not all(isinstance(t, str) for t in self.tokens):
            raise CheckpointError(f"{f.path}: metadata tokenizer.ggml.tokens must be an array "
                                  f"of strings")
        types = f.get("tokenizer.ggml.token_type")
        if types is not None and not (isinstance(types, np.ndarray) and types.dtype.kind in "iu"):
            raise CheckpointError(f"{f.path}: metadata tokenizer.ggml.token_type must be an "
                                  f"array of integers")
        self.control = set() if types is None else {
            i for i, t in enumerate(types) if t == self.CONTROL}
        self.bos_id = f.get("tokenizer.ggml.bos_token_id")
        self.eos_id = f.get("tokenizer.ggml.eos_token_id")
        self._bytes = _byte_decoder() if self.model == "gpt2" else None

    def token_bytes(self, i: int) -> bytes:
        piece = self.tokens[i]
        if self.model == "gpt2":
            return bytes(self._bytes.get(c, 0x3F) for c in piece)
        if (len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
                and all(c in "0123456789abcdefABCDEF" for c in piece[3:5])):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def decode(self, ids) -> str:
        out = b"".join(self.token_bytes(int(i)) for i in ids if int(i) not in self.control)
        return out.decode("utf-8", errors="replace")


def tokenizer(path) -> GGUFTokenizer:
    return GGUFTokenizer(GGUFFile(path))


__all__ = ["GGUFFile", "GGUFTokenizer", "config_from_gguf", "load", "tokenizer",
           "unpermute_rope_rows"]
