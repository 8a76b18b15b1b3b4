"""Importers and exporters for quantized weights stored by other tools.

Every conversion is an exact bit permutation done with numpy (vectorized, no
loop over blocks): ``export(import(x))`` gives back ``x`` bit for bit, and
``import(export(qw))`` gives back qw's arrays. Importers return a
QuantizedArray whose children are numpy arrays (zero-copy views where the
layouts agree); ``jax.device_put(qw)`` moves it to a device.

jaxquant's side is docs/formats.md's exchange layout: ``data`` uint32
[..., N, K*bits/32], a little-endian bit stream along K (element k at bits
[k*bits, (k+1)*bits)), ``scales`` [..., N, K/group]. Exporters take a
QuantizedArray in any layout (docs/layouts.md) and write the canonical bytes.

Formats:

- MLX safetensors (`from_mlx_tensors` / `to_mlx_tensors`): ``{prefix}.weight``
  (uint32, already jaxquant's packing), ``{prefix}.scales``, ``{prefix}.biases``
  (affine only). Mode names are MLX's (``"mxfp8"`` is E4M3).
- Hugging Face gpt-oss MXFP4 (`from_gpt_oss` / `to_gpt_oss`): ``*_blocks``
  uint8 [..., N, G, 16] and ``*_scales`` uint8 [..., N, G], 32 E2M1 elements
  per block, element 2j in the low nibble of byte j, element 2j+1 in the high
  nibble; the scale is OCP E8M0 (value 2**(s-127)). The last two axes of
  ``blocks`` are K in blocks of 32, so e.g. ``gate_up_proj_blocks``
  [E, 2*I, H/32, 16] is the expert weight [E, N=2*I, K=H] (transformers'
  ``convert_moe_packed_tensors`` decodes it to [E, 2*I, H] and then transposes
  to its [E, in, out] parameter), ``down_proj_blocks`` [E, H, I/32, 16] is
  [E, N=H, K=I]. A byte view of ``data`` is exactly this layout.
- ggml ``block_mxfp4`` (`from_ggml_mxfp4` / `to_ggml_mxfp4`): 17-byte blocks,
  byte 0 the scale ``e``, bytes 1..16 ``qs``; element j (0..15) in the low
  nibble of ``qs[j]``, element j+16 in the high nibble. ggml decodes
  ``kvalues_mxfp4[nibble] * GGML_E8M0_TO_FP32_HALF(e)`` where
  ``kvalues_mxfp4 = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ...}`` is twice E2M1 and
  ``GGML_E8M0_TO_FP32_HALF(e) = 2**(e-128)`` (e >= 2: float bits (e-1) << 23;
  e = 1: 2**-127; e = 0: 2**-128). The product is ``e2m1 * 2**(e-127)``: the
  stored byte *is* the OCP E8M0 code (ggml's quantizer writes
  ``floor(log2(amax)) - 2 + 127``), so it is copied unchanged. Only e = 255
  differs: ggml reads it as the finite 2**128, OCP and jaxquant as NaN.
- 17-byte MXFP4 / 25-byte MXFP6 blocks (`from_mx_blocks` / `to_mx_blocks`):
  byte 0 the OCP E8M0 scale (unsigned: 2**(e-127), 255 = NaN); MXFP4: 16 bytes,
  element 2j in the *high* nibble of byte j, element 2j+1 in the low nibble;
  MXFP6 (E2M3 or E3M2): 24 bytes holding the 32 6-bit codes as a big-endian
  bit stream, most significant bit first: byte 0 = [E0 bits 5..0][E1 bits 5..4],
  byte 1 = [E1 bits 3..0][E2 bits 5..2], byte 2 = [E2 bits 1..0][E3 bits 5..0], ...
- GPTQ, AWQ and compressed-tensors (`from_gptq` / `to_gptq`, `from_awq` / `to_awq`,
  `from_compressed_tensors` / `to_compressed_tensors`): `jaxquant.io.hf` and docs/checkpoints.md.
- `load_safetensors` / `save_safetensors`: numpy dicts through the optional
  ``safetensors`` package (``pip install safetensors``, or ``jaxquant[safetensors]``).

Modules: `jaxquant.io.mlx_tensors`, `.gpt_oss`, `.mx_blocks` (ggml MXFP4 and
MX byte blocks), `.gguf` (GGUF tensors), `.hf` (GPTQ, AWQ, compressed-tensors),
`.safetensors`; their public names are re-exported here.
"""

from __future__ import annotations

from jaxquant.io._common import CheckpointError
from jaxquant.io.gguf import from_gguf, from_gguf_tensor, to_gguf_tensor
from jaxquant.io.gpt_oss import from_gpt_oss, to_gpt_oss
from jaxquant.io.hf import (from_awq, from_compressed_tensors, from_compressed_tensors_act_order,
                            from_gptq, to_awq, to_compressed_tensors, to_gptq)
from jaxquant.io.mlx_tensors import from_mlx_tensors, to_mlx_tensors
from jaxquant.io.mx_blocks import (MX_BLOCK_BYTES, from_ggml_mxfp4, from_mx_blocks, to_ggml_mxfp4,
                                   to_mx_blocks)
from jaxquant.io.safetensors import load_safetensors, save_safetensors

__all__ = [
    "CheckpointError", "from_awq", "from_compressed_tensors", "from_compressed_tensors_act_order",
    "from_ggml_mxfp4", "from_gguf", "from_gguf_tensor",
    "from_gpt_oss", "from_gptq", "from_mlx_tensors", "from_mx_blocks", "load_safetensors",
    "save_safetensors", "to_awq", "to_compressed_tensors", "to_ggml_mxfp4", "to_gguf_tensor",
    "to_gpt_oss", "to_gptq", "to_mlx_tensors", "to_mx_blocks",
]
