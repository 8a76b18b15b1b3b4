"""Checks the checkpoint loaders share (docs/checkpoints.md, "Validation"): a
checkpoint's layers against its config, and each loaded tensor's shape against the
shape the config implies. Every problem is a `jq.io.CheckpointError` naming the file."""

from __future__ import annotations

import re

from jaxquant.io import CheckpointError
from jaxquant.models.config import Config


def check_layer_count(where: str, names, pattern: str, cfg: Config) -> None:
    """The layer numbers in `names` (pattern: a regex whose group 1 is the number, e.g.
    r"model\\.layers\\.(\\d+)\\.") must be exactly 0 .. cfg.num_layers - 1."""
    found = {int(m.group(1)) for m in map(re.compile(pattern).match, names) if m}
    if found != set(range(cfg.num_layers)):
        extra = sorted(found - set(range(cfg.num_layers)))[:4]
        missing = sorted(set(range(cfg.num_layers)) - found)[:4]
        raise CheckpointError(f"{where}: the config says {cfg.num_layers} layers; the tensors "
                              f"have {len(found)}"
                              + (f", extra layers {extra}" if extra else "")
                              + (f", missing layers {missing}" if missing else ""))


def layer_shapes(cfg: Config) -> dict:
    """One layer's parameters (the decoder's names, before fusing) -> logical shape.
    gpt-oss's expert gate/up appear both fused (the Hugging Face layout) and split
    (GGUF's)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {"attn_norm": (h,), "mlp_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h),
              "wo": (h, q), "bq": (q,), "bk": (kv,), "bv": (kv,), "bo": (h,), "q_norm": (hd,),
              "k_norm": (hd,)}
    e, mi, i = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    if cfg.family == "gpt_oss":
        shapes.update(sinks=(cfg.num_heads,), router=(e, h), router_bias=(e,),
                      e_gate_up=(e, 2 * mi, h), e_gate_up_bias=(e, 2 * mi), e_gate=(e, mi, h),
                      e_up=(e, mi, h), e_gate_bias=(e, mi), e_up_bias=(e, mi),
                      e_down=(e, h, mi), e_down_bias=(e, h))
    elif cfg.moe:
        shapes.update(router=(e, h), e_gate=(e, mi, h), e_up=(e, mi, h), e_down=(e, h, mi))
    else:
        shapes.update(w_gate=(i, h), w_up=(i, h), w_down=(h, i))
    return shapes


def logical_shape(w) -> tuple:
    """A loaded parameter's logical shape (a PermutedMatrix's is its matrix's)."""
    inner = getattr(w, "matrix", None)
    return tuple((inner if inner is not None and not hasattr(w, "ndim") else w).shape)


def check_shapes(where: str, params: dict, shapes: dict, what: str = "") -> None:
    """Each entry of params must have its shape in `shapes` (and be named there)."""
    for key, w in params.items():
        want = shapes.get(key)
        got = logical_shape(w)
        if want is None or got != tuple(want):
            raise CheckpointError(f"{where}: {what}{key} has shape {list(got)}; the config "
                                  f"implies {list(want) if want else 'no such parameter'}")
