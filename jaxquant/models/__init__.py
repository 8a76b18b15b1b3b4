"""A small decoder on jaxquant (docs/models.md): dense Llama/Qwen3-style and
MoE gpt-oss/Qwen3-MoE-style blocks in plain JAX, Hugging Face / MLX checkpoint
loading, quantize-on-load, and tensor/expert-parallel sharding."""

from jaxquant.models.config import Config, from_hf
from jaxquant.models.decoder import (MODES, decode, forward, generate, init_cache, init_params,
                                     prefill, quantize_params, weight_bytes)
from jaxquant.models import checkpoint, parallel  # models.checkpoint.load without its own import

__all__ = ["Config", "MODES", "checkpoint", "decode", "forward", "from_hf", "generate",
           "init_cache", "init_params", "parallel", "prefill", "quantize_params", "weight_bytes"]
