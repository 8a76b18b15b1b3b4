// CPU kernels of the ffi backend. kernels_impl.inc is compiled once per ISA:
// AVX-512 F/BW/VL/DQ/VBMI (kernels_avx512.cc: the GEMV in 16 lanes), AVX2+FMA+F16C
// (kernels_avx2.cc) and the baseline ISA (kernels_base.cc); cpu_ffi.cc picks the
// best one the CPU has at run time (JAXQUANT_FFI_CPU_ISA forces a lower one).
#pragma once

#include <stdint.h>

#include "jq/problems.h"

namespace jq {
namespace cpu {

struct Kernels {
  const char* isa;
  // Dequantize rows [r0, r1) of p (rows = all dims but K).
  void (*dequant)(const DequantProblem& p, int64_t r0, int64_t r1);
  // y[s, :, n0:n1] of a fused dequantize-GEMV; `scratch` holds qmv_scratch(p) floats.
  void (*qmv)(const QmvProblem& p, int64_t s, int64_t n0, int64_t n1, float* scratch);
  // Norm rows [r0, r1); `scratch` holds 3 * p.d floats.
  void (*norm)(const NormProblem& p, int64_t r0, int64_t r1, float* scratch);
  // Floats of scratch one qmv call (one chunk of rows) needs.
  int64_t (*qmv_scratch)(const QmvProblem& p);
  // The blocked GEMM (qmm with many rows of x): y[s, :, n0:n1] for at most gemm_rows
  // weight rows, from x packed by gemm_pack_x; `scratch` holds gemm_scratch(p) floats.
  void (*gemm)(const QmvProblem& p, int64_t s, int64_t n0, int64_t n1, const float* xt,
               float* scratch);
  // x[sx] for k in [k0, k1) into xt, float32, in the GEMM's packed order (Mp: M rounded
  // up to gemm_lanes, rows past M zero); xt holds K * Mp floats per x slot.
  void (*gemm_pack_x)(const QmvProblem& p, int64_t sx, int64_t k0, int64_t k1, float* xt);
  int64_t (*gemm_scratch)(const QmvProblem& p);
  int64_t gemm_rows;   // weight rows of one GEMM work item (its decoded panel)
  int64_t gemm_lanes;  // Mp's multiple
};

const Kernels* kernels_avx512();  // nullptr where not compiled in
const Kernels* kernels_avx2();    // nullptr where not compiled in
const Kernels* kernels_base();

}  // namespace cpu
}  // namespace jq
