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
};

const Kernels* kernels_avx512();  // nullptr where not compiled in
const Kernels* kernels_avx2();    // nullptr where not compiled in
const Kernels* kernels_base();

}  // namespace cpu
}  // namespace jq
