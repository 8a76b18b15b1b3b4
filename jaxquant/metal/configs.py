"""Kernel choice of the metal backend, as data: the one place it lives.

- METAL_GEMV_MAX_M: the most rows of x per weight matrix that qmm runs as the Metal
  GEMV (jaxquant_metal_qmv); more rows take the GEMM (jaxquant_metal_qmm). It is a
  copy of metal_src/dispatch_plan.h's kGemvMaxM, the bridge's own plan, and a test
  (tests/test_metal.py) keeps the two equal.
"""

METAL_GEMV_MAX_M = 8
