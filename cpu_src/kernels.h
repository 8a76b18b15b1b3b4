// CPU kernels of the ffi backend. kernels_impl.inc is compiled once per ISA:
// AVX-512 F/BW/VL/DQ/VBMI (kernels_avx512.cc: the GEMV in 16 lanes), AVX2+FMA+F16C
// (kernels_avx2.cc), NEON on arm64 (kernels_neon.cc) and the baseline ISA
// (kernels_base.cc); cpu_ffi.cc picks the best one the CPU has at run time
// (JAXQUANT_FFI_CPU_ISA forces a lower one).
#pragma once

#include <stdint.h>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "jq/codec.h"
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
  // x[sx] for k in [k0, k1) into xt (gemm_x_floats per x slot), in the GEMM's packed
  // order.
  void (*gemm_pack_x)(const QmvProblem& p, int64_t sx, int64_t k0, int64_t k1, float* xt);
  int64_t (*gemm_scratch)(const QmvProblem& p);
  int64_t gemm_rows;   // weight rows of one GEMM work item (its decoded panel)
  int64_t (*gemm_x_floats)(const QmvProblem& p);  // packed x's floats per x slot
};

const Kernels* kernels_avx512();  // nullptr where not compiled in
const Kernels* kernels_avx2();    // nullptr where not compiled in
const Kernels* kernels_neon();    // nullptr where not compiled in
const Kernels* kernels_base();

// The float environment a kernel runs in, set on each thread for the call: float32
// subnormals flushed like XLA's CPU code does (x86: MXCSR's FTZ and DAZ; arm64:
// FPCR.FZ, which flushes inputs and results), or kept (the MX dequantize, whose
// reference builds subnormal results exactly from bits: every E8M0-scaled element is a
// float32 number). One rule for the handlers (cpu_ffi.cc) and the ISA test's driver
// (tests/native/cpu_kernels_driver.cc).
inline bool dequant_flushes_denormals(const DequantProblem& p) {
  return kFormats[p.fmt].scale != kScaleE8M0;
}

struct FlushDenormals {
#if defined(__x86_64__)
  unsigned saved;
  explicit FlushDenormals(bool flush) : saved(_mm_getcsr()) {
    _mm_setcsr(flush ? (saved | 0x8040u) : (saved & ~0x8040u));  // FTZ | DAZ
  }
  ~FlushDenormals() { _mm_setcsr(saved); }
#elif defined(__aarch64__)
  uint64_t saved;
  explicit FlushDenormals(bool flush) {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved));
    const uint64_t fz = uint64_t{1} << 24;
    const uint64_t v = flush ? (saved | fz) : (saved & ~fz);
    __asm__ __volatile__("msr fpcr, %0" : : "r"(v));
  }
  ~FlushDenormals() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved)); }
#else
  explicit FlushDenormals(bool) {}
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace cpu
}  // namespace jq
