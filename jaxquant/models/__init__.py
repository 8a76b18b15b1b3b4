"""A small decoder on jaxquant (docs/models.md): dense Llama/Qwen3-style and
MoE gpt-oss/Qwen3-MoE-style blocks in plain JAX, Hugging Face / MLX checkpoint
loading, quantize-on-load, and tensor/expert-parallel sharding."""

from jaxquant.models.config import Config, from_hf
from jaxquant.models.decoder import decode, forward, init_cache, prefill
from jaxquant.models.params import (MODES, a8_params, device_bytes, fuse_params, init_params,
                                    prepack_params, quantize_params, stack_layers, unfuse_params,
                                    unstack_layers, weight_bytes)
from jaxquant.models.sampling import GREEDY, Sampling, filter_logits, generate, sample, stream
from jaxquant.models import checkpoint, parallel  # models.checkpoint.load without its own import

__all__ = ["Config", "GREEDY", "MODES", "Sampling", "a8_params", "checkpoint", "decode",
           "device_bytes",
           "filter_logits", "forward", "from_hf", "fuse_params", "generate", "init_cache",
           "init_params", "parallel", "prefill", "prepack_params", "quantize_params", "sample",
           "stack_layers", "stream", "unfuse_params", "unstack_layers", "weight_bytes"]
