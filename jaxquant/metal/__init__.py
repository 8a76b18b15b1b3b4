"""The `metal` backend: the MSL kernels of metal_src/ run on an Apple GPU (docs/metal.md).

On macOS, CMake builds `lib/libjaxquant_metal.dylib` (the Objective-C++ bridge,
metal_src/metal_ffi.mm) and `lib/jaxquant.metallib` (the kernels; plus
`jaxquant_nax.metallib`, the tensor-op GEMM, where the SDK has Metal 4). Importing this
package loads them, registers the bridge's handlers as XLA FFI targets on the CPU
platform (the handlers run the kernels on the GPU over unified memory and return when
they are done), and registers the lowerings with `jaxquant.dispatch` as backend "metal".

Elsewhere the backend is not part of the build: `declare_not_built` keeps it out of
`jq.available_backends()`, and asking for it says that it is macOS only.

Targets (operands checked by the bridge, which returns an error instead of touching bad
memory):
  jaxquant_metal_dequantize      data, scales, biases|[0] -> [..., N, K]
  jaxquant_metal_qmv             x [Sx, M, K], data, scales, biases|[0], ids|[0] -> [S, M, N]
  jaxquant_metal_qmm             x [B, M, K], data [B, N, K/8], scales, biases|[0] -> [B, M, N]
  jaxquant_metal_rms_norm        x, weight|[0] -> y
  jaxquant_metal_add_rms_norm    x, residual, weight|[0] -> y, h
  jaxquant_metal_gated_rms_norm  x, gate, weight|[0] -> y

Automatic choice never picks metal yet: no Mac measurement backs it (docs/metal.md).
Ask for it with `backend="metal"`, `jq.backend("metal")` or JAXQUANT_BACKEND=metal.
"""

from __future__ import annotations

import sys

from jaxquant import dispatch

NOT_BUILT_REASON = "the Metal backend is macOS only (Apple GPUs); this platform is " + sys.platform

if sys.platform != "darwin":
    dispatch.declare_not_built("metal", NOT_BUILT_REASON)
else:
    from jaxquant.metal import kernels, loader

    _LIB = loader.load()
    if _LIB.handle is not None:
        kernels.register_kernels()
    dispatch.register_backend("metal", lambda: _LIB.error)
